"""Synthetic plate-ordered atlases (public face of :mod:`slafload.tools.synthetic`)."""

from slafload.tools.synthetic import write_atlas

__all__ = ["write_atlas"]
