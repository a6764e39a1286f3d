"""Optional tqdm progress bars for long work (writing atlases, converting, benchmarks)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def progress_bar(enabled: bool, total: int, desc: str, unit: str = "cell") -> Any | None:
    """A tqdm bar on stderr, or ``None`` when disabled or tqdm is not installed."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        logger.warning("progress requested but tqdm is not installed; continuing without a bar")
        return None
    return tqdm(total=total, unit=unit, desc=desc)
