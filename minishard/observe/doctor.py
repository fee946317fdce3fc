"""The doctor: every rank's flight record side by side, the first divergence named in words.

    python -m minishard.doctor DIR     # DIR: $MINISHARD_FLIGHT_DIR, else flight.py's default

Ranks must issue the same collectives in the same order on each group, so the records (flight.py)
are lined up by group and by each collective's place on it (``nth``). The first place where the
ranks disagree, by op, buffers, size, user's line or backward pass, or where some ranks' records
end, or a rank left none, is the divergence; it is matched against :data:`CAUSES` (what each
known cause looks like in the records, and its fix). The first line printed names the cause and
the user's line; then every rank's side, then the fix. A rank with no record but a
``rank<r>.fault`` (gloo aborted it) is read from its Python traceback there.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

__all__ = ["diagnose", "CAUSES", "main"]

# name -> the fix; each cause's look is tested in `_classify` (tests/test_hangs.py drives each).
CAUSES = {
    "a forward on some ranks only": "run every forward of the wrapped model on every rank "
        "(an evaluation under `if rank == 0` / nanoGPT's `and master_process`: evaluate on every "
        "rank, print on one); at stage 3 every forward gathers parameters",
    "uneven inputs without Join": "give every rank the same number of batches "
        "(DistributedSampler(drop_last=True)) or wrap the loop in torch's Join([model])",
    "a save or full_state_dict on some ranks only": "call save_checkpoint / full_state_dict / "
        "load_checkpoint on every rank (decide to save from a value every rank shares, e.g. an "
        "all-reduced loss); rank0_only=True keeps the result on rank 0",
    "no_sync on some ranks only": "enter model.no_sync() (or set require_backward_grad_sync) "
        "on every rank alike: the gradient reductions must run on all ranks or on none",
    "a parameter frozen on some ranks only": "call requires_grad_(...) on every rank alike (and "
        "before the step's forward): the ranks reduce the gradients of different buffers",
    "a rank died": "read that rank's own output (a traceback, 'Killed' from the out-of-memory "
        "killer); every other rank waited for it",
}
_GENERIC = "the ranks issued different collectives: look for a branch on the rank or its data"


def load(directory: str | Path) -> tuple[dict[int, dict], dict[int, str], int]:
    """(the newest job's records by rank, fault tracebacks by rank, world size)."""
    directory = Path(directory)
    records = {}
    for path in directory.glob("rank*.json"):
        record = json.loads(path.read_text())
        records[record["rank"]] = record
    if records:  # a directory reused across jobs: keep the newest job's
        job = max(records.values(), key=lambda r: r["written"])["job"]
        records = {r: rec for r, rec in records.items() if rec["job"] == job}
    world = max([rec["world"] for rec in records.values()] + [0])
    began = min([rec.get("armed") or rec["written"] for rec in records.values()] + [0.0])
    faults = {}
    for path in directory.glob("rank*.fault"):  # written since this job began
        text, rank = path.read_text(errors="replace"), int(path.stem[4:])
        if text.strip() and rank not in records and path.stat().st_mtime >= began - 60:
            faults[rank] = text
            world = max(world, rank + 1)
    return records, faults, world


def _where(e: dict | None) -> str:
    return f"{Path(e['file']).name}:{e['line']}" if e and e.get("file") else "?"


def _side(rank: int, e: dict | None) -> str:
    if e is None:
        return f"  rank {rank}: issued nothing here (its record ends)"
    state = "landed" if e["landed"] else "WAITING"
    return (f"  rank {rank}: {e['op']} of {e['tag'] or '?'} ({e['bytes']} bytes), "
            f"{e['phase'] or '-'} of unit {e['unit'] or '-'}, backward pass {e['backwards']}, "
            f"at {_where(e)} [{state}]")


def _first_divergence(records: dict[int, dict]):
    """(group ranks, nth, {rank: entry or None}) of the earliest disagreement, or None."""
    streams: dict[tuple, dict[int, dict[int, dict]]] = {}
    for rank, rec in records.items():
        for e in rec["collectives"]:
            streams.setdefault(tuple(e["ranks"]), {}).setdefault(rank, {})[e["nth"]] = e
    found = []
    for group, by_rank in streams.items():
        members = [r for r in group if r in records]
        if not members:  # a group of ranks that left no record
            continue
        begin = max(min(by_rank.get(r, {0: None})) for r in members)  # rings drop the oldest
        end = max(max(s) for s in by_rank.values())
        for nth in range(begin, end + 1):
            sides = {r: by_rank.get(r, {}).get(nth) for r in members}
            keys = {None if e is None else (e["op"], e["tag"], e["numel"], e["dtype"],
                                            e["backwards"], e["file"], e["line"])
                    for e in sides.values()}
            if len(keys) > 1:
                when = min(e["issued"] for e in sides.values() if e is not None)
                found.append((when, group, nth, sides))
                break
    return min(found, key=lambda f: f[0])[1:] if found else None


def _checkpointing(text: str) -> bool:
    return bool(re.search(r"checkpoint|full_state|from rank 0|dcp|verdict", text))


_REDUCTIONS = ("reduce_scatter", "all_reduce")


def _classify(records, sides) -> tuple[str, int]:
    """The cause that fits ``sides``, and the rank whose line to name."""
    present = {r: e for r, e in sides.items() if e is not None}
    ended = [r for r, e in sides.items() if e is None]
    if ended:
        left = [r for r in ended if records[r]["why"] == "exit"]
        return (("uneven inputs without Join", min(present)) if left else
                (_GENERIC, min(present)))
    if any(_checkpointing(e["tag"]) for e in present.values()):
        return "a save or full_state_dict on some ranks only", next(
            r for r, e in present.items() if _checkpointing(e["tag"]))
    counts = {e["backwards"] for e in present.values()}
    if len(counts) > 1:  # the rank a backward pass ahead skipped a reduction
        return "no_sync on some ranks only", max(present, key=lambda r: present[r]["backwards"])
    phases = {e["phase"] for e in present.values()}
    if phases == {"backward"}:  # a rank with no reduction in this pass skipped them all
        (b,) = counts
        quiet = [r for r in present if not any(
            e["backwards"] == b and e["phase"] == "backward" and e["op"] in _REDUCTIONS
            for e in records[r]["collectives"])]
        return (("no_sync on some ranks only", quiet[0]) if quiet else
                ("a parameter frozen on some ranks only", min(present)))
    # A forward some ranks ran: name the line the other ranks never issued from.
    lines = {r: {(e["file"], e["line"]) for e in records[r]["collectives"]} for r in present}
    for r, e in sorted(present.items()):
        if e["phase"] == "forward" and any((e["file"], e["line"]) not in lines[o] for o in lines):
            return "a forward on some ranks only", r
    return _GENERIC, min(present)


_NOT_USER = re.compile(r"/minishard/|/torch/|/lib/python3[^/]*/(?!site-packages)|^<")


def _from_fault(rank: int, text: str) -> tuple[str, str]:
    """(cause, user's line) of a rank gloo aborted, from its faulthandler traceback."""
    user, frames = "?", []
    for thread in text.split("\n\n"):  # one block per thread, innermost frame first
        found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', thread)
        mine = [f"{Path(f).name}:{n}" for f, n, _ in found if not _NOT_USER.search(f)]
        if mine:
            user, frames = mine[0], found
            break
    if any(_checkpointing(f + fn) for f, _, fn in frames):
        return "a save or full_state_dict on some ranks only", user
    if any(fn == "backward" for _, _, fn in frames):
        return "a parameter frozen on some ranks only", user
    return "a rank died", user


def diagnose(directory: str | Path) -> list[str]:
    """The doctor's report, line by line; the first names the cause and the user's line."""
    records, faults, world = load(directory)
    if not records and not faults:
        return [f"no flight records in {directory} (rank<r>.json): nothing to diagnose"]
    missing = [r for r in range(world) if r not in records]
    if missing:
        rank = missing[0]
        if rank in faults:
            cause, line = _from_fault(rank, faults[rank])
            seen = f"rank {rank} was aborted (its rank{rank}.fault) at {line}"
        else:
            cause, line = "a rank died", "?"
            seen = (f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} left no "
                    "record: died (killed, out of memory, os._exit), or killed once one did")
        last = {r: rec["collectives"][-1] for r, rec in sorted(records.items())
                if rec["collectives"]}
        others = f"; rank {min(last)} waits at {_where(last[min(last)])}" if last else ""
        return [f"{cause}: {seen}{others}", *[_side(r, e) for r, e in last.items()],
                f"fix: {CAUSES.get(cause, _GENERIC)}"]
    divergence = _first_divergence(records)
    if divergence is None:
        return ["no divergence: every rank issued the same collectives; "
                + "; ".join(f"rank {r}: {rec['why'][:120]}" for r, rec in sorted(records.items()))]
    group, nth, sides = divergence
    cause, rank = _classify(records, sides)
    e = sides[rank]
    head = (f"{cause}: rank {rank}, {e['op']} of {e['tag'] or '?'} ({e['phase'] or '-'} of unit "
            f"{e['unit'] or '-'}) at {_where(e)}")
    left = [r for r, s in sides.items() if s is None]
    if left:  # whose record ended, and how far they had come
        head += "; " + ", ".join(f"rank {r} ({records[r]['why'][:60]}) after backward pass "
                                 f"{records[r]['collectives'][-1]['backwards']}" for r in left
                                 if records[r]["collectives"])
    return [head, f"collective {nth} on the group of ranks {list(group)}:",
            *[_side(r, s) for r, s in sorted(sides.items())], f"fix: {CAUSES.get(cause, _GENERIC)}"]


def main(argv: list[str] | None = None) -> int:
    from minishard.observe.flight import directory
    args = sys.argv[1:] if argv is None else argv
    print("\n".join(diagnose(args[0] if args else directory())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
