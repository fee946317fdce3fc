"""Meters: what the engine holds and does, measured where it happens.

* :class:`Meters` listens to the engine's event stream (engine.py: ``listeners``) and counts
  the full parameters gathered now and at most (stage 3's peak), the full
  gradients alive at most during backward, and, inside ``model.record_events()``, a timeline of
  what happened to each unit ("gather", "forward", "free", "backward", "reduce").
* :class:`WrapMeter` counts the parameter and buffer bytes held while wrapping.
* :func:`memory_report` is ``model.memory_report()``: bytes held right now, by kind.
* :func:`step_transients` is the formula for what a training step allocates on top of that,
  buffer by buffer; ``memory_report(measured=...)`` puts an allocation tracker's peak beside it.

Meters only read: nothing here changes a tensor or issues a collective.

The formula's derivation: [Note: a step's memory], above :func:`step_transients`.
"""
from __future__ import annotations

import contextlib
import time

import torch

from minishard import comm
from minishard.zero import config
from minishard.zero.params import local
from minishard.zero.flat import FlatMode
from minishard.zero.schedule import MAX_GATHERS_IN_FLIGHT, MAX_REDUCTIONS_IN_FLIGHT

__all__ = ["Meters", "WrapMeter", "memory_report", "step_transients", "transients"]


class Meters:
    """Byte counts and the event timeline of one engine's units: a listener on the engine's
    event stream (engine.py), fed every event of every step."""

    def __init__(self, units, reducer) -> None:
        self.units, self.reducer = units, reducer
        self.events: list[dict] | None = None  # a list only inside recording()
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.peak_full_grad_bytes = 0
        self._backward_logged: set[str] = set()  # units whose backward has begun
        self.heard("free")  # count what is gathered at rest (stages 1-2 under a cast keep full)

    @contextlib.contextmanager
    def recording(self):
        """Recordings nest (a trace around ``record_events()``): an inner one's events also
        reach the outer one's list when it ends."""
        outer, self.events = self.events, []
        events = self.events
        try:
            yield events
        finally:
            self.events = outer
            if outer is not None:
                outer.extend(events)

    def heard(self, event: str, unit=None, *payload) -> None:
        """One event of the engine's: counts what it changes, logs the timeline's events."""
        if event == "step":  # a new step: the gathered peak restarts from what is gathered now
            self.peak_gathered_bytes = self.gathered_bytes
        elif event == "backward_pass":
            self.peak_full_grad_bytes, self._backward_logged = 0, set()
        elif event == "grad":  # full gradients alive: not reduced yet, or in a reduction
            held = sum(f.full.grad.untyped_storage().nbytes() for u in self.units
                       for f in u.flats if f.full.grad is not None)
            held += self.reducer.in_flight_bytes
            self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, held)
        if event in ("gather", "free"):  # stage 3's full buffers come and go
            self.gathered_bytes = sum(f.full_bytes for u in self.units for f in u.flats
                                      if f.mode is FlatMode.OWN and f.is_gathered)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        elif event == "backward" and unit.name not in self._backward_logged:
            self._backward_logged.add(unit.name)  # once per backward, whichever output first
        elif event not in ("forward", "reduce"):
            return
        if self.events is not None:
            self.events.append({"t": time.perf_counter(), "event": event, "unit": unit.name,
                                "gathered_bytes": self.gathered_bytes})


class WrapMeter:
    """Bytes of parameter and buffer storage this rank holds while wrapping (the module's own
    tensors, flat buffers, shards, tensors materialised for an initialiser), and the most at
    once: ``memory_report()["peak_wrapping"]``. Counted where the wrap allocates and frees."""

    def __init__(self, start: int = 0) -> None:
        self.now = self.peak = start

    def hold(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, nbytes: int) -> None:
        self.now -= nbytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct real storages behind ``tensors`` (meta ones hold nothing)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None and not t.is_meta}
    return sum(storages.values())


def memory_report(units, meters: Meters, wrap_meter: WrapMeter, optimizer=None,
                  transients: dict[str, int] | None = None, measured=None) -> dict:
    """``model.memory_report(optimizer)``: bytes held now, counted by storage: ``params``,
    ``grads``, ``optimizer`` (its state for the user parameters), ``stamps`` (the room of the
    all-reduced buffers' stamps, comm.py's [Note: stamps]: not in the first two); peaks of the
    last step: ``peak_gathered_params`` (stage 3), ``peak_full_grads`` (unsharded gradients
    alive at once in backward); ``peak_wrapping`` (while wrapping: :class:`WrapMeter`). With
    ``measured`` (an :class:`~minishard.observe.allocations.Allocations` that watched a training
    step): its ``measured_step_peak`` beside ``formula_step_peak``, the sum of ``transients``
    (the buffers :func:`step_transients` names; activations are the module's and not in it)."""
    params = held_stamps = 0
    grads: dict[int, int] = {}  # by storage: the grads of one reduced piece share one
    grad_stamps: dict[tuple, int] = {}  # (storage, buffer): the room of its stamp in it
    for unit in units:
        for f in unit.flats:
            params += f.held_bytes()
            for g in [f.full.grad] + [local(p.grad) for p in f.params]:
                if g is not None:
                    grads[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
            if not f.tail:
                continue  # else: the room for its stamp (flat.py) is neither params nor grads
            held_stamps += f.tail * sum(t.element_size() for t in (f.full, f.shard)
                                        if t is not None)
            for g in (f.full.grad, f.stamped() if f.stamped is not None else None):
                if g is not None and g.untyped_storage().data_ptr() in grads:
                    grad_stamps[g.untyped_storage().data_ptr(), id(f)] = f.tail * g.element_size()
    opt = 0
    if optimizer is not None:
        mine = {id(p) for unit in units for p in unit.shards()}
        for p, state in optimizer.state.items():
            if id(p) in mine:
                opt += sum(local(v).numel() * v.element_size() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
    report = {"params": params - held_stamps,
              "grads": sum(grads.values()) - sum(grad_stamps.values()), "optimizer": opt,
              "stamps": held_stamps + sum(grad_stamps.values()),
              "peak_gathered_params": meters.peak_gathered_bytes,
              "peak_full_grads": meters.peak_full_grad_bytes,
              "peak_wrapping": wrap_meter.peak}
    if measured is not None:
        report.update(measured_step_peak=measured.peak,
                      formula_step_peak=sum(transients.values()), transients=dict(transients))
    return report


def _grad_bytes(flat, dtype: torch.dtype | None) -> int:
    """A flat buffer's full gradient, padded (and its stamp's room), in ``dtype`` (None: the
    compute dtype)."""
    return (flat.padded_numel + flat.tail) * (dtype or flat.param_dtype).itemsize


# [Note: a step's memory] The most bytes one training step (forward and backward; the
# optimizer's ``step`` is the user's) allocates beyond what the rank held before it. Activations
# are the module's own and not counted. U is the largest unit's full parameters, Ug the largest
# gather (U, or ``bucket_bytes`` at stage 3), Ur the largest reduction (a unit's full gradient,
# plus ``bucket_bytes``: a bucket launches once it holds that many), Psi every trainable unit's
# full gradient, N the shard group's size::
#
#     gathered parameters   stage 3: the root unit + (1 + prefetch) Ug
#     gather staging        stage 3: Ug (the N x k rows a gather lands from; none at N = 1)
#     autograd gradients    the unit in backward: each parameter's gradient and the flat gradient
#                           they fill, 2 U (+ U cast to reduce_dtype)
#     full gradients        stages 0-1 (and find_unused): Psi, until the end of backward;
#                           stages 2-3: those waiting in the bucket, bucket_bytes, and the
#                           replicated parameters' (``replicate=``), Psi_r
#     reductions in flight  stages 2-3: 2 x 2 Ur (the N x k send, (N-1) x k received, k out),
#                           + Psi_r (the replicated ones' all-reduced copy);
#                           stage 1: every bucket at once, 2 Psi; stage 0: the all-reduced copy
#                           (a gradient all-reduced ends with its stamp's room: in U and Psi)
#     shard gradients       what ``.grad`` keeps: k a buffer in the master dtype (stage 0 and
#                           replicated buffers: views of the all-reduced copy, or a cast of them)
#     kept by the backend   finished collectives whose buffers gloo's worker threads still hold:
#                           comm.FINISHED_KEPT_BY_BACKEND x the largest one
#
# Stages 1-2 re-gather in forward, two buckets of about ``config.BUCKET_BYTES`` in flight: the
# step's peak is the larger of that and backward's. tests/test_memory_wall.py measures every
# configuration against it with :class:`~minishard.observe.allocations.Allocations`.
def step_transients(model) -> dict[str, int]:
    """[Note: a step's memory], buffer by buffer, for ZeRO engine ``model``."""
    return transients([(u.module is model.module, u.flats) for u in model.units], model.policy,
                      world=comm.group_size(model.group), prefetch=model.prefetch,
                      bucket_bytes=model.bucket_bytes, reduce_dtype=model.mp.reduce_dtype,
                      find_unused=model.find_unused)


def transients(units, policy, *, world: int, prefetch: bool, bucket_bytes: int,
               reduce_dtype: torch.dtype | None, find_unused: bool) -> dict[str, int]:
    """[Note: a step's memory] from sizes alone. ``units``: [(is it the root, its flat buffers)];
    a buffer is a FlatBuffer or observe/predict.py's plan of one (its Layout, ``mode``,
    ``dtype``, ``param_dtype``, ``requires_grad``, ``full_bytes``)."""
    stage_frees_params = policy.reshard_after_forward
    keeps_full_grads = not policy.free_grads_early or find_unused
    limits_reductions = policy.free_grads_early
    flats = [f for _, fs in units for f in fs]
    trainable = [f for f in flats if f.requires_grad]
    if not trainable:
        return {}
    sharded = policy.flat_mode is not FlatMode.REPLICATED
    # replicated buffers in a sharded engine: all-reduced from their own bucket, which waits
    # for config.BUCKET_BYTES of them or the end of backward (schedule.py)
    replicated_grads = sum(_grad_bytes(f, reduce_dtype) for f in trainable
                           if sharded and f.mode is FlatMode.REPLICATED)
    unit_full = [sum(f.full_bytes for f in fs) for _, fs in units]
    grads = [sum(_grad_bytes(f, None) for f in fs if f.requires_grad) for _, fs in units]
    reduced = [sum(_grad_bytes(f, reduce_dtype) for f in fs if f.requires_grad) for _, fs in units]
    psi = sum(reduced)
    cast = reduce_dtype is not None and any(f.param_dtype != reduce_dtype for f in trainable)
    out = {"autograd gradients": 2 * max(grads) + (max(reduced) if cast else 0)}
    if stage_frees_params:
        largest_gather = max([b for (root, _), b in zip(units, unit_full) if not root]
                             + [bucket_bytes])
        out["gathered parameters"] = (sum(b for (root, _), b in zip(units, unit_full) if root)
                                      + (1 + prefetch) * largest_gather)
        out["gather staging"] = largest_gather if world > 1 else 0
    out["full gradients"] = psi if keeps_full_grads else bucket_bytes + replicated_grads
    if limits_reductions:
        out["reductions in flight"] = (MAX_REDUCTIONS_IN_FLIGHT * 2 * (max(reduced) + bucket_bytes)
                                       + replicated_grads)
    else:
        out["reductions in flight"] = (2 if sharded else 1) * psi
    out["shard gradients"] = sum(f.shard_numel * f.dtype.itemsize for f in trainable
                                 if sharded or f.dtype != (reduce_dtype or f.param_dtype))
    collectives = [out["reductions in flight"] // MAX_REDUCTIONS_IN_FLIGHT
                   if limits_reductions else 2 * max(reduced), out.get("gather staging", 0)]
    if sharded and not stage_frees_params:
        regathers = min(MAX_GATHERS_IN_FLIGHT * (max(unit_full) + config.BUCKET_BYTES),
                        sum(f.full_bytes for f in flats))
        collectives.append(regathers)
        if regathers > sum(out.values()):  # forward's peak is the larger
            out = {"gather staging": regathers}
    out["kept by the backend"] = comm.FINISHED_KEPT_BY_BACKEND * max(collectives)
    return {name: nbytes for name, nbytes in out.items() if nbytes}
