"""Exercise: stage 2's gradient reduction.

    python -m minishard.exercise reduce_gradient

After backward, every rank holds the FULL gradient of a unit, ``full_grad``; here the unit is one
1-D parameter of ``numel`` elements, cut into ``world`` chunks of k = ceil(numel / world) (as in
shard_layout), so the gradient is ``numel`` real elements followed by zero padding, world x k
elements in all (k = len(full_grad) // world). (With several parameters the engine first copies
each rank's chunks side by side, then runs the same reduce-scatter.) The
optimizer on rank r updates only shard r, and needs the gradient AVERAGED over the ranks (each
rank saw a different slice of the batch). Return this rank's shard of that average, without the
padding: a 1-D tensor of the real elements of piece r (possibly 0 of them).

``reduce_scatter(out, full)`` makes ``out`` (k elements) this rank's piece of the element-wise
SUM of every rank's ``full``. Stages 2 and 3 run this as soon as a unit's gradient is ready, in
backward (minishard/zero/flat.py, ``reduce_grads``).
"""
import torch


def reduce_gradient(full_grad: torch.Tensor, numel: int, world: int, rank: int,
                    reduce_scatter) -> torch.Tensor:
    raise NotImplementedError("reduce-scatter, average, drop the padding")
