"""Stage 3: read the expression rows of a fetch as Arrow record batches.

A fetch is a list of contiguous cell ranges. ``cells.cell_start_index`` turns each into a
contiguous row range of ``expression.lance``, read with one Lance scan (``offset``/``limit``),
so no filter is evaluated and no row outside the fetch is decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from slafload.dataset import SlafDataset
from slafload.errors import ReadError, SlafloadError
from slafload.samplers import Fetch

logger = logging.getLogger(__name__)

COLUMNS = ["cell_integer_id", "gene_integer_id", "value"]


class Reader:
    """Reads whole cells from a pinned :class:`SlafDataset`.

    Args:
        dataset: The opened dataset; its pinned Lance version is read.
        batch_rows: Rows per Arrow record batch requested from Lance.
    """

    def __init__(self, dataset: SlafDataset, *, batch_rows: int = 1 << 20):
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        self.dataset = dataset
        self.batch_rows = batch_rows

    def row_ranges(self, fetch: Fetch) -> np.ndarray:
        """``int64[k, 2]`` expression row ranges of the fetch's cell ranges."""
        return self.dataset.cell_start[fetch.ranges]

    def read(self, fetch: Fetch) -> Iterator[pa.RecordBatch]:
        """Yield the record batches holding exactly the rows of ``fetch``, in range order.

        Raises:
            ReadError: storage failed; the message names the fetch and its cell ranges.
        """
        expression = self.dataset.expression
        for (cell_a, cell_b), (row_a, row_b) in zip(
            fetch.ranges.tolist(), self.row_ranges(fetch).tolist(), strict=True
        ):
            if row_b == row_a:
                continue
            try:
                scanner = expression.scanner(
                    columns=COLUMNS,
                    offset=row_a,
                    limit=row_b - row_a,
                    batch_size=self.batch_rows,
                    scan_in_order=True,
                )
                yield from scanner.to_batches()
            except SlafloadError:
                raise
            except Exception as exc:
                raise ReadError(
                    f"Reading cells [{cell_a}, {cell_b}) (expression rows [{row_a}, {row_b})) "
                    f"of fetch {fetch.index} from {self.dataset.uri!r} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
