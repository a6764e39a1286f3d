"""Deprecated: moved to :mod:`slafload.tools.writer`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.writer",
    {
        "STORAGE_VERSION": "slafload.tools.writer",
        "CsrBlock": "slafload.tools.writer",
        "write_slaf": "slafload.tools.writer",
    },
)
