"""Every rank's schedule in one file: the Chrome trace-event JSON that ``torch.profiler`` exports,
which Perfetto (ui.perfetto.dev) and chrome://tracing open::

    with model.trace("step.json"):      # every rank enters, and leaves, the block together
        model(x).sum().backward()
        optimizer.step()

On leaving, every rank's events are all-gathered (``verdicts.all_gather_object``) and rank 0 writes
one file: a process per rank ("rank 0", "rank 1", ...), in each a track per kind of work::

    compute      "forward u" and "backward u" per unit (inside the root's), the optimizer step
    gather       each all-gather of units' parameters, from its issue to the end of the wait that
                 landed it (prefetch: issued during the previous unit's forward); "free u" marks
    reduce       each reduction of units' gradients (reduce-scatter; all-reduce at stage 0)
    collectives  every other collective (SyncBatchNorm's, clip_grad_norm_'s, ...)
    waits        the time this rank sat blocked in a wait (``comm.Handle.wait``)

and a counter, the full-parameter bytes gathered. Every collective carries what the ledger
records (op, bytes sent, elements, dtype, group, mesh dimension, algorithm, tag) and "seq", its
place in this rank's order. Spans of one kind that overlap (two reductions in flight) go to a
second track ("reduce (2)"): a viewer draws one track's spans as a stack.

Times: each rank's ``perf_counter``, placed on the wall clock at entry (ranks on several hosts
line up as well as their clocks do); which hooks record them, and what a trace costs outside its
block: [Note: where the times come from]. With the ``plot`` extra, :func:`draw` makes a PNG
timeline of the same file, for a terminal without a browser::

    python -m minishard.observe.trace step.json step.png
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from functools import partial

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from minishard import comm, verdicts
from minishard.zero import params

__all__ = ["Traced", "Trace", "draw", "TRACKS"]

TRACKS = ("compute", "gather", "reduce", "collectives", "waits")
_LANES = 16  # tid = track index * _LANES + lane


class Traced:
    """What ZeRO inherits for ``model.trace(path)``."""

    def trace(self, path: str) -> "Trace":
        """A context manager: a Chrome trace of what every rank does inside the block, written
        by rank 0 to ``path`` on leaving (minishard/observe/trace.py says what it shows). Every rank of
        the engine must enter and leave it; after an exception nothing is written."""
        return Trace(self, path)


class _Recorder:
    """comm's observer: every collective (issued, landed) and every wait, on this rank."""

    def __init__(self) -> None:
        self.collectives: list[dict] = []  # {"entry": ledger Entry, "t0": issued, "t1": landed}
        self.waits: list[tuple[float, float, int | None]] = []  # (start, end, collective)
        self._by_work: dict[int, int] = {}  # id(work) -> index of the collective it carries

    def issued(self, entry) -> None:
        self.collectives.append({"entry": entry, "t0": time.perf_counter(), "t1": None})

    def started(self, works) -> None:
        """The works of the collective just issued (comm calls this right after ``issued``)."""
        if not self.collectives:
            return
        seq = len(self.collectives) - 1
        if not works:  # one rank: nothing to wait for
            self.collectives[seq]["t1"] = time.perf_counter()
        for work in works:
            self._by_work[id(work)] = seq

    def waited(self, works, start: float, end: float) -> None:
        seqs = [self._by_work.pop(id(work), None) for work in works]
        seq = seqs[0] if seqs else None
        if seq is not None:
            self.collectives[seq]["t1"] = end
        self.waits.append((start, end, seq))


# [Note: where the times come from] The engine's event log (meters.py: gather, forward, free,
# backward, reduce), comm's observer (each collective issued, the works that carry it, each
# wait), forward hooks (a unit's forward ends, before the engine frees it), gradient hooks (a
# unit's gradient is complete: its backward ends, under ``no_sync`` too) and torch.optim's global
# step hooks. All go when the block ends; outside a trace comm pays one ``is None`` comparison
# per collective and wait.
class Trace:
    """``model.trace(path)``; after the block, ``events`` holds the merged events (every rank)."""

    def __init__(self, engine, path: str) -> None:
        self.engine, self.path = engine, path
        self.events: list[dict] | None = None

    def __enter__(self) -> "Trace":
        self._recorder, self._marks, self._steps = _Recorder(), [], []
        comm.set_observer(self._recorder)  # refuses a second trace
        self._stack = stack = contextlib.ExitStack()
        stack.callback(comm.set_observer, None)
        stack.enter_context(params.torch_collectives())  # DTensor's, for torch's clip
        try:
            self._hook_in(stack)
        except BaseException:
            stack.close()
            raise
        self._wall_ns, self._t_enter = time.time_ns(), time.perf_counter()
        return self

    def _hook_in(self, stack: contextlib.ExitStack) -> None:
        self._meter_events = stack.enter_context(self.engine.record_events())
        mark = self._mark
        for unit in self.engine.units:
            # prepend: the forward's end is noted before the engine's own hook frees the unit
            hook = partial(mark, "forward_end", unit.name)
            stack.callback(unit.module.register_forward_hook(hook, prepend=True).remove)
            for flat in unit.flats:
                if flat.full.requires_grad:
                    hook = partial(mark, "grad_ready", unit.name)
                    stack.callback(flat.full.register_post_accumulate_grad_hook(hook).remove)
        starts: list[float] = []
        pre = register_optimizer_step_pre_hook(lambda *_: starts.append(time.perf_counter()))
        post = register_optimizer_step_post_hook(lambda opt, *_: self._steps.append(
            (f"{type(opt).__name__}.step", starts.pop(), time.perf_counter())))
        stack.callback(pre.remove)
        stack.callback(post.remove)

    def _mark(self, kind: str, unit: str, *hook_args) -> None:
        self._marks.append((time.perf_counter(), kind, unit))

    def __exit__(self, exc_type, exc, tb) -> bool:
        t_exit = time.perf_counter()
        self._stack.close()
        if exc_type is not None:  # a rank that raised does not join the merge
            return False
        group = self.engine.every_group
        rank = torch.distributed.get_rank()
        mine = _rank_events(rank, self.engine.units, self._meter_events, self._marks,
                            self._recorder, self._steps, self._t_enter, t_exit)
        device = next((p.device for p in self.engine.parameters()), None)
        ranks = verdicts.all_gather_object((self._wall_ns, mine), group, tag="trace", device=device)
        origin = min(wall for wall, _ in ranks)
        self.events = [_shifted(e, (wall - origin) / 1000) for wall, evs in ranks for e in evs]
        if comm.group_rank(group) == 0:
            self._write()
        return False

    def _write(self) -> None:
        engine = self.engine
        doc = {"traceEvents": self.events, "displayTimeUnit": "ms",
               "otherData": {"minishard": {"stage": engine.stage, "prefetch": engine.prefetch,
                                           "world_size": comm.group_size(engine.every_group),
                                           "units": [u.name for u in engine.units]}}}
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)  # a reader never sees half a file


def _shifted(event: dict, us: float) -> dict:
    if "ts" in event:
        event["ts"] = round(event["ts"] + us, 3)
    return event


# ---------------------------------------------------------------------------- one rank's events
def unit_spans(meter_events, marks, t_end: float) -> list[tuple[str, float, float, dict]]:
    """(name, start, end, args) of every unit's forward and backward. Forward: from the engine's
    "forward" (parameters in place) to the forward hook. Backward: from its "backward" (the
    gradient reached the unit's outputs, parameters gathered) to the first of its "reduce",
    "free" or gradient-complete mark (a unit without gradients: the end of the units inside)."""
    timeline = sorted([(e["t"], e["event"], e["unit"]) for e in meter_events] + marks)
    spans, forwards, backwards = [], {}, {}
    for t, kind, unit in timeline:
        if kind == "forward":
            forwards.setdefault(unit, []).append(t)
        elif kind == "forward_end" and forwards.get(unit):
            spans.append((f"forward {unit}", forwards[unit].pop(), t, {"unit": unit}))
        elif kind == "backward":
            backwards.setdefault(unit, t)
        elif kind in ("reduce", "free", "grad_ready") and unit in backwards:
            spans.append((f"backward {unit}", backwards.pop(unit), t, {"unit": unit}))
    for unit, t in backwards.items():  # no gradient of its own (a root holding no parameters):
        inner = [end for name, start, end, _ in spans if name.startswith("backward") and start >= t]
        spans.append((f"backward {unit}", t, max(inner, default=t_end),  # ... its units' end
                      {"unit": unit, "end": "the last unit's inside it" if inner else "not seen"}))
    return spans


def units_of(tag: str, names: set[str]) -> list[str]:
    """The units a collective's tag names (flat buffers "unit/dtype..." joined by "+", maybe a
    " (what)" after), or [] when it is not a unit's (SyncBatchNorm's, the user's ...)."""
    served = [part.split("/")[0] for part in tag.split(" (")[0].split("+")]
    return list(dict.fromkeys(served)) if served and all(u in names for u in served) else []


def _collective(seq: int, c: dict, names: set[str], t_end: float) -> tuple:
    """(track, name, start, end, args) of one collective."""
    e = c["entry"]
    served = units_of(e.tag, names)
    track = ("gather" if e.op == "all_gather" else "reduce") if served else "collectives"
    if track == "collectives" or e.op not in ("all_gather", "reduce_scatter", "all_reduce"):
        track, name = "collectives", f"{e.op} {e.tag}".strip()
    else:
        name = f"{track} {'+'.join(served)}"
    args = {"op": e.op, "tag": e.tag, "bytes_sent": float(e.bytes_sent), "numel": e.numel,
            "dtype": str(e.dtype).replace("torch.", ""), "group": list(e.ranks),
            "mesh_dim": e.dim, "algorithm": e.algorithm, "seq": seq, "units": served}
    if c["t1"] is None:
        args["landed"] = "not waited for inside the trace"
    return track, name, c["t0"], c["t1"] if c["t1"] is not None else t_end, args


def _rank_events(rank, units, meter_events, marks, recorder, steps, t0, t_end) -> list[dict]:
    """This rank's events in the trace-event format, times in µs since ``t0``."""
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    names = {u.name for u in units}
    spans = [("compute", *s) for s in unit_spans(meter_events, marks, t_end)]
    spans += [("compute", name, a, b, {}) for name, a, b in steps]
    spans += [_collective(seq, c, names, t_end) for seq, c in enumerate(recorder.collectives)]
    for a, b, seq in recorder.waits:
        what = recorder.collectives[seq]["entry"] if seq is not None else None
        spans.append(("waits", "wait", a, b, {"for": f"{what.op} {what.tag}" if what else "",
                                              "seq": seq}))
    events = [{"name": name, "ph": "X", "ts": us(a), "dur": round(us(b) - us(a), 3),
               "pid": rank, "tid": TRACKS.index(track) * _LANES, "cat": track, "args": args}
              for track, name, a, b, args in spans]
    _assign_lanes(events)
    events += [{"name": f"free {e['unit']}", "ph": "i", "s": "t", "ts": us(e["t"]), "pid": rank,
                "tid": TRACKS.index("gather") * _LANES, "cat": "gather",
                "args": {"unit": e["unit"]}} for e in meter_events if e["event"] == "free"]
    events += [{"name": "full params gathered", "ph": "C", "ts": us(e["t"]), "pid": rank,
                "args": {"bytes": e["gathered_bytes"]}} for e in meter_events]
    return _names(rank, {e["tid"] for e in events if "tid" in e}) + events


def _assign_lanes(events: list[dict]) -> None:
    """Move each span of a track to the first lane (tid) where it nests inside or follows the
    spans already there: a viewer stacks one thread's spans, so partial overlaps need two."""
    lanes: dict[int, list[list[float]]] = {}  # track tid -> per lane, the open spans' ends
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end, stacks = e["ts"], e["ts"] + e["dur"], lanes.setdefault(e["tid"], [])
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                break
        else:
            lane, stack = len(stacks), []
            stacks.append(stack)
        stack.append(end)
        e["tid"] += min(lane, _LANES - 1)


def _names(rank: int, tids: set[int]) -> list[dict]:
    """Metadata: the process "rank r", each track's name and place."""
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    for tid in sorted(tids):
        track, lane = TRACKS[tid // _LANES], tid % _LANES
        meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                  "args": {"name": track + (f" ({lane + 1})" if lane else "")}},
                 {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                  "args": {"sort_index": tid}}]
    return meta


# ------------------------------------------------------------------------------ the PNG timeline
_COLORS = {"compute": "tab:blue", "gather": "tab:green", "reduce": "tab:orange",
           "collectives": "tab:purple", "waits": "tab:red"}


def draw(trace, png: str) -> None:
    """Draw a trace (a path to its JSON, or the loaded dict) as a PNG timeline: a row per rank
    and track, spans as bars (nested ones thinner), on one axis in ms. Needs matplotlib (the
    ``plot`` extra): without it, ImportError says how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("minishard.observe.trace.draw needs matplotlib: pip install "
                          "'minishard[plot]'") from exc
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * len(rows)))
    for y, (pid, tid) in enumerate(rows):
        stack: list[float] = []
        for e in sorted((e for e in spans if (e["pid"], e["tid"]) == (pid, tid)),
                        key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            height = 0.8 * 0.6 ** len(stack)
            stack.append(e["ts"] + e["dur"])
            ax.broken_barh([(e["ts"] / 1000, e["dur"] / 1000)], (y - height / 2, height),
                           color=_COLORS[e["cat"]], alpha=0.75, lw=0)
            if e["dur"] > 0 and e["cat"] in ("compute", "gather", "reduce"):
                ax.text((e["ts"] + e["dur"] / 2) / 1000, y, e["name"].split(" ")[-1][:8],
                        fontsize=5, ha="center", va="center", clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {pid} {TRACKS[tid // _LANES]}"
                        + (f" ({tid % _LANES + 1})" if tid % _LANES else "") for pid, tid in rows],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    meta = trace.get("otherData", {}).get("minishard", {})
    ax.set_title(f"stage {meta.get('stage', '?')}, {meta.get('world_size', '?')} ranks"
                 f"{', prefetch' if meta.get('prefetch') else ''}: blue compute, green gather, "
                 "orange reduce, purple other collectives, red waiting", fontsize=8, loc="left")
    fig.tight_layout()
    fig.savefig(png, dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m minishard.observe.trace TRACE.json OUT.png")
    try:
        draw(sys.argv[1], sys.argv[2])
    except ImportError as exc:
        sys.exit(str(exc))
    print(f"saved {sys.argv[2]}")
