"""Old import paths that keep working, with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved(old: str, new: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for module ``old`` whose names now live elsewhere.

    ``new`` maps each name to the module that holds it now; accessing it through ``old``
    (``from old import name`` included) warns once per call site and returns the object.
    """

    def __getattr__(name: str) -> object:
        if name not in new:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} has moved to {new[name]}.{name}; import it from there "
            f"({old} will be removed in slafload 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new[name]), name)

    return __getattr__
