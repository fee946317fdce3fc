"""The doctor: every rank's flight record side by side, a cause named only when they show it.

    python -m minishard.doctor DIR     # DIR: $MINISHARD_FLIGHT_DIR, else flight.py's default

Ranks must issue the same collectives in the same order on each group. The records of the
newest job in DIR (flight.py) are lined up per group (its name, the same on every rank: comm's
default group and the one DTensor passes are one stream), collective by collective (``nth``),
from the first one every rank's ring still holds. The first place where the ranks issued
different collectives (op, buffers, size), or some ranks' streams end, is where the job
stopped. What led there is read from the records (:class:`Scene`): a line of the user's script
that only some ranks issued collectives from, and what those were; ranks a backward pass apart,
and whether the one ahead reduced in its extra pass; who exited, failed, died or was stopped.

Each cause in :data:`CAUSES` says what it requires of that evidence (``_FITS`` tests it); the
doctor names a cause only when exactly one fits. Otherwise the first line says "not sure", what
is known (which rank is where, at which line) and the candidates. Ranks that all exited and
agree: "ended normally", and what differed. A rank with no record but a ``rank<r>.fault`` (gloo
aborted it) is read from its Python traceback there.

Exit status: 0 a cause named or nothing wrong, 1 not sure, 2 nothing it can read (no records,
or a file that is not a flight record: one line names the file and what is expected).
"""
from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

from minishard.observe.records import Scene, Unreadable, load, reduced as _reduced, scene, where

__all__ = ["diagnose", "examine", "CAUSES", "main", "Unreadable"]

# name -> (what it requires of the records, the fix). Tested by ``_FITS``; lesson 15 drives each.
CAUSES = {
    "a forward on some ranks only": (
        "some ranks issued forward collectives (the engine's gathers, SyncBatchNorm's sums) from "
        "a line the others issued none from, and began no backward pass since",
        "run every forward of the wrapped model on every rank (an evaluation under `if rank == "
        "0` / nanoGPT's `and master_process`: evaluate on every rank, print on one); at stages "
        "1-3 a forward gathers parameters, SyncBatchNorm's sums its statistics"),
    "a torch tool's collective on some ranks only": (
        "some ranks issued a collective torch ran for a DTensor (clip_grad_norm_, a norm, "
        "full_tensor, the state-dict API) from a line the others issued none from",
        "call torch's tools on every rank at stages 1-3 (the parameters are DTensors: their "
        "norm, full_tensor and state dict are collectives); compute on all, log on one"),
    "a save or full_state_dict on some ranks only": (
        "some ranks issued a checkpoint's collectives from a line the others issued none from",
        "call save_checkpoint / full_state_dict / load_checkpoint on every rank (decide to save "
        "from a value every rank shares, e.g. an all-reduced loss); rank0_only=True keeps the "
        "result on rank 0"),
    "no_sync on some ranks only": (
        "the ranks are backward passes apart and each extra pass of the ranks ahead reduced "
        "nothing (the drift inside what every ring still holds); or, in one pass, a rank that "
        "reduced nothing has left its backward where another reduces; or the engine's no_sync "
        "collective (the first backward after accumulating) on some ranks only",
        "enter model.no_sync() (or set require_backward_grad_sync) on every rank alike: the "
        "gradient reductions must run on all ranks or on none"),
    "a backward on some ranks only": (
        "the ranks are backward passes apart and every pass of the ranks ahead reduced its "
        "gradients (the drift inside what every ring still holds): the ranks behind skipped a "
        "backward (a batch skipped on a loss spike), or the ranks ahead ran an extra one",
        "run backward() for every batch on every rank, or skip it on all (decide from a value "
        "every rank shares: all-reduce the flag); an extra backward on some ranks likewise"),
    "a parameter frozen on some ranks only": (
        "in the same backward pass the ranks reduced the gradients of different buffers",
        "call requires_grad_(...) on every rank alike (and before the step's forward): the ranks "
        "reduce the gradients of different buffers"),
    "uneven inputs without Join": (
        "a rank's stream ended because it exited cleanly, in step with the others (the same "
        "backward pass, or the others just past it) while they went on",
        "give every rank the same number of batches (DistributedSampler(drop_last=True)) or wrap "
        "the loop in torch's Join([model]); if the extra backward on the ranks that went on was "
        "a micro-batch meant to accumulate, run it under model.no_sync() (the records cannot "
        "tell the two apart)"),
    "a rank stopped on an error": (
        "a rank's stream ended because an exception of its own ended it (its record says "
        "which; not a peer's closed connection, nor a timeout)",
        "read that rank's traceback: it raised, and every other rank waited for it"),
    "a rank died": (
        "a rank left no record, and the others' say a peer closed its connection or that "
        "torchrun stopped them",
        "read that rank's own output (a traceback, 'Killed' from the out-of-memory killer); "
        "every other rank waited for it"),
}
_GENERIC = "the ranks issued different collectives: look for a branch on the rank or its data"
_CHECKPOINT = re.compile(r"checkpoint|full_state|from rank 0|dcp|verdict")
_PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection (closed|reset)"
                        r"|SIGTERM", re.IGNORECASE)


def _extra_lines(s: Scene, kind) -> tuple[int, dict] | None:
    """(a rank, its first collective from a line of its own whose collectives are all of
    ``kind``), if one has such a line."""
    for rank, lines in sorted(s.extra.items()):
        for rows in lines.values():
            if rows and all(kind(e) for e in rows):
                return rank, rows[0]
    return None


def _here(rank: int | None, s: Scene) -> tuple[int, dict | None] | None:
    return None if rank is None else (rank, s.sides[rank])


def _forward(e: dict) -> bool:
    if e["tag"].startswith("torch ") or _CHECKPOINT.search(e["tag"]):
        return False
    return e["phase"] == "forward" or ("SyncBatchNorm" in e["tag"] and "forward" in e["tag"])


def _forward_alone(s: Scene) -> tuple[int, dict] | None:
    """Forwards from a line of its own that no backward followed (the rank began no backward
    pass since): an evaluation. A forward of a training step that only some ranks take from
    that line (an extra micro-batch) is followed by its backward, and is not one."""
    for rank, lines in sorted(s.extra.items()):
        for rows in lines.values():
            if rows and all(_forward(e) for e in rows) and \
                    s.passes[rank] == rows[-1]["backwards"]:
                return rank, rows[0]
    return None


def _ended_rank(s: Scene, clean: bool) -> int | None:
    """A rank whose stream ended there, having exited cleanly, or on an exception of its own
    (not a peer's connection closing, nor a timeout: those follow another rank's trouble)."""
    for rank, e in sorted(s.sides.items()):
        why = s.records[rank]["why"]
        own = why.startswith("exit after") and not _PEER_GONE.search(why) and not re.search(
            r"timed? ?out", why, re.IGNORECASE)
        if e is None and (why == "exit" if clean else own):
            return rank
    return None


def _apart(s: Scene, extra_passes_quiet: bool) -> int | None:
    """The rank ahead, if the ranks are passes apart and what its extra passes did fits."""
    if s.extra or not s.ahead or len(s.quiet) < 2:  # not passes apart, or not on record
        return None
    ahead, behind = s.ahead
    quieter = s.quiet[ahead] - s.quiet[behind]
    return ahead if (quieter == s.gap if extra_passes_quiet else quieter == 0) else None


def _quiet_here(s: Scene) -> tuple[int, bool] | None:
    """(a rank that reduced nothing in the pass where another reduces now, whether it has left
    that pass's backward): all in one pass, no line of their own."""
    sides = s.sides
    if s.extra or s.ahead or None in sides.values():
        return None
    if not any(_reduced(e) for e in sides.values()):
        return None
    for rank, e in sorted(sides.items()):
        if not any(_reduced(x) and x["backwards"] == e["backwards"]
                   for x in s.records[rank]["collectives"]):
            return rank, e["phase"] != "backward"
    return None


def _no_sync(s: Scene) -> int | None:
    """Passes apart, the extra ones quiet; or here a rank that reduced nothing in this pass
    (and has left its backward); or the engine's own no_sync collective on some ranks only."""
    flagged = [r for r, e in sorted(s.sides.items()) if e and e["tag"].startswith("no_sync:")]
    if flagged and all(e is not None and (r in flagged or _reduced(e))  # the others reduce
                       for r, e in s.sides.items()) and len(flagged) < len(s.sides):
        return flagged[0]
    quiet = _quiet_here(s)
    return _apart(s, extra_passes_quiet=True) if quiet is None else quiet[0]


def _frozen(s: Scene) -> int | None:
    """Every rank reduces in this pass, other buffers; or one has reduced nothing yet but is
    still in the pass's backward (at stage 3 its gathers go on: no_sync looks the same)."""
    quiet = _quiet_here(s)
    if quiet is not None:
        return None if quiet[1] else quiet[0]
    sides = list(s.sides.values())
    if not s.extra and not s.ahead and None not in sides and all(_reduced(e) for e in sides):
        return min(s.sides)
    return None


_FITS = {  # cause -> (the rank to name, its collective to name) when the scene fits, else None
    "a forward on some ranks only": _forward_alone,
    "a torch tool's collective on some ranks only":
        lambda s: _extra_lines(s, lambda e: e["tag"].startswith("torch ")),
    "a save or full_state_dict on some ranks only":
        lambda s: _extra_lines(s, lambda e: bool(_CHECKPOINT.search(e["tag"]))),
    "no_sync on some ranks only": lambda s: _here(_no_sync(s), s),
    "a backward on some ranks only": lambda s: _here(_apart(s, extra_passes_quiet=False), s),
    "a parameter frozen on some ranks only": lambda s: _here(_frozen(s), s),
    "uneven inputs without Join": lambda s: None if s.ahead and not (s.left and s.gap == 1)
        else _here(_ended_rank(s, clean=True), s),
    "a rank stopped on an error": lambda s: _here(_ended_rank(s, clean=False), s),
}


def _last(record: dict) -> dict | None:  # its last collective on record
    return record["collectives"][-1] if record["collectives"] else None


def _ranks(ranks: list[int]) -> str:  # a few ranks by number, many counted
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else (
        f"{', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} in all)")


def _why(record: dict, most: int = 200) -> str:  # how its record came to be written
    return record["why"].splitlines()[0][:most] if record["why"] else "?"


def _side(rank: int, e: dict | None, record: dict) -> str:
    if e is None:
        now = record["now"]
        return (f"  rank {rank}: issued nothing more here (its stream ends: backward pass "
                f"{now['backwards']}, {now['phase'] or '-'}); its record: {_why(record)}")
    state = ("issued by torch" if e["tag"].startswith("torch ") and e["landed"] is None
             else "landed" if e["landed"] else "WAITING")
    return (f"  rank {rank}: {e['op']} of {e['tag'] or '?'} ({e['numel']} x {e['dtype']}), "
            f"{e['phase'] or '-'} of unit {e['unit'] or '-'}, backward pass {e['backwards']}, "
            f"at {where(e)} [{state}]; its record: {_why(record)}")


def _sides(s: Scene) -> list[str]:
    name, ranks = s.group
    return [f"collective {s.nth} on group {name or '?'} (ranks {list(ranks)}):",
            *[_side(r, e, s.records[r]) for r, e in sorted(s.sides.items())]]


def _named(cause: str, rank: int, e: dict | None, s: Scene) -> list[str]:
    if e is None:  # its stream ended: name where the others wait
        e = next(x for x in s.sides.values() if x is not None)
        head = (f"{cause}: rank {rank}'s stream ended ({_why(s.records[rank], 120)}) while "
                f"the others went on: {e['op']} of {e['tag'] or '?'} at {where(e)}")
    else:
        head = (f"{cause}: rank {rank}, {e['op']} of {e['tag'] or '?'} ({e['phase'] or '-'} of "
                f"unit {e['unit'] or '-'}) at {where(e)}")
    if s.ahead and cause in ("no_sync on some ranks only", "a backward on some ranks only"):
        head += (f"; rank {s.ahead[0]} is {s.gap} backward pass{'es' * (s.gap > 1)} ahead of "
                 f"rank {s.ahead[1]}")
    requires, fix = CAUSES[cause]
    return [head, f"evidence: {requires}", *_sides(s), f"fix: {fix}"]


def _unsure(s: Scene, fitting: list[str]) -> list[str]:
    """What is known: where each rank is, at which line; and the causes that could be."""
    known = "; ".join(
        f"rank {r} at {where(e)} ({e['op']} of {e['tag'] or '?'}, {e['phase'] or '-'}, pass "
        f"{e['backwards']})" if e is not None else f"rank {r} issued nothing more after "
        f"{where(_last(s.records[r]))} ({_why(s.records[r], 60)})"
        for r, e in sorted(s.sides.items()))
    if s.ahead:
        known += f"; rank {s.ahead[0]} is {s.gap} backward pass(es) ahead of rank {s.ahead[1]}"
    if s.extra:
        known += "; lines only some ranks issued from: " + ", ".join(
            f"rank {r} {Path(f or '?').name}:{n}" for r, lines in sorted(s.extra.items())
            for f, n in lines)
    fixes = [f"  {c}: {CAUSES[c][1]}" for c in fitting] or [f"  none of the known causes "
                                                             f"fits the records: {_GENERIC}"]
    return [f"not sure: {known}; candidates: {', '.join(fitting) or 'none known'}", *_sides(s),
            "candidates:", *fixes]


def _agreed(records: dict[int, dict]) -> list[str]:
    """Every group's streams agree to their ends: the job ended normally (every rank exited
    cleanly) or was caught in step; and what differed, if anything."""
    passes = {r: rec["now"]["backwards"] for r, rec in sorted(records.items())}
    lines = {r: {where(e) for e in rec["collectives"]} for r, rec in sorted(records.items())}
    every = set.intersection(*lines.values())
    differed = [f"rank {r} issued collectives from {', '.join(sorted(mine - every))}"
                for r, mine in lines.items() if mine - every]
    if len(set(passes.values())) > 1:
        differed.insert(0, "backward passes (" + ", ".join(f"rank {r}: {p}"
                                                          for r, p in passes.items()) + ")")
    if all(rec["why"] == "exit" for rec in records.values()):
        head = "ended normally: every rank exited, having issued the same collectives"
    else:
        head = "no divergence: every rank issued the same collectives so far" + "".join(
            f"; rank {r} stopped on an error ({_why(rec, 160)})" for r, rec in
            sorted(records.items()) if rec["why"].startswith(("exit after", "failed")))
    head += f"; what differed: {'; '.join(differed)}" if differed else "; nothing differed"
    last = {r: rec["collectives"][-1] for r, rec in records.items() if rec["collectives"]}
    return [head, *[f"  rank {r}: {_why(rec)}" + (
        f"; its last collective: {last[r]['op']} of {last[r]['tag'] or '?'} at "
        f"{where(last[r])}" if r in last else "") for r, rec in sorted(records.items())]]


def _missing(records: dict, faults: dict, missing: list[int]) -> tuple[int, list[str]]:
    """Ranks that left no record: read from a fault file, or from what the others say."""
    rank = missing[0]
    last = {r: rec["collectives"][-1] for r, rec in sorted(records.items())
            if rec["collectives"]}
    waits = f"; rank {min(last)} waits at {where(last[min(last)])}" if last else ""
    sides = [_side(r, e, records[r]) for r, e in last.items()]
    if rank in faults:
        cause, line = _from_fault(faults[rank], list(last.values()))
        seen = (f"rank {rank} was aborted by gloo (a message of another size) at {line}, its "
                f"traceback in rank{rank}.fault{waits}")
        if cause is None:
            return 1, [f"not sure: {seen}; candidates: none known", *sides, "candidates:",
                       f"  none of the known causes fits the records: {_GENERIC}"]
        return 0, [f"{cause}: {seen}", f"evidence: {_FAULTS[cause]}", *sides,
                   f"fix: {CAUSES[cause][1]}"]
    gone = f"rank{'s' * (len(missing) > 1)} {_ranks(missing)} left no record"
    if any(_PEER_GONE.search(rec["why"]) for rec in records.values()):
        return 0, [f"a rank died: {gone}: died (killed, out of memory, os._exit){waits}",
                   f"evidence: {CAUSES['a rank died'][0]}", *sides,
                   f"fix: {CAUSES['a rank died'][1]}"]
    return 1, [f"not sure: {gone} (died, still running, or wrote it elsewhere: every rank "
               f"must see the same MINISHARD_FLIGHT_DIR){waits}; candidates: a rank died",
               *sides, "candidates:", f"  a rank died: {CAUSES['a rank died'][1]}"]


_NOT_USER = re.compile(r"/minishard/|/torch/|/lib/python3[^/]*/(?!site-packages)|^<")
_FAULTS = {  # what a cause requires of an aborted rank's traceback and the others' records
    "a save or full_state_dict on some ranks only": "the aborted rank was in a checkpoint's "
        "collective, where the others are not",
    "a parameter frozen on some ranks only": "the aborted rank was in the engine's gradient "
        "reduction in backward, where the others reduce other buffers",
}


def _from_fault(text: str, waiting: list[dict]) -> tuple[str | None, str]:
    """(the cause its traceback and the others' last collectives fit, or None; the user's
    line) of a rank gloo aborted, from its faulthandler file."""
    user, frames = "?", []
    for thread in text.split("\n\n"):  # one block per thread, innermost frame first
        found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', thread)
        mine = [f"{Path(f).name}:{n}" for f, n, _ in found if not _NOT_USER.search(f)]
        if mine:
            user, frames = mine[0], found
            break
    if any(_CHECKPOINT.search(f + fn) for f, _, fn in frames) and not any(
            _CHECKPOINT.search(e["tag"]) for e in waiting):
        return "a save or full_state_dict on some ranks only", user
    in_backward = any(fn == "backward" for _, _, fn in frames)
    if in_backward and any("/minishard/zero/" in f for f, _, _ in frames) and waiting and all(
            _reduced(e) for e in waiting):
        return "a parameter frozen on some ranks only", user
    return None, user


def examine(directory: str | Path) -> tuple[int, list[str]]:
    """(exit status, the report's lines): 0 a cause named or nothing wrong, 1 not sure; raises
    Unreadable (status 2) for a directory or file it cannot read."""
    from minishard.observe.flight import DEFAULT_DIR
    records, faults, world, aside = load(directory)
    if not records:
        raise Unreadable(f"{directory}: no flight records (rank<r>.json) in it. The ranks write "
                         f"theirs to $MINISHARD_FLIGHT_DIR (else {DEFAULT_DIR}) when a collective "
                         "fails, on kill -USR1, and at exit when MINISHARD_FLIGHT_DIR is set")
    note = [f"(left aside, another job's: {', '.join(aside)})"] if aside else []
    missing = [r for r in range(world) if r not in records]
    if missing:
        status, lines = _missing(records, faults, missing)
        return status, lines + note
    s = scene(records)
    if s is None:
        return 0, _agreed(records) + note
    fitting = {cause: hit for cause, fits in _FITS.items() if (hit := fits(s)) is not None}
    if len(fitting) == 1:
        (cause, (rank, e)), = fitting.items()
        return 0, _named(cause, rank, e, s) + note
    return 1, _unsure(s, list(fitting)) + note


def diagnose(directory: str | Path) -> list[str]:
    """The doctor's report, line by line; the first names the cause (or says "not sure") and
    the user's line."""
    return examine(directory)[1]


def main(argv: list[str] | None = None) -> int:
    from minishard.observe.flight import directory
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[1])
        return 0
    if len(args) > 1:
        print("usage: python -m minishard.doctor [DIR]  (one directory of flight records)",
              file=sys.stderr)
        return 2
    try:
        status, lines = examine(args[0] if args else directory())
    except Unreadable as exc:
        print(f"minishard.doctor: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):  # `| head` reads what it wants
        print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
