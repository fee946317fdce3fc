"""The flight record, written down: where this rank stood when a collective failed.

comm adds every collective to ``comm.FLIGHT`` (checks.Flight: the last 1024, about 300 bytes
each, always on; DTensor's collectives for torch's tools too, once an engine exists), with its
group, the engine's last event and the user's line. This module writes that ring to
``<dir>/rank<r>.json``, ``dir`` being ``$MINISHARD_FLIGHT_DIR`` or :data:`DEFAULT_DIR`:

* when one of comm's collectives times out (``MINISHARD_TIMEOUT``), fails in the backend, or a
  stamp or debug check finds the ranks disagreeing (the error is raised after the dump);
* on ``SIGUSR1`` (``kill -USR1 <pid>``: a job that seems stuck, still running), ``SIGTERM``
  (torchrun stopping the ranks once one failed; then it dies of it) and ``SIGINT`` (Ctrl-C), at
  once, even while the rank waits inside a collective (a thread writes it: ``_watch``);
* on request: ``minishard.dump_flight_record(dir)``;
* at exit, when ``MINISHARD_FLIGHT_DIR`` is set (a rank that left the loop early says so, and
  whether an exception ended it); never over the record a failure wrote.
Every record names its job (``_job``: one id per launch, shared by its ranks), so the doctor
reads one job from a directory several have written. A rank that gloo aborts (a size mismatch
it detects in its own thread) cannot run Python: its ``rank<r>.fault`` (faulthandler, when
nothing else enabled it; its first line names the job) holds where its threads were. A dry run
(dry_run.py) keeps its collectives apart and arms nothing. ``python -m minishard.doctor DIR``
lines the ranks up and says what it can tell.

torch's own Flight Recorder works on gloo in torch 2.13 when ``TORCH_FR_BUFFER_SIZE`` is set
before the process group is made: its entries (every collective torch ran, minishard's and the
user's own ``dist.*`` calls, op, sizes, dtypes, per-group sequence ids; no user line, no unit, no
completion time on gloo) go into the same file under ``"torch"``.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from minishard.comm import FLIGHT, CollectiveError, CollectiveMismatch
from minishard.zero import params

__all__ = ["dump_flight_record", "arm", "DEFAULT_DIR", "directory", "FORMAT"]

DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "minishard_flight")
FORMAT = "minishard flight record 2"  # what the doctor reads (records of another shape: refused)
_armed: dict = {}
_writing = threading.Lock()  # the main thread's failure and the signal thread's: one at a time


def directory() -> Path:
    return Path(os.environ.get("MINISHARD_FLIGHT_DIR") or DEFAULT_DIR)


def _rank() -> int:  # the process group may be gone by exit
    return dist.get_rank() if dist.is_initialized() else _armed.get("rank", 0)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else _armed.get("world", 1)


def dump_flight_record(dir: str | os.PathLike | None = None, why: str = "on request") -> Path:
    """Write this rank's flight record to ``<dir>/rank<r>.json`` (``dir``: see the module doc);
    returns the path. Any rank may call it at any time; it issues no collective."""
    out = Path(dir) if dir is not None else directory()
    out.mkdir(parents=True, exist_ok=True)
    offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
    rows = [dict(seq=f.seq, nth=f.nth, op=f.op, tag=f.tag, numel=f.numel,
                 dtype=str(f.dtype)[6:], bytes=f.numel * f.dtype.itemsize, group=f.group[0],
                 ranks=list(f.group[1]), phase=f.event[0], unit=f.event[1],
                 backwards=f.event[2], file=f.site[0] if f.site else None,
                 line=f.site[1] if f.site else None, issued=f.t0 + offset,
                 landed=None if f.t1 is None else f.t1 + offset) for f in list(FLIGHT.ring)]
    groups = [dict(group=name, ranks=list(ranks), issued=count)
              for count, (name, ranks) in list(FLIGHT.streams.values())]
    phase, unit, backwards = FLIGHT.event
    record = dict(format=FORMAT, rank=_rank(), world=_world(), job=_job(),
                  pid=os.getpid(), why=why, armed=_armed.get("time"), written=time.time(),
                  issued=FLIGHT.seq, now=dict(phase=phase, unit=unit, backwards=backwards),
                  groups=groups, collectives=rows, torch=_torch_record())
    path = out / f"rank{record['rank']}.json"
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(record, indent=0))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def _job() -> str:
    """One id per launch, the same on its every rank: the rendezvous' run id (torchrun
    --standalone draws one; a plain torchrun names every run "none"), the restart, and a draw
    the first rank to ask leaves in the job's own store for the others (no other launch shares
    that store). Without a process group: this process's own."""
    if "job" in _armed:
        return _armed["job"]
    run = os.environ.get("TORCHELASTIC_RUN_ID") or "-"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store = dist.distributed_c10d._get_default_store()
        drawn = store.compare_set(f"minishard flight job {restart}", "", uuid.uuid4().hex[:12])
        drawn = drawn.decode()
    except Exception:  # noqa: BLE001 - no process group, or a store that cannot compare
        drawn = f"pid {os.getpid()} {uuid.uuid4().hex[:6]}"
    _armed["job"] = f"{run}/{restart}/{drawn}"
    return _armed["job"]


def _torch_record():
    """torch's Flight Recorder's entries, if it was switched on (TORCH_FR_BUFFER_SIZE)."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
        return json.loads(_dump_fr_trace_json(True, True)).get("entries")
    except Exception as exc:  # a diagnostic must never hide the error it explains
        return {"error": repr(exc)}


def arm() -> None:
    """Once per process (the first engine calls it; not inside a dry run): dumps on failure,
    signals and (with MINISHARD_FLIGHT_DIR set) exit; faulthandler into ``rank<r>.fault``;
    DTensor's collectives recorded from now on."""
    if _armed.get("pid") == os.getpid() or FLIGHT.apart:
        return
    _armed.update(pid=os.getpid(), rank=_rank(), world=dist.get_world_size(), time=time.time())
    _armed.pop("job", None)  # a forked child draws its own
    _job()
    FLIGHT.on_failure = _on_failure
    _listen_for_signals()
    atexit.register(_leave_after_failure)  # atexit runs the last registered first: after this
    if os.environ.get("MINISHARD_FLIGHT_DIR"):
        atexit.register(_at_exit)
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError):
            directory().mkdir(parents=True, exist_ok=True)
            _armed["fault"] = open(directory() / f"rank{_rank()}.fault", "w")  # noqa: SIM115
            _armed["fault"].write(f"minishard job {_job()}\n")  # whose traceback follows
            _armed["fault"].flush()
            faulthandler.enable(_armed["fault"], all_threads=True)
    _armed["watch"] = contextlib.ExitStack()
    _armed["watch"].enter_context(params.torch_collectives())


_SIGNALS = {signal.SIGUSR1: "SIGUSR1: asked from outside (kill -USR1), still running",
            signal.SIGTERM: "SIGTERM: stopped from outside (torchrun stops every rank once one "
                            "fails)",
            signal.SIGINT: "SIGINT: interrupted (Ctrl-C, or torchrun stopping the ranks)"}


def _listen_for_signals() -> None:
    """Python runs a signal's handler only between the main thread's bytecodes, and a rank
    waiting in a collective is inside gloo's C++ until the timeout: stopped before it, it would
    write nothing. So each signal left to its default (SIGINT: to KeyboardInterrupt) also wakes
    a thread (``signal.set_wakeup_fd``) that writes the record at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    ours = [s for s in _SIGNALS if signal.getsignal(s) in (signal.SIG_DFL, None,
                                                              signal.default_int_handler)]
    read, write = os.pipe()
    os.set_blocking(write, False)
    before = signal.set_wakeup_fd(write, warn_on_full_buffer=False) if ours else -1
    if before == -1 and ours:
        threading.Thread(target=_watch, args=(read, set(ours)), daemon=True,
                         name="minishard flight record").start()
        _armed["thread"] = True
    else:  # someone else listens there (an event loop): theirs; the handlers write it late
        if ours:
            signal.set_wakeup_fd(before)
        os.close(read), os.close(write)
    for signum in ours:
        signal.signal(signum, _in_main_thread)


def _in_main_thread(signum, frame) -> None:
    """The handler Python runs (late, if the rank waited in a collective): the thread wrote
    the record, if there is one; Ctrl-C still raises KeyboardInterrupt here."""
    if not _armed.get("thread"):
        _stopped(signum)
        if signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt


def _watch(read: int, ours: set) -> None:
    while True:
        signum = os.read(read, 1)[0]
        if signum not in ours:  # another handler's signal
            continue
        _stopped(signum)
        if signum == signal.SIGTERM:  # dies of it, as it would have (128 + 15, from a thread)
            os._exit(128 + signal.SIGTERM)


def _stopped(signum: int) -> None:
    if "failed" not in _armed:  # a failure's record says more than the stop that followed
        _dump_quietly(_SIGNALS[signum])


def _at_exit() -> None:
    if not FLIGHT.ring:
        return
    if "failed" in _armed:  # the failure's record stays: leaving after it says nothing new
        return
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    _dump_quietly("exit" if error is None else
                  f"exit after an uncaught exception: {type(error).__name__}: {error}"[:400])


def _leave_after_failure() -> None:
    """A rank that an uncaught error ends after one of its collectives failed leaves at once:
    finalizing would destroy its process group, whose gloo threads are still inside the
    collective that never completes (they let go at the group's own timeout, 30 minutes under
    torchrun), and the ranks waiting for it learn it is gone only when its connections close.
    Exit status 1, as for any uncaught exception; the traceback is printed by now. Only for
    minishard's own errors (or one they caused): other exits keep their atexit handlers."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    while error is not None and not isinstance(error, (CollectiveError, CollectiveMismatch)):
        error = error.__cause__ or error.__context__  # (a test runner's failure is not one)
    if "failed" in _armed and error is not None:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)


def _on_failure(message: str) -> str:
    """Write the record; what the error adds: where it is, and what reads it."""
    _armed["failed"] = True  # the exit keeps this record
    path = _dump_quietly(f"failed: {message}")
    return "" if path is None else (f"flight record: {path}; once every rank has stopped, "
                                    f"python -m minishard.doctor {path.parent} says why")


def _dump_quietly(why: str) -> Path | None:
    try:
        with _writing:
            return dump_flight_record(why=why)
    except Exception:  # noqa: BLE001 - the error being raised matters more than its record
        return None
