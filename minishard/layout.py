"""Layout: which rows of which parameter sit where in a unit's shards, and nothing else.

No storage, no collectives: flat.py's buffers are built on it, and the checkpoint code reads
it. The picture (flat.py's docstring has the whole of it): each parameter is cut along dim 0
into N chunks of c = ceil(R / N) rows (the last ones fewer, maybe none), padded to c rows; rank
r's shard puts its chunk of every parameter side by side, k elements on every rank.
"""
from __future__ import annotations

import math

import torch

__all__ = ["Layout", "rows_of"]


def rows_of(n_rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dim-0 cut into ``ranks`` chunks of ceil(n_rows / ranks) that
    ``rank`` holds (empty for the last ranks when there are fewer rows than ranks)."""
    c = math.ceil(n_rows / ranks)
    return min(rank * c, n_rows), min((rank + 1) * c, n_rows)


class Layout:
    """Where every row of a unit's parameters sits, and nothing else (no storage): parameters
    of ``shapes`` cut along dim 0 into ``ranks`` chunks, seen from ``rank`` (the module
    docstring's picture)."""

    def __init__(self, shapes: list[torch.Size], ranks: int, rank: int) -> None:
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.numel = sum(self.numels)
        self.ranks, self._r = n, r = ranks, rank  # our chunk of each param is the r-th
        self.n_rows = [s[0] if len(s) else 1 for s in shapes]   # a 0-dim param: one row
        self.row_numels = [math.prod(s[1:]) for s in shapes]
        self.widths = [math.ceil(rows / n) * m for rows, m in zip(self.n_rows, self.row_numels)]
        self.offsets = [sum(self.widths[:j]) for j in range(len(shapes))]  # in the shard
        self.shard_numel = sum(self.widths)                  # k: what each rank sends
        self.padded_numel = n * self.shard_numel
        # the rows this rank owns (FSDP2's torch.chunk cut: a 0-dim parameter is one row, rank
        # 0's), and those it holds: the same, but every rank holds a 0-dim one (replicated)
        self.owned_rows = [rows_of(rows, n, r) for rows in self.n_rows]
        self.row_ranges = [cut if len(s) else (0, 1) for cut, s in zip(self.owned_rows, shapes)]
        self.scalars = [j for j, s in enumerate(shapes) if not len(s) and n > 1]
        self.shard_real = sum((hi - lo) * m for (lo, hi), m in zip(self.row_ranges,
                                                                    self.row_numels))
        # full and the shards have the same layout when each rank's shard is one piece of full
        self._same_layout = n == 1 or (len(shapes) == 1 and not self.scalars)

    def _region(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's padded region (N chunks) of a full-layout tensor."""
        start = self.ranks * self.offsets[j]
        return flat[start:start + self.ranks * self.widths[j]]

    def _rows_of_rank(self, flat: torch.Tensor, r: int, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Rank r's shard (k elements, padded) cut out of a full-layout tensor: a copy, into
        ``out`` when given."""
        return torch.cat([self._region(flat, j).view(self.ranks, -1)[r]
                          for j in range(len(self.widths))], out=out)

    def shard_shape(self, j: int) -> torch.Size:
        """Parameter j's shape on this rank: its rows (the whole shape on one rank, or of a
        0-dim parameter)."""
        if self.ranks == 1 or not len(self.shapes[j]):
            return self.shapes[j]
        lo, hi = self.row_ranges[j]
        return torch.Size([hi - lo, *self.shapes[j][1:]])

    def my_rows(self, j: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter j's full ``value``, shaped like its shard."""
        lo, hi = self.row_ranges[j]
        return value.reshape(self.n_rows[j], self.row_numels[j])[lo:hi].view(self.shard_shape(j))
