"""Gathers: when a unit's full parameters are all-gathered from the shards, beyond "just before
it runs" (zero.py's hooks ask for that; :meth:`Gatherer.gather` does it).

* **The order.** The first forward records the order units run in (the reverse is backward's);
  with find_unused_parameters, ranks may run different units, so the units' own order is used.
* **Prefetch** (``prefetch=True``): when a unit starts, the all-gather of the unit expected to
  run next (in the order, or its reverse in backward) is issued asynchronously. A wrong guess
  costs memory, never correctness: a unit waits for its own gather.
* **Buckets at stage 3** (``bucket_bytes``, [Note: buckets] in config.py): once the order is
  known, a unit's gather also carries the units that run after it, up to about bucket_bytes.
* **Re-gathers** (stages 1-2): between steps the user writes the shards, not the full buffers
  (unit.py: ``to_sharded`` marks them stale). The next forward re-gathers every stale buffer,
  in forward order, in buckets ([Note: buckets]; each in-flight one holds a staging buffer,
  see ``flat.gather_params``); each unit waits only for the gather that carries it.
"""
from __future__ import annotations

import enum

from minishard.zero import config
from minishard.zero.flat import FlatBuffer, collective_key, gather_params

__all__ = ["Pass", "Gatherer", "MAX_GATHERS_IN_FLIGHT"]

MAX_GATHERS_IN_FLIGHT = 2


class Pass(enum.Enum):
    """Which pass the schedule is in; the value is the way it walks the recorded order."""
    FORWARD = +1
    BACKWARD = -1


class Gatherer:
    """The order units run in, prefetch, stage-3 buckets and stage 1-2 re-gathers."""

    def __init__(self, units, meters, *, free_after_forward: bool, bucket_bytes: int,
                 prefetch: bool, find_unused: bool) -> None:
        self.units, self.meters = units, meters
        self.free_after_forward, self.bucket_bytes = free_after_forward, bucket_bytes
        self.prefetch, self.find_unused = prefetch, find_unused
        self.order: list = []          # units in the order the first forward ran them
        self.order_recorded = False
        if find_unused:  # forwards may differ between ranks: a fixed order instead
            self.order, self.order_recorded = list(units), True
        self._regather_queue: list[list[FlatBuffer]] = []  # stages 1-2: buckets not yet gathered
        self._regathers: list = []                         # ... and those in flight (handles)

    def record(self, unit) -> None:
        """A unit starts its forward: note its place in the order (first forward only)."""
        if not self.order_recorded and unit not in self.order:
            self.order.append(unit)

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
        """Gather ``unit`` for the forward or backward schedule. With ``bucket_bytes`` at stage
        3, once the order is known, the units that run after it (in that direction) and are not
        gathered join its collective, up to about bucket_bytes in all: one collective for
        several small units. Each still frees its own parameters after it has run, so a
        bucket's memory drains unit by unit."""
        if not (self.bucket_bytes and self.free_after_forward and self.order_recorded
                and unit in self.order and unit.needing_gather()):
            unit.gather(async_op, self.meters.on_gather)
            return
        i = self.order.index(unit)
        later = self.order[i + 1:] if direction is Pass.FORWARD else self.order[:i][::-1]
        bucket = [(unit, unit.needing_gather())]
        size = sum(f.full_bytes() for f in bucket[0][1])
        for other in later:
            flats = other.needing_gather()
            size += sum(f.full_bytes() for f in flats)
            if size > self.bucket_bytes:
                break
            bucket.append((other, flats))
        flats = [f for _, fs in bucket for f in fs]
        for key in dict.fromkeys(map(collective_key, flats)):  # one collective per key
            gather_params([f for f in flats if collective_key(f) == key], async_op=True)
        self.meters.note_gathered()
        for u, fs in bucket:
            if fs:
                self.meters.log("gather", u)
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
                    or sum(f.full_bytes() for f in last) >= config.BUCKET_BYTES):
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
