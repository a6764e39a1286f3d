"""Griffe extension: show the docstrings' Sphinx roles (:class:`~a.B`) as code spans (`B`)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class RstRoles(griffe.Extension):
    """Rewrites each docstring as it is loaded, before mkdocstrings parses its sections."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Replace the roles in ``obj``'s docstring."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
