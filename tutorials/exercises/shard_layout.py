"""Exercise: which rows of each parameter a rank holds (FSDP2's layout, minishard's since issue 26).

    python -m minishard.exercise shard_layout

A ZeRO unit's parameters have the shapes ``shapes`` (in order). EACH parameter is cut along dim 0
into ``world`` chunks of c = ceil(R/world) rows (R = its dim-0 size; a 0-dim parameter counts as
one row of one element): rank r holds rows [r·c, (r+1)·c), clamped to R, so the last ranks hold
fewer rows, or none. For the collectives every rank's chunk is padded to c rows, and rank r's
shard puts its padded chunks side by side. Return ``(rows, widths, k)``:

    rows     per parameter, the (row_start, row_stop) this rank holds; a rank with no rows of
             it: (R, R)
    widths   per parameter, its padded chunk's size in elements: c x (elements per row), the same
             on every rank
    k        the size of this rank's shard: the sum of the widths (the same on every rank)

For a (3, 2), b (3,), c (5,) on 2 ranks (minishard/zero/flat.py draws it):

    rank 0's shard = [a0 a1 | b0 b1 | c0 c1 c2]        a0: row 0 of a (2 elements)
    rank 1's shard = [a2 _  | b2 _  | c3 c4 _ ]        _: padding
    rank 1 -> ([(2, 3), (2, 3), (3, 5)], [4, 2, 3], 9)

Not the concatenation cut in N (FSDP1's, and DeepSpeed's at stages 1-2): that one crosses
parameter boundaries, and the pieces are no longer rows of a parameter.
"""


def shard_layout(shapes: list[tuple[int, ...]], world: int, rank: int
                 ) -> tuple[list[tuple[int, int]], list[int], int]:
    raise NotImplementedError("cut each parameter's rows into world chunks of ceil(R/world)")
