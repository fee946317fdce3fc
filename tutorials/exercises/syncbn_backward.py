"""Exercise: SyncBatchNorm's backward pass.

    python -m minishard.exercise syncbn_backward

Forward normalised each channel with the statistics of the GLOBAL batch (all ranks):
mean (C,), invstd = 1/sqrt(var + eps) (C,), n = the global number of values per channel.
This rank's input ``x`` and upstream gradient ``dy`` are (N_r, C) or (N_r, C, L); N_r may be 0.

Return ``(dx, dweight, dbias)`` for this rank:

    x̂ = (x - mean)·invstd
    A = Σ dy,  B = Σ dy·x̂       per channel, summed over ALL ranks' values (one all_reduce)
    dx      = weight·invstd·(dy - A/n - x̂·B/n)           shaped like x
    dweight = Σ dy·x̂ over THIS rank's values only       (C,)
    dbias   = Σ dy   over THIS rank's values only       (C,)

``all_reduce(t)`` sums tensor ``t`` in place over the ranks. Call it exactly ONCE, on every
rank (an empty rank too: its sums are zeros): one collective of 2C values per backward is the
point of SyncBatchNorm's design, and the checker counts them. Why parameter gradients stay local:
DDP or the ZeRO engine averages them across ranks afterwards. The derivation is at the end of
tutorials/03_sync_batchnorm.py; broadcast per-channel vectors with shape (1, C) or (1, C, 1).
"""
import torch


def syncbn_backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor, weight: torch.Tensor, n: int, all_reduce):
    raise NotImplementedError("local sums, one all_reduce of [Σdy, Σdy·x̂], then the formula")
