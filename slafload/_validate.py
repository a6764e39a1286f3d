"""The one argument validator: integers named in errors, ``bool`` never accepted as one."""

from __future__ import annotations


def check_int(
    name: str, value: object, *, low: int = 1, high: int | None = None, none_ok: bool = False
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an ``int`` in ``[low, high]``.

    ``bool`` is refused although it subclasses ``int`` (``batch_size=True`` is a bug, not 1).
    With ``none_ok``, ``None`` passes too.
    """
    if none_ok and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value >= low and (high is None or value <= high):  # type: ignore[operator]
        return
    if high is not None:
        want = f"an integer in [{low}, {high}]"
    elif low == 1:
        want = "a positive integer"
    elif low == 0:
        want = "a non-negative integer"
    else:
        want = f"an integer >= {low}"
    raise ValueError(f"{name} must be {want}{' or None' if none_ok else ''}, got {value!r}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
