"""The doctor's reading of a directory of flight records: checked, one job, lined up, a Scene.

``load`` reads ``rank<r>.json`` (and ``rank<r>.fault``) files; a file that is not a flight
record of flight.py's :data:`~minishard.observe.flight.FORMAT` is refused in one line naming
it and what is expected (:class:`Unreadable`). Of several jobs the directory holds, the one
written last is read. ``scene`` lines each group's streams up from the first collective every
member's ring still holds (a ring drops its oldest entries, each rank's at its own pace), finds
where the ranks stopped agreeing, and gathers what the doctor's causes ask of it.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from minishard.observe.flight import FORMAT

__all__ = ["Unreadable", "Scene", "load", "scene", "where", "reduced", "REDUCTIONS"]

REDUCTIONS = ("reduce_scatter", "all_reduce")
_NUMBER = (int, float)
_RECORD = {"rank": int, "world": int, "job": str, "why": str, "written": _NUMBER,
           "issued": int, "now": dict, "groups": list, "collectives": list}
_ROW = {"nth": int, "op": str, "tag": str, "numel": int, "dtype": str, "group": str,
        "ranks": list, "phase": str, "unit": str, "backwards": int, "file": (str, type(None)),
        "line": (int, type(None)), "issued": _NUMBER, "landed": (*_NUMBER, type(None))}
_GROUP = {"group": str, "ranks": list, "issued": int}
_NOW = {"phase": str, "unit": str, "backwards": int}
_NAME = re.compile(r"rank(\d+)\.(json|fault)")


class Unreadable(ValueError):
    """A directory or file the doctor cannot read: one line says which, and what it expects."""


def _checked(path: Path, fields: dict, value, what: str) -> None:
    if not isinstance(value, dict):
        raise Unreadable(f"{path}: {what} is not a JSON object")
    for name, kind in fields.items():
        if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise Unreadable(f"{path}: {what} has no {name!r} of type "
                             f"{' or '.join(k.__name__ for k in kinds)} (a flight record from "
                             "another minishard, or edited?)")


def _read(path: Path) -> dict:
    """One record, checked field by field (a foreign or damaged file: Unreadable)."""
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise Unreadable(f"{path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{path}: not a flight record: not JSON, or cut short "
                         f"({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise Unreadable(f"{path}: not a flight record: expected a JSON object with \"format\": "
                         f"\"{FORMAT}\" (what flight.py writes), found "
                         f"{repr(found) if found else 'none'}")
    _checked(path, _RECORD, record, "the record")
    for i, row in enumerate(record["collectives"]):
        _checked(path, _ROW, row, f"collective {i}")
    for i, group in enumerate(record["groups"]):
        _checked(path, _GROUP, group, f"group {i}")
    _checked(path, _NOW, record["now"], "its 'now'")
    if f"rank{record['rank']}.json" != path.name or not 0 <= record["rank"] < record["world"]:
        raise Unreadable(f"{path}: says it is rank {record['rank']} of {record['world']} "
                         "(each rank writes its own rank<r>.json)")
    return record


def load(directory: str | Path) -> tuple[dict[int, dict], dict[int, str], int, list[str]]:
    """(the newest job's records by rank, its fault tracebacks by rank, its world size, the
    files of other jobs left aside)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise Unreadable(f"{directory}: no such directory (expected the MINISHARD_FLIGHT_DIR "
                         "the ranks wrote their flight records to)")
    files = sorted(p for p in directory.iterdir() if _NAME.fullmatch(p.name))
    everyone = [_read(p) for p in files if p.suffix == ".json"]
    if not everyone:
        return {}, {}, 0, []
    newest = max(everyone, key=lambda r: r["written"])["job"]
    records = {r["rank"]: r for r in everyone if r["job"] == newest}
    aside = sorted(f"rank{r['rank']}.json" for r in everyone if r["job"] != newest)
    world = max(r["world"] for r in records.values())
    faults = {}
    for path in files:
        rank = int(_NAME.fullmatch(path.name).group(1))
        if path.suffix == ".fault" and rank not in records and rank < world:
            try:
                head, _, text = path.read_text(errors="replace").partition("\n")
            except OSError:  # unreadable: as if gloo had not aborted it
                continue
            if head == f"minishard job {newest}" and text.strip():  # this job's, not empty
                faults[rank] = text
    return records, faults, world, aside


def _tag(tag: str) -> str:
    """A tag as ranks compare it: SyncBatchNorm's build number (``#k``, the k-th layer built in
    that process) left out, as a rank that built one more layer earlier numbers the same
    layer apart."""
    return re.sub(r" #\d+", "", tag)


def _what(e: dict | None):
    return None if e is None else (e["op"], _tag(e["tag"]), e["numel"], e["dtype"])


def where(e: dict | None) -> str:
    return f"{Path(e['file']).name}:{e['line']}" if e and e.get("file") else "?"


@dataclasses.dataclass
class Scene:
    """Where the ranks stopped agreeing, and what the records say around it."""
    records: dict[int, dict]
    group: tuple                    # (name, global ranks) of the group they stopped on
    nth: int                        # its collective where they stopped
    sides: dict[int, dict | None]   # each member's collective there (None: its stream ended)
    extra: dict[int, dict]          # rank -> {(file, line): its rows}: lines only it (and
                                    # some others, not all) issued collectives from
    passes: dict[int, int]          # backward passes begun by each member there
    ahead: tuple | None = None      # (a rank ahead, a rank behind) when passes apart
    gap: int = 0                    # by how many passes
    left: bool = False              # apart only where a rank's stream ended
    quiet: dict = dataclasses.field(default_factory=dict)  # rank -> passes that reduced
    # nothing since the lined-up window began (None: the window shows no drift to count)


def _streams(records: dict[int, dict]) -> dict[tuple, dict[int, list]]:
    """(group name, ranks) -> rank -> [collectives it issued on the group, {nth: row}]."""
    out: dict[tuple, dict[int, list]] = {}
    for rank, rec in records.items():
        for g in rec["groups"]:
            out.setdefault((g["group"], tuple(g["ranks"])), {})[rank] = [g["issued"], {}]
        for e in rec["collectives"]:
            stream = out.setdefault((e["group"], tuple(e["ranks"])), {}).setdefault(rank, [0, {}])
            stream[1][e["nth"]] = e
            stream[0] = max(stream[0], e["nth"])
    return out


def _stop(records, group, by_rank):
    """(first nth every member's ring still holds, the nth where the members stop agreeing or
    None, its sides); None for a group with fewer than two members on the record."""
    members = [r for r in group[1] if r in records]
    if len(members) < 2:
        return None
    streams = {r: by_rank.get(r, [0, {}]) for r in members}
    begin = max(min(rows) if rows else issued + 1 for issued, rows in streams.values())
    end = max(issued for issued, _ in streams.values())
    for nth in range(begin, end + 1):  # a rank whose stream ended there: None
        sides = {r: rows.get(nth) for r, (_, rows) in streams.items()}
        if len({_what(e) for e in sides.values()}) > 1:
            return begin, nth, sides
    return begin, None, None


def scene(records: dict[int, dict]) -> Scene | None:
    """Where the ranks stopped agreeing (the earliest such place over all groups), or None
    when every group's streams agree to their ends."""
    streams, stops = _streams(records), {}
    for group, by_rank in streams.items():
        stops[group] = _stop(records, group, by_rank)
    found = [(min(e["issued"] for e in stop[2].values() if e is not None), group)
             for group, stop in stops.items() if stop is not None and stop[1] is not None]
    if not found:
        return None
    group = min(found)[1]
    begin, nth, sides = stops[group]
    passes = {r: e["backwards"] if e is not None else records[r]["now"]["backwards"]
              for r, e in sides.items()}
    s = Scene(records, group, nth, sides, _extra(records, streams, stops), passes)
    _drift(s, streams[group], begin)
    return s


def _extra(records, streams, stops) -> dict[int, dict]:
    """Lines of the user's script only some ranks issued collectives from, up to where each
    group stopped agreeing (from where every rank's ring holds it): rank -> {line: rows}."""
    lines: dict[int, dict] = {r: {} for r in records}
    for group, by_rank in streams.items():
        if stops[group] is None:
            continue
        begin, nth, _ = stops[group]
        for rank, (_, rows) in by_rank.items():
            for e in rows.values():
                if begin <= e["nth"] and (nth is None or e["nth"] <= nth):
                    lines[rank].setdefault((e["file"], e["line"]), []).append(e)
    every = set.intersection(*(set(found) for found in lines.values()))
    return {r: {line: rows for line, rows in found.items() if line not in every}
            for r, found in lines.items() if set(found) - every}


def reduced(e: dict) -> bool:  # a gradient reduction of the engine's (not torch's, not a flag)
    return e["op"] in REDUCTIONS and e["phase"] == "backward" and not e["tag"].startswith("torch")


def _drift(s: Scene, by_rank: dict, begin: int) -> None:
    """Are the ranks backward passes apart, and did the extra passes reduce? Judged where the
    gap shows first: at the last collective they agreed on, else where they stopped."""
    members = list(s.sides)
    last = {r: by_rank[r][1].get(s.nth - 1) for r in members} if s.nth > begin else {}
    points = [{r: e["backwards"] for r, e in last.items()}] if last and None not in \
        last.values() else []
    points.append(s.passes)  # where they stopped: an ended stream, its rank's last pass
    for at in points:
        if len(set(at.values())) > 1:
            break
    else:
        return
    ahead, behind = max(at, key=at.get), min(at, key=at.get)
    s.ahead, s.gap = (ahead, behind), at[ahead] - at[behind]
    # Apart only because a rank left: the others began a pass it never began (stage 0's
    # first collective of a step is in backward), which is what a batch fewer looks like too.
    s.left = at is s.passes and None in s.sides.values()
    starts = {r: by_rank.get(r, [0, {}])[1].get(begin) for r in (ahead, behind)}
    if None in starts.values():  # a stream that ended before the window: nothing to count
        return
    first = {r: e["backwards"] for r, e in starts.items()}
    if (at[ahead] - first[ahead]) - (at[behind] - first[behind]) != s.gap:
        return  # apart already where the window begins: their extra passes are not on record
    for r in (ahead, behind):  # passes wholly inside the window, before the point
        done = {e["backwards"] for e in s.records[r]["collectives"] if reduced(e)}
        s.quiet[r] = sum(p not in done for p in range(first[r] + 1, at[r]))
