"""Reductions: a unit's full gradient becomes this rank's averaged shard gradient.

The engine calls :meth:`Reducer.grad_ready` when autograd has finished a flat buffer's gradient
(its post-backward hook) and :meth:`Reducer.finish` once, from the end-of-backward callback. In
between, the Reducer decides when each reduction is launched and when it is waited for; flat.py's
``reduce_grads`` moves the bytes (one all-reduce at stage 0, one reduce-scatter at 1-3, in one
collective for a whole bucket).

When a bucket is launched and how many may be in flight: [Note: buckets] in config.py
(``config.BUCKET_BYTES``, ``bucket_bytes``, ``MAX_REDUCTIONS_IN_FLIGHT``).

[Note: find_unused] With ``find_unused_parameters``, ranks may run different units, so the order
in which gradients become ready differs between ranks, while collectives must match. So:

* every rank launches its reductions at the END of backward, after every collective the backward
  itself issues (a SyncBatchNorm's), in ONE fixed order (:meth:`Reducer.launch_order`), zeros
  where this rank has no gradient. Launched as they become ready, they would interleave with
  those collectives differently on ranks that ran different branches: at stages 2-3 a rank that
  used a branch waited for that branch's reduction (at most two in flight) while a rank that
  did not waited in SyncBatchNorm's all-reduce for the first: a deadlock (tests/
  test_unused_branch_syncbn.py). The price: no overlap with the backward, and stages 2-3 hold
  every full gradient until its end, as stage 1 does;
* then ONE all-reduce(MAX) of a byte per trainable buffer ("this rank used it") tells every
  rank which buffers NO rank used: those get their gradient from before this backward back
  (``None`` usually), as in one process: Adam, momentum and weight decay leave them alone.
"""
from __future__ import annotations

import torch

from minishard import comm
from minishard.zero import config
from minishard.zero.flat import FlatBuffer, FlatMode, collective_key, reduce_grads

__all__ = ["Reducer", "clip_grad_norm", "MAX_REDUCTIONS_IN_FLIGHT"]

MAX_REDUCTIONS_IN_FLIGHT = 2  # stages 2-3: bounds the full gradients waiting for their reduction


class Reducer:
    """The gradient reductions of one engine's backward passes."""

    def __init__(self, units, *, free_grads_early: bool, bucket_bytes: int,
                 reduce_dtype: torch.dtype | None, find_unused: bool, every_group, log) -> None:
        self.units, self.log = units, log
        self.free_grads_early, self.bucket_bytes = free_grads_early, bucket_bytes
        self.reduce_dtype, self.find_unused, self.every_group = reduce_dtype, find_unused, every_group
        self._reduced: set[int] = set()     # ids of flats already reduced in this backward
        self._used: set[int] = set()        # find_unused: flats this rank had a gradient for
        self._in_flight: list[tuple[comm.Handle, int]] = []  # reductions and their grad bytes
        self._buckets: dict[bool, list[FlatBuffer]] = {}  # ready, not launched: by "is whole"
        self.shadowing = False  # Join: this rank has joined and runs an empty batch (join.py)

    def in_flight_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self._in_flight)

    def grad_ready(self, unit, j: int) -> None:
        """Buffer ``j`` of ``unit`` has its whole gradient on this rank."""
        self._reduce(unit, unit.flats[j])

    def _reduce(self, unit, flat: FlatBuffer) -> None:
        """Start ``flat``'s reduction (with find_unused_parameters: mark it, [Note: find_unused]).
        A second part of its gradient in the same backward (reentrant activation checkpointing
        backpropagates each checkpointed call in a backward of its own) is reduced too, as the
        reductions add up, unless the first still waits in a bucket and will take it along."""
        if id(flat) in self._reduced and (self.find_unused or flat.full.grad is None or any(
                f is flat for bucket in self._buckets.values() for f in bucket)):
            return
        self._reduced.add(id(flat))
        self.log("reduce", unit)
        if self.find_unused:  # launched at the end of backward, in the fixed order
            if not self.shadowing:  # a joined rank's empty batch uses nothing (join.py)
                self._used.add(id(flat))
        else:
            self._schedule(flat)

    def launch_order(self) -> list[FlatBuffer]:
        """[Note: find_unused]: the one order every rank reduces in."""
        return [f for u in reversed(self.units) for f in u.flats if f.requires_grad]

    def _schedule(self, flat: FlatBuffer) -> None:
        """Queue ``flat``'s reduction in its bucket; launch the bucket once it is full
        ([Note: buckets]: ``bucket_bytes`` at stages 2-3, where 0 launches every flat at once).
        A replicated buffer (mode NONE in a sharded engine) is all-reduced, not reduce-scattered:
        it waits in a bucket of its own, of config.BUCKET_BYTES, as DDP's gradients do."""
        whole = flat.mode is FlatMode.NONE
        cap = self.bucket_bytes if self.free_grads_early and not whole else config.BUCKET_BYTES
        bucket = self._buckets.get(whole, [])
        if bucket and collective_key(bucket[0]) != collective_key(flat):
            self._flush_bucket(whole)  # one collective moves one dtype
        bucket = self._buckets.setdefault(whole, [])
        bucket.append(flat)
        if sum(f.full_bytes() for f in bucket) >= cap:
            self._flush_bucket(whole)

    def _flush_bucket(self, whole: bool) -> None:
        """Launch a bucket; at stages 2-3 first wait for the oldest reduction if
        MAX_REDUCTIONS_IN_FLIGHT are unfinished, so no more than that many hold their send
        and receive buffers at once."""
        bucket = self._buckets.pop(whole, [])
        if not bucket:
            return
        while self.free_grads_early and len(self._in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
            self._in_flight.pop(0)[0].wait()
        nbytes = sum(f.full_bytes() for f in bucket)
        self._in_flight.append((reduce_grads(bucket, self.reduce_dtype), nbytes))

    def finish(self, sync_grads: bool) -> None:
        """End of backward: reduce what is left, wait for every reduction.

        A flat buffer whose gradient never became ready in this backward is reduced now if this
        rank holds a gradient for it (it was used only in earlier ``no_sync`` backwards). One that
        no rank used keeps ``grad=None``, as in single-process training: reducing zeros into it
        would make Adam, momentum and weight decay move weights that got no gradient. Without
        find_unused_parameters, "no rank" is "not this rank" (every rank reaches the same units).
        """
        if sync_grads:
            for unit in reversed(self.units):
                for flat in unit.flats:
                    if flat.requires_grad and flat.full.grad is not None:
                        self._reduce(unit, flat)
            unused = self._finish_in_order() if self.find_unused else []
        for whole in list(self._buckets):  # in the order the buckets began: the same on every rank
            self._flush_bucket(whole)
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight.clear()
        if sync_grads:
            for flat, grads_before in unused:  # no rank used it: leave its gradients as they were
                for p, grad in zip(flat.params, grads_before):
                    p.grad = grad
        self._reduced.clear()

    def _finish_in_order(self) -> list[tuple[FlatBuffer, list]]:
        """[Note: find_unused]: launch the whole fixed order, then the usage bitmap.
        Returns the flats no rank used, with their gradient before this backward."""
        order = self.launch_order()
        before = {id(f): [p.grad for p in f.params] for f in order}
        for flat in order:  # zeros where this rank has no gradient (FlatBuffer.take_grad)
            self._schedule(flat)
        used = torch.tensor([id(f) in self._used for f in order], dtype=torch.uint8)
        comm.all_reduce(used, "max", self.every_group, tag="ZeRO used flats")
        unused = [(f, before[id(f)]) for f, u in zip(order, used.tolist()) if not u]
        self._used = set()
        return unused


@torch.no_grad()
def clip_grad_norm(units, group, sharded: bool, max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """``model.clip_grad_norm_``: clip the gradients of the WHOLE model by its global norm, as
    torch's does on the unsharded model; returns the total norm before clipping.

    Each element counts once: a rank sums |g|^p over its shard gradients only (no padding; a
    tied weight has one slot; a replicated one, 0-dim or kept whole by ``replicate=``, on the
    shard group's rank 0), then one all-reduce over the shard ``group`` adds the ranks' sums
    (MAX for the inf-norm). Not ``sharded`` (stage 0): identical full gradients on every rank,
    no collective. With replicas (a 2-D mesh) the sum runs over the shard group only: adding
    every replica's would count each element R times."""
    norm_type = float(norm_type)
    lead = not sharded or comm.group_rank(group) == 0
    grads = [g for unit in units for g in unit.shard_grads()]
    counted = [g for unit in units for g in unit.shard_grads(owned=True, lead=lead)]
    device = next((f.full.device for u in units for f in u.flats), None)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == float("inf"):
        mine, op = max((g.abs().max().double() for g in counted if g.numel()), default=zero), "max"
    else:
        mine, op = sum((g.double().abs().pow(norm_type).sum() for g in counted), zero), "sum"
    total = mine.reshape(1).clone()
    if sharded:
        comm.all_reduce(total, op, group, tag="clip_grad_norm_")
    total = total[0] if norm_type == float("inf") else total[0].pow(1.0 / norm_type)
    clip = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(clip.to(g.dtype))
    return total.float()
