"""Exercise: where a rank's shard sits in a flat buffer.

    python -m minishard.exercise shard_layout

A ZeRO unit's parameters (``numels``: their element counts, in order) are laid end to end in one
flat buffer, padded at the end so that it divides into ``world`` equal pieces of k elements; rank
r owns piece r. Return ``(padded_numel, shard_start, shard_real)``:

    padded_numel   the length of the padded buffer (the smallest multiple of world that holds all)
    shard_start    where rank ``rank``'s piece starts in it
    shard_real     how many of the piece's k elements are real parameters, not padding

For parameters of 6, 3 and 5 elements on 4 ranks (minishard/flat.py draws it):

    full  = [a a a a a a b b b c c c c c | pad pad]      14 real, padded to 16, k = 4
    rank 3 owns full[12:16] -> (16, 12, 2)
"""


def shard_layout(numels: list[int], world: int, rank: int) -> tuple[int, int, int]:
    raise NotImplementedError("pad to a multiple of world, then find this rank's piece")
