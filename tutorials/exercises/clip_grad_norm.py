"""Exercise: clipping by the global gradient norm when each rank holds only shards.

    python -m minishard.exercise clip_grad_norm

Under ZeRO stages 1-3 each rank holds a disjoint piece (a shard) of every gradient: ``grads`` is
this rank's list of shard gradients (its rows of each parameter: ``p.grad`` of the parameters
``model.parameters()`` yields; 1-D here, some possibly empty). Together the ranks' shards are the
whole gradient, each element exactly once. Do what ``torch.nn.utils.clip_grad_norm_`` does
on the unsharded model:

    total = sqrt(Σ g² over EVERY element of every rank's shards)        (the 2-norm)
    scale every gradient in place by  min(1, max_norm / (total + 1e-6))
    return total (a float or a 0-d tensor), the norm BEFORE clipping

``all_reduce(t, op="sum")`` sums tensor ``t`` in place over the ranks. One call is enough.
"""
import torch


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, all_reduce):
    raise NotImplementedError("local sum of squares, one all_reduce, sqrt, scale")
