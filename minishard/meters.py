"""Meters: what the engine holds and does, measured where it happens.

* :class:`Meters` counts the full parameters gathered now and at most (stage 3's peak), the full
  gradients alive at most during backward, and, inside ``model.record_events()``, a timeline of
  what happened to each unit ("gather", "forward", "free", "backward", "reduce").
* :class:`WrapMeter` counts the parameter and buffer bytes held while wrapping.
* :func:`memory_report` is ``model.memory_report()``: bytes held right now, by kind.

Meters only read: nothing here changes a tensor or issues a collective.
"""
from __future__ import annotations

import contextlib
import time

import torch

from minishard.flat import FlatMode

__all__ = ["Meters", "WrapMeter", "memory_report"]


class Meters:
    """Byte counts and the event timeline of one engine's units."""

    def __init__(self, units) -> None:
        self.units = units
        self.events: list[dict] | None = None  # a list only inside recording()
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.peak_full_grad_bytes = 0

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

    def log(self, event: str, unit) -> None:
        if self.events is not None:
            self.events.append({"t": time.perf_counter(), "event": event, "unit": unit.name,
                                "gathered_bytes": self.gathered_bytes})

    def start_forward(self) -> None:
        """A new step: the gathered peak restarts from what is gathered now."""
        self.peak_gathered_bytes = self.gathered_bytes

    def start_backward(self) -> None:
        self.peak_full_grad_bytes = 0

    def on_gather(self, unit) -> None:
        self.note_gathered()
        self.log("gather", unit)

    def on_free(self, unit) -> None:
        self.note_gathered()
        self.log("free", unit)

    def note_gathered(self) -> None:
        self.gathered_bytes = sum(f.full_bytes() for u in self.units for f in u.flats
                                  if f.mode is FlatMode.OWN and f.is_gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def note_full_grads(self, in_flight_bytes: int) -> None:
        """Full (unsharded) gradient bytes alive now: accumulated and not yet reduced, or in a
        reduction still in flight. Stage 1 holds them all at the end of backward; 2 and 3 a few."""
        held = sum(f.full.grad.untyped_storage().nbytes() for u in self.units for f in u.flats
                   if f.full.grad is not None)
        held += in_flight_bytes
        self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, held)


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


def memory_report(units, meters: Meters, wrap_meter: WrapMeter, optimizer=None
                  ) -> dict[str, int]:
    """``model.memory_report(optimizer)``: bytes held now, counted by storage: ``params``,
    ``grads``, ``optimizer`` (its state for the user parameters); peaks of the last step:
    ``peak_gathered_params`` (stage 3), ``peak_full_grads`` (unsharded gradients alive at once
    in backward); ``peak_wrapping`` (while wrapping: :class:`WrapMeter`)."""
    params = 0
    grads: dict[int, int] = {}  # by storage: the grads of one reduced piece share one
    for unit in units:
        for f in unit.flats:
            params += f.held_bytes()
            for g in [f.full.grad] + [p.grad for p in f.params]:
                if g is not None:
                    grads[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    opt = 0
    if optimizer is not None:
        mine = {id(p) for unit in units for p in unit.shards()}
        for p, state in optimizer.state.items():
            if id(p) in mine:
                opt += sum(v.numel() * v.element_size() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": sum(grads.values()), "optimizer": opt,
            "peak_gathered_params": meters.peak_gathered_bytes,
            "peak_full_grads": meters.peak_full_grad_bytes,
            "peak_wrapping": wrap_meter.peak}
