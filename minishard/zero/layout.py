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
    of ``shapes`` cut along dim 0 into ``chunks`` pieces, seen from the holder of piece
    ``chunk`` (the module docstring's picture)."""

    def __init__(self, shapes: list[torch.Size], chunks: int, chunk: int) -> None:
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.numel = sum(self.numels)
        # each parameter is cut into ``chunks`` (N, or 1 at stage 0); ours is number ``chunk``
        self.chunks, self.chunk = n, r = chunks, chunk
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
        self.same_layout = n == 1 or (len(shapes) == 1 and not self.scalars)

    def is_replicated(self, j: int) -> bool:
        """Does every holder hold all of parameter j (one chunk, or a 0-dim parameter)?"""
        return self.chunks == 1 or j in self.scalars

    def region(self, full: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's padded region of a full-layout tensor, viewed (N, width_j): row r is
        what rank r holds of it."""
        start = self.chunks * self.offsets[j]
        return full[start:start + self.chunks * self.widths[j]].view(self.chunks, self.widths[j])

    def param_in(self, full: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's values in a full-layout tensor, shaped like it (padding left out)."""
        return self.region(full, j).view(-1)[:self.numels[j]].view(self.shapes[j])

    def regions(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [self.region(full, j) for j in range(len(self.shapes))]

    def shard_of(self, full: torch.Tensor, r: int) -> torch.Tensor:
        """Rank r's shard (k elements, padded) cut out of a full-layout tensor: a copy."""
        return torch.cat([region[r] for region in self.regions(full)])

    def shard_shape(self, j: int) -> torch.Size:
        """Parameter j's shape on this rank: its rows (the whole shape on one rank, or of a
        0-dim parameter)."""
        if self.chunks == 1 or not len(self.shapes[j]):
            return self.shapes[j]
        lo, hi = self.row_ranges[j]
        return torch.Size([hi - lo, *self.shapes[j][1:]])

    def my_rows(self, j: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter j's full ``value``, shaped like its shard."""
        lo, hi = self.row_ranges[j]
        return value.reshape(self.n_rows[j], self.row_numels[j])[lo:hi].view(self.shard_shape(j))
