"""The schedule: WHEN each unit's collectives are issued and waited for, beyond "just before it
runs" (engine.py's hooks ask for that). Gathers (:class:`Gatherer`), then reductions
(:class:`Reducer`); flat.py's ``gather_params`` and ``reduce_grads`` move the bytes.

* **The order.** The first forward records the order units run in (the reverse is backward's);
  with find_unused_parameters, ranks may run different units, so the units' own order is used.
* **Prefetch** (``prefetch=True``): when a unit starts, the all-gather of the unit expected to
  run next (in the order, or its reverse in backward) is issued asynchronously. A wrong guess
  costs memory, never correctness: a unit waits for its own gather.
* **Buckets** ([Note: buckets] in config.py): at stage 3, once the order is known, a unit's
  gather also carries the units that run after it, up to about ``bucket_bytes``; gradients
  wait in a bucket until it is full. At most two gathers and two reductions fly at once.
* **Re-gathers** (stages 1-2): between steps the user writes the shards, not the full buffers
  (unit.py: ``to_sharded`` marks them stale). The next forward re-gathers every stale buffer,
  in forward order, in buckets; each unit waits only for the gather that carries it.
* **Reductions**: the engine calls :meth:`Reducer.grad_ready` when autograd has finished a flat
  buffer's gradient (its post-backward hook) and :meth:`Reducer.finish` once, from the
  end-of-backward callback; with find_unused_parameters in one fixed order ([Note: find_unused]).
"""
from __future__ import annotations

import enum

import torch

from minishard import comm
from minishard.zero import config
from minishard.zero.flat import FlatBuffer, FlatMode, collective_key, gather_params, reduce_grads

__all__ = ["Pass", "Gatherer", "Reducer", "clip_grad_norm", "MAX_GATHERS_IN_FLIGHT",
           "MAX_REDUCTIONS_IN_FLIGHT"]

MAX_GATHERS_IN_FLIGHT = 2     # gathers landing into staging buffers at once (re-gathers)
MAX_REDUCTIONS_IN_FLIGHT = 2  # stages 2-3: bounds the full gradients waiting for their reduction


class Pass(enum.Enum):
    """Which pass the schedule is in; the value is the way it walks the recorded order."""
    FORWARD = +1
    BACKWARD = -1


class Gatherer:
    """The order units run in, prefetch, stage-3 buckets and stage 1-2 re-gathers."""

    def __init__(self, units, emit, *, bucket_bytes: int, prefetch: bool,
                 find_unused: bool) -> None:
        self.units, self.emit = units, emit  # emit("gather", unit): the engine's event stream
        self.bucket_bytes, self.prefetch, self.find_unused = bucket_bytes, prefetch, find_unused
        self.order: list = []          # units in the order the first forward ran them
        self.order_recorded = False
        if find_unused:  # forwards may differ between ranks: a fixed order instead
            self.order, self.order_recorded = list(units), True
        self._regather_queue: list[list[FlatBuffer]] = []  # stages 1-2: buckets not yet gathered
        self._regathers: list = []                         # ... and those in flight (handles)

    def look_ahead(self, unit, direction: Pass) -> None:
        """``unit`` just started: issue the re-gathers now due (forward) and the prefetch."""
        if direction is Pass.FORWARD and self._regather_queue:
            self._issue_regathers()
        if self.prefetch:
            self._prefetch_after(unit, direction)

    def _prefetch_after(self, unit, direction: Pass) -> None:
        if unit not in self.order:
            return
        i = self.order.index(unit) + direction.value
        if 0 <= i < len(self.order):
            self.gather(self.order[i], direction, async_op=True)

    def gather(self, unit, direction: Pass, async_op: bool = False) -> None:
        """Gather ``unit`` (its forward gather notes its place in the first forward's order); at
        stage 3 with ``bucket_bytes``, once the order is known, the ungathered units after it (in
        that direction) join its collective up to about bucket_bytes (module docstring)."""
        if direction is Pass.FORWARD and not async_op and not self.order_recorded \
                and unit not in self.order:
            self.order.append(unit)
        needed = (self.bucket_bytes and unit.reshard_after_forward and self.order_recorded
                  and unit in self.order and [f for f in unit.flats if f.needs_gather])
        if not needed:  # no bucket: the unit alone (or nothing: gathered, or in flight)
            if unit.unshard(async_op):
                self.emit("gather", unit)
            return
        i = self.order.index(unit)
        later = self.order[i + 1:] if direction is Pass.FORWARD else self.order[:i][::-1]
        bucket, size = [(unit, needed)], sum(f.full_bytes for f in needed)
        for other in later:
            flats = [f for f in other.flats if f.needs_gather]
            size += sum(f.full_bytes for f in flats)
            if size > self.bucket_bytes:
                break
            bucket.append((other, flats))
        flats = [f for _, fs in bucket for f in fs]
        for key in dict.fromkeys(map(collective_key, flats)):  # one collective per key
            gather_params([f for f in flats if collective_key(f) == key], async_op=True)
        for u, fs in bucket:
            if fs:
                self.emit("gather", u)
        if not async_op:
            unit.wait()

    def refresh_stale(self) -> None:
        """Stages 1-2, at the root's pre-forward: queue every stale full buffer, in forward
        order, into coalesced gathers of about config.BUCKET_BYTES (one collective_key each),
        and start the first ones now; each unit waits for the gather that carries it."""
        for handle in self._regathers:  # a forward that skipped units left these: land them
            handle.wait()
        order = self.order + [u for u in self.units if u not in self.order]
        buckets: list[list[FlatBuffer]] = []
        for flat in (f for u in order for f in u.flats if f.needs_gather):
            last = buckets[-1] if buckets else None
            if (last is None or collective_key(last[0]) != collective_key(flat)
                    or sum(f.full_bytes for f in last) >= config.BUCKET_BYTES):
                buckets.append([])
            buckets[-1].append(flat)
        self._regather_queue, self._regathers = buckets, []
        self._issue_regathers()
        while self.find_unused and (self._regather_queue or self._regathers):
            # Ranks may run different units (that is what find_unused_parameters allows), so
            # nothing may depend on which units run: every re-gather lands now, in order.
            self._regathers.pop(0).wait()
            self._issue_regathers()

    def _issue_regathers(self) -> None:
        """Start queued re-gathers while fewer than MAX_GATHERS_IN_FLIGHT are unfinished. Runs
        at every unit's pre-forward, the same program points on every rank: same order of
        collectives everywhere. A flat gathered on its own meanwhile needs no gather: skipped."""
        self._regathers = [h for h in self._regathers if not h.waited]
        while self._regather_queue and len(self._regathers) < MAX_GATHERS_IN_FLIGHT:
            bucket = [f for f in self._regather_queue.pop(0) if f.needs_gather]
            if bucket:
                self._regathers.append(gather_params(bucket, async_op=True))


# ------------------------------------------------------------------------------ reductions

# [Note: find_unused] With ``find_unused_parameters``, ranks may run different units, so the order
# in which gradients become ready differs between ranks, while collectives must match. So:
#
# * every rank launches its reductions at the END of backward, after every collective the backward
#   itself issues (a SyncBatchNorm's), in ONE fixed order (:meth:`Reducer.launch_order`), zeros
#   where this rank has no gradient. Launched as they become ready, they would interleave with
#   those collectives differently on ranks that ran different branches: at stages 2-3 a rank that
#   used a branch waited for that branch's reduction (at most two in flight) while a rank that
#   did not waited in SyncBatchNorm's all-reduce for the first: a deadlock (tests/
#   test_unused_branch_syncbn.py). The price: no overlap with the backward, and stages 2-3 hold
#   every full gradient until its end, as stage 1 does;
# * then ONE all-reduce(MAX) of a byte per trainable buffer ("this rank used it") tells every
#   rank which buffers NO rank used: those get their gradient from before this backward back
#   (``None`` usually), as in one process: Adam, momentum and weight decay leave them alone.


class Reducer:
    """The gradient reductions of one engine's backward passes."""

    def __init__(self, units, *, free_grads_early: bool, bucket_bytes: int,
                 reduce_dtype: torch.dtype | None, find_unused: bool, every_group, emit) -> None:
        self.units, self.emit = units, emit  # emit("reduce", unit): the engine's event stream
        self.free_grads_early, self.bucket_bytes = free_grads_early, bucket_bytes
        self.reduce_dtype, self.find_unused, self.every_group = reduce_dtype, find_unused, every_group
        self._reduced: set[int] = set()     # ids of flats already reduced in this backward
        self._used: set[int] = set()        # find_unused: flats this rank had a gradient for
        self._in_flight: list[tuple[comm.Handle, int]] = []  # reductions and their grad bytes
        self.in_flight_bytes = 0  # ... their sum (meters.py)
        self._buckets: dict[bool, list[FlatBuffer]] = {}  # ready, not launched: by "is replicated"
        self.shadowing = False  # Join: this rank has joined and runs an empty batch (join.py)

    def grad_ready(self, unit, flat: FlatBuffer) -> None:
        """``flat`` (of ``unit``) has its whole gradient here: start its reduction (with
        find_unused_parameters: mark it, [Note: find_unused]). A second part of it in one backward
        (reentrant activation checkpointing runs a backward per checkpointed call) is reduced
        too, as reductions add up, unless the first still waits in a bucket to take it along."""
        if id(flat) in self._reduced and (self.find_unused or flat.full.grad is None or any(
                f is flat for bucket in self._buckets.values() for f in bucket)):
            return
        self._reduced.add(id(flat))
        self.emit("reduce", unit)
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
        A replicated buffer (mode REPLICATED in a sharded engine) is all-reduced, not reduce-scattered:
        it waits in a bucket of its own, of config.BUCKET_BYTES, as DDP's gradients do."""
        replicated = flat.mode is FlatMode.REPLICATED
        cap = self.bucket_bytes if self.free_grads_early and not replicated else config.BUCKET_BYTES
        bucket = self._buckets.get(replicated, [])
        if bucket and collective_key(bucket[0]) != collective_key(flat):
            self._flush_bucket(replicated)  # one collective moves one dtype
        bucket = self._buckets.setdefault(replicated, [])
        bucket.append(flat)
        if sum(f.full_bytes for f in bucket) >= cap:
            self._flush_bucket(replicated)

    def _flush_bucket(self, replicated: bool) -> None:
        """Launch a bucket; at stages 2-3 first wait for the oldest reduction if
        MAX_REDUCTIONS_IN_FLIGHT are unfinished, so no more than that many hold their send
        and receive buffers at once."""
        bucket = self._buckets.pop(replicated, [])
        if not bucket:
            return
        while self.free_grads_early and len(self._in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
            handle, nbytes = self._in_flight.pop(0)
            handle.wait()
            self.in_flight_bytes -= nbytes
        nbytes = sum(f.full_bytes for f in bucket)
        self._in_flight.append((reduce_grads(bucket, self.reduce_dtype), nbytes))
        self.in_flight_bytes += nbytes

    # [Note: the end of backward] A flat buffer whose gradient never became ready in this
    # backward is reduced then if this rank holds a gradient for it (it was used only in earlier
    # ``no_sync`` backwards). One that no rank used keeps ``grad=None``, as in single-process
    # training: reducing zeros into it would make Adam, momentum and weight decay move weights
    # that got no gradient. Without find_unused_parameters, "no rank" is "not this rank" (every
    # rank reaches the same units).
    def finish(self, sync_grads: bool) -> None:
        """End of backward: reduce what is left ([Note: the end of backward]), wait for every
        reduction."""
        if sync_grads:
            for unit in reversed(self.units):
                for flat in unit.flats:
                    if flat.requires_grad and flat.full.grad is not None:
                        self.grad_ready(unit, flat)
            unused = self._finish_in_order() if self.find_unused else []
        for replicated in list(self._buckets):  # in the order the buckets began: the same on every rank
            self._flush_bucket(replicated)
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight, self.in_flight_bytes = [], 0
        if sync_grads:
            for flat, grads_before in unused:  # no rank used it: leave its gradients as they were
                for p, grad in zip(flat.params, grads_before):
                    p.grad = grad
        self._reduced.clear()

    def _finish_in_order(self) -> list[tuple[FlatBuffer, list]]:
        """[Note: find_unused]: launch the replicated fixed order, then the usage bitmap.
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
    tied weight has one slot; a replicated one, 0-dim or kept replicated by ``replicate=``, on the
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
