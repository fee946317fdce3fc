"""What comm checks and records about every collective: the integrity layer beside the bytes.

comm.py moves the bytes (the collectives, one page); this file says what each collective IS and
whether the ranks agree about it, so that ranks on different paths raise, named, instead of
hanging or mixing numbers. comm hands every collective here, with its tag:

* **The flight record** (:class:`Flight`, ``FLIGHT``): the last ``MINISHARD_FLIGHT_RING``
  collectives this rank issued, always on, with the engine's last event and the user's line;
  observe/flight.py dumps it when a collective fails, observe/doctor.py explains the dumps.
* **Stamps** ([Note: stamps]): an all-gather's rows and an all-reduce's tail carry the stamp of
  the collective's tag (for the engine, its identity: every buffer and the model), checked on
  arrival before any value is used (:func:`check_rows`, :func:`check_sum`).
* **Timeouts**: a rank waits ``MINISHARD_TIMEOUT`` seconds in a collective, then raises a
  :class:`CollectiveError` naming it and the user's line (:func:`failed`), after the record is
  written.
* **The debug check** (``MINISHARD_DEBUG=1``): every rank all-gathers a fingerprint of each
  collective before it runs (:func:`check_same_collective`): a mismatch names every side.
* **Settings** from the environment, refused in one line when they are not numbers above 0.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
import time
import zlib
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from minishard.costs import group_ranks

__all__ = ["Flight", "Flown", "FLIGHT", "setting", "checked", "CollectiveMismatch",
           "CollectiveError", "set_debug", "check_same_collective", "STAMP_BYTES",
           "SUM_STAMP_NUMEL", "stamp", "row_stamp", "sum_stamp", "check_rows",
           "check_sum", "stamps_differ", "set_timeout", "TIMEOUT", "DEBUG", "failed", "dumped"]

# The flat all-gather: torch 2.13's name, else that of torch 2.5-2.12 (the debug check's).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------- settings
def setting(name: str, default, kind=float):
    """``$name`` read as a ``kind`` (float: seconds), :func:`checked`; unset or empty:
    ``default``."""
    raw = os.environ.get(name, "").strip()
    return checked(f"{name}={os.environ[name]!r}", raw, kind, default) if raw else default


def checked(name: str, value, kind=float, default=None):
    """``value`` as a ``kind``, above 0 and at most 1e9; anything else is refused in one line
    naming ``name`` and what it takes (a timeout of -1, "inf" or "abc" must not quietly become
    another: -1 fails every collective at once, blaming the other ranks)."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not 0 < number <= 1e9:  # nan fails it too
        what = "a number of seconds" if kind is float else "a whole number"
        unset = f" (unset: {default})" if default is not None else ""
        raise ValueError(f"{name}: expected {what} above 0{unset}, got {value!r}")
    return number


# ------------------------------------------------------------------------ the flight record
@dataclasses.dataclass(slots=True)
class Flown:
    """One collective in the flight record: its place (``seq`` on this rank, ``nth`` on its
    group), what it is, the engine's last event then, the user's line, and when it was issued
    and landed (``perf_counter``; ``t1`` None: not landed, or DTensor's, which torch waits on)."""
    seq: int
    nth: int
    op: str
    tag: str
    numel: int
    dtype: torch.dtype
    group: tuple         # (its name, the same on every rank; its global ranks): Flight.streams
    event: tuple         # (phase, unit, backward passes so far): Flight.heard
    site: tuple | None   # (file, line) of the first frame outside minishard and torch
    t0: float
    t1: float | None = None

    @property
    def what(self) -> str:  # for errors: what, and the line of the user's script it came from
        line = f" (from {os.path.basename(self.site[0])}:{self.site[1]})" if self.site else ""
        return f"{self.op} of {self.tag or 'an untagged tensor'}{line}"


class Flight:
    """The flight record: the last ``size`` collectives this rank issued, always on (comm adds
    each, Flight.heard hears the engine's events). observe/flight.py dumps it, observe/doctor.py
    explains the dumps. Bounded: ``size`` entries of about 300 bytes each."""

    def __init__(self, size: int) -> None:
        self.ring: collections.deque[Flown] = collections.deque(maxlen=size)
        self.seq, self.backwards = 0, 0
        # Each group's stream: [collectives issued on it, (name, global ranks)]. A group is
        # known by its name, which every rank gives it alike (comm's group=None and the WORLD
        # object DTensor passes are one stream); ``groups`` finds it by id(group), fast.
        self.streams: dict[tuple, list] = {}
        self.groups: dict[int, list] = {}
        self.event: tuple = ("", "", 0)  # see Flight.heard
        self.on_failure = None  # observe/flight.py: dump the record when a collective fails
        self.apart = False  # inside a dry run (kept_apart): nothing here is a real job's

    def issued(self, op: str, numel: int, dtype: torch.dtype, group, tag: str) -> Flown:
        self.seq += 1
        counted = self.groups.get(id(group)) or self._first_on(group)
        counted[0] += 1
        frame = sys._getframe(1)  # the user's line: the first frame not ours, torch's, ...
        while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
            frame = frame.f_back
        site = None if frame is None else (frame.f_code.co_filename, frame.f_lineno)
        flown = Flown(self.seq, counted[0], op, tag, numel, dtype, counted[1], self.event, site,
                      time.perf_counter())
        self.ring.append(flown)
        return flown

    def _first_on(self, group) -> list:
        """A group's stream, looked up once (a dump may come after the group is gone)."""
        if not dist.is_initialized():
            return self.groups.setdefault(id(group), [0, ("", (0,))])
        real = group if group is not None else dist.group.WORLD
        identity = (getattr(real, "group_name", "") or "", tuple(group_ranks(real)))
        stream = self.streams.setdefault(identity, [0, identity])
        self.groups[id(group)] = stream
        return stream

    def heard(self, event: str, unit, *payload) -> None:
        """The engine's listener: (phase, the last event's unit, backward passes begun so far);
        phase: "forward" from a step's first forward, "backward" while autograd runs, then
        "after backward" (the optimizer step, a no_sync gap, an evaluation outside the engine)."""
        self.backwards += event == "backward_pass"
        phase = _PHASES.get(event, self.event[0])
        self.event = (phase, unit.name if unit is not None else self.event[1], self.backwards)

    @contextlib.contextmanager
    def kept_apart(self) -> Iterator[None]:
        """Inside: a record of its own, dropped at the end (a dry run's world is not there:
        its collectives, groups and passes must not join the real job's record)."""
        kept = (self.ring, self.seq, self.backwards, self.streams, self.groups, self.event,
                self.on_failure, self.apart)
        self.ring = collections.deque(maxlen=self.ring.maxlen)
        self.streams, self.groups, self.on_failure, self.apart = {}, {}, None, True
        try:
            yield
        finally:
            (self.ring, self.seq, self.backwards, self.streams, self.groups, self.event,
             self.on_failure, self.apart) = kept


_PHASES = {"step": "forward", "backward_pass": "backward", "backward_done": "after backward"}


FLIGHT = Flight(setting("MINISHARD_FLIGHT_RING", 1024, int))  # collectives kept
_NOT_USER = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep,
             contextlib.__file__, functools.__file__)  # ... contextlib's or functools'


# ---------------------------------------------------------------------------- the debug check
class CollectiveMismatch(RuntimeError):
    """Ranks were about to issue different collectives (debug mode): a hang or silent garbage."""


DEBUG = {"on": os.environ.get("MINISHARD_DEBUG", "0") not in ("", "0"),
          "timeout": setting("MINISHARD_DEBUG_TIMEOUT", 10.0)}
_FINGERPRINT_BYTES = 192


def set_debug(enabled: bool, timeout: float | None = None) -> None:
    """Turn the collective-consistency check on or off (``MINISHARD_DEBUG=1`` turns it on at
    import; ``MINISHARD_DEBUG_TIMEOUT`` sets how long a rank waits for the others, in seconds)."""
    DEBUG["on"] = enabled
    if timeout is not None:
        DEBUG["timeout"] = timeout


def check_same_collective(op: str, tensor: torch.Tensor, group, n: int, tag: str) -> None:
    """Debug mode: every rank all-gathers a fingerprint of the collective (op, shape, dtype,
    tag) and compares; ranks on different code paths raise, all sides named, instead of hanging
    or summing unrelated tensors of equal size. One small all-gather per collective."""
    mine = f"{op} shape={tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} from {tag or '?'}"
    raw = mine.encode()[:_FINGERPRINT_BYTES].ljust(_FINGERPRINT_BYTES, b"\0")
    send = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(tensor.device)
    recv = torch.empty(n * _FINGERPRINT_BYTES, dtype=torch.uint8, device=tensor.device)
    work = _all_gather_flat(recv, send, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=DEBUG["timeout"]))
    except RuntimeError as exc:
        raise dumped(CollectiveMismatch(
            f"minishard debug: rank {dist.get_rank()} waited {DEBUG['timeout']:.0f} s at `{mine}` "
            "and not every rank arrived: another rank skipped this collective or is stuck in "
            "another one (the ranks took different code paths).")) from exc
    rows = recv.view(n, _FINGERPRINT_BYTES).cpu()
    theirs = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
    if len(set(theirs)) > 1:
        sides = "\n".join(f"  rank {_global(group, i)}: {fp}" for i, fp in enumerate(theirs))
        raise dumped(CollectiveMismatch(
            "minishard debug: the ranks are about to issue DIFFERENT collectives:\n"
            f"{sides}\nEvery rank must issue the same collectives in the same order: look for "
            "a branch that depends on the rank or on its data (a layer skipped on one rank, "
            "units run in another order, batches of different shapes)."))


# [Note: stamps] What a collective IS, in its own payload: the engine's all-gathers end each
# rank's row with a stamp (CRC of its identity, flat.identity: every buffer's name and the
# model's number; then the first 28 bytes of that text), compared before any value is used.
# Always on, no extra collective: ranks issuing different gathers of equal size (rank 0
# evaluating alone; rank 0 running model A while rank 1 runs model B) raise. The ledger leaves
# stamps out. A sum keeps a stamp of bits: the engine's all-reduces end with the CRC's 32 bits b
# and 1 - b (``sum_stamp``), which averaged (or max, min) come back unchanged only if every
# rank's agree. A reduce-scatter's chunks have no room: on gloo its messages' tags carry the CRC
# (gloo matches equal tags only), so two reductions are never combined: they wait and time out,
# named. A stamped identity is equal on every rank.
STAMP_BYTES, SUM_STAMP_NUMEL = 32, 64  # a row's room: STAMP_BYTES // itemsize elements


def stamp(what: str, itemsize: int) -> bytearray:
    """``what``'s stamp (STAMP_BYTES, rounded up to whole elements of ``itemsize`` bytes): a
    payload's rows end with ``torch.frombuffer(stamp, dtype=...)``; compare them as bytes."""
    raw = zlib.crc32(what.encode()).to_bytes(4, "little") + what.encode()[:STAMP_BYTES - 4]
    return bytearray(raw.ljust(-(-STAMP_BYTES // itemsize) * itemsize, b"\0"))


@functools.lru_cache(maxsize=512)  # made once for each (what, dtype, device): never write it
def row_stamp(what: str, dtype: torch.dtype, device) -> torch.Tensor:
    """``what``'s :func:`stamp` as elements of ``dtype``: what ends each row of a gather."""
    return torch.frombuffer(stamp(what, dtype.itemsize), dtype=dtype).to(device)


@functools.lru_cache(maxsize=512)  # made once for each (what, dtype, device): never write it
def sum_stamp(what: str, dtype: torch.dtype, device) -> torch.Tensor:
    """``what``'s stamp for a sum, average, max or min: the bits of its CRC, then 1 minus them."""
    return torch.tensor([(zlib.crc32(what.encode()) >> i & 1) ^ flip for flip in (0, 1)
                         for i in range(SUM_STAMP_NUMEL // 2)], dtype=dtype, device=device)


def stamps_differ(stamps, group, op: str) -> None:
    """Raise: ranks issued different collectives. ``stamps``: a gather's rows of stamp bytes,
    one a rank, not all equal; or (a str) what this rank's ``sum_stamp`` said, come back changed."""
    said = ({dist.get_rank(group): f"{stamps}; another rank: not that"} if isinstance(stamps, str)
            else dict(enumerate(bytes(row[4:].tolist()).rstrip(b"\0").decode(errors="replace")
                                for row in stamps.cpu())))
    sides = "\n".join(f"  rank {_global(group, i)}: {op} of {what}" for i, what in said.items())
    raise dumped(CollectiveMismatch(
        "minishard: the ranks issued DIFFERENT collectives of the same size, so the numbers "
        f"they exchanged mean nothing (none was used):\n{sides}\nEvery rank must run the same "
        "forwards and backwards in the same order. The usual cause: a forward on some ranks "
        "only, such as an evaluation under `if rank == 0` (nanoGPT's `and master_process`) at "
        "stages 1-3: evaluate on every rank. MINISHARD_DEBUG=1 names every collective."))


def check_rows(rows: torch.Tensor, group, tag: str) -> None:
    """An all-gather landed: every rank's row must end with this rank's stamp (``rows``: each
    rank's room, N rows), compared as bytes (a float compare would fail on NaN)."""
    got = rows.contiguous().view(torch.uint8)
    if not bool(got.eq(got[:1]).all()):
        stamps_differ(got, group, "all_gather")


def check_sum(tail: torch.Tensor, tag: str, group) -> None:
    """An all-reduce (avg, max or min) landed: its ``tail`` came back as this rank sent it only
    if every rank sent the same stamp."""
    if not torch.equal(tail, sum_stamp(tag, tail.dtype, tail.device)):
        stamps_differ(tag, group, "all_reduce")


# ------------------------------------------------------------------------------- timeouts
class CollectiveError(RuntimeError):
    """A collective did not complete here: past MINISHARD_TIMEOUT, or failed by the backend."""


TIMEOUT = {"limit": timedelta(seconds=setting("MINISHARD_TIMEOUT", 600.0))}


def set_timeout(seconds: float) -> None:  # how long a rank waits in one of comm's collectives
    TIMEOUT["limit"] = timedelta(seconds=checked("set_timeout", seconds, float))


def dumped(error: RuntimeError) -> RuntimeError:  # after the flight record is written
    note = FLIGHT.on_failure(str(error)) if FLIGHT.on_failure is not None else ""
    error.args = (f"{error}\n  ({note})",) if note else error.args  # where it is, who reads it
    return error


def failed(flown, exc: RuntimeError, waited: float) -> CollectiveError:
    why = (f"waited {waited:.0f} s (MINISHARD_TIMEOUT) and not every rank came: another rank "
           "skipped it, is stuck in another collective, or died" if "timed out" in str(exc).lower()
           else f"the backend failed it ({str(exc).splitlines()[0][:200]}): the ranks issued "
           "different collectives (a forward, save or evaluation on some ranks only, a loop left "
           "early without Join), or one died")
    what = flown.what if flown is not None else "a collective"
    return dumped(CollectiveError(f"minishard: rank {dist.get_rank()}, {what}: {why}."))




def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank
