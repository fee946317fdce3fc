"""The flight record, written down: where this rank stood when a collective failed.

comm adds every collective to ``comm.FLIGHT`` (costs.Flight: the last 1024, about 300 bytes
each, always on; DTensor's collectives for torch's tools too, once an engine exists), with the
engine's last event and the user's line. This module writes that ring to
``<dir>/rank<r>.json``, ``dir`` being ``$MINISHARD_FLIGHT_DIR`` or :data:`DEFAULT_DIR`:

* when one of comm's collectives times out (``MINISHARD_TIMEOUT``), fails in the backend, or a
  stamp or debug check finds the ranks disagreeing (the error is raised after the dump);
* on ``SIGUSR1`` (``kill -USR1 <pid>``: a job that seems stuck, still running), and on
  ``SIGTERM`` (torchrun stopping the ranks once one failed), then it dies of that signal;
* on request: ``minishard.dump_flight_record(dir)``;
* at exit, when ``MINISHARD_FLIGHT_DIR`` is set (a rank that left the loop early says so).
A rank that gloo aborts (a size mismatch it detects in its own thread) cannot run Python: its
``rank<r>.fault`` (faulthandler, when nothing else enabled it) holds where its threads were.
``python -m minishard.doctor DIR`` lines the ranks up and names the first divergence.

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
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from minishard.comm import FLIGHT
from minishard.zero import params

__all__ = ["dump_flight_record", "arm", "DEFAULT_DIR", "directory"]

DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "minishard_flight")
_armed: dict = {}


def directory() -> Path:
    return Path(os.environ.get("MINISHARD_FLIGHT_DIR") or DEFAULT_DIR)


def _rank() -> int:  # the process group may be gone by exit
    return dist.get_rank() if dist.is_initialized() else _armed.get("rank", 0)


def dump_flight_record(dir: str | os.PathLike | None = None, why: str = "on request") -> Path:
    """Write this rank's flight record to ``<dir>/rank<r>.json`` (``dir``: see the module doc);
    returns the path. Any rank may call it at any time; it issues no collective."""
    out = Path(dir) if dir is not None else directory()
    out.mkdir(parents=True, exist_ok=True)
    offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
    rows = []
    for f in list(FLIGHT.ring):
        rows.append(dict(
            seq=f.seq, nth=f.nth, op=f.op, tag=f.tag, numel=f.numel, dtype=str(f.dtype)[6:],
            bytes=f.numel * f.dtype.itemsize, ranks=list(f.ranks),
            phase=f.event[0], unit=f.event[1], backwards=f.event[2],
            file=f.site[0] if f.site else None, line=f.site[1] if f.site else None,
            issued=f.t0 + offset, landed=None if f.t1 is None else f.t1 + offset))
    record = dict(rank=_rank(), world=_armed.get("world", 1),
                  job=os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", ""),
                  pid=os.getpid(), why=why, armed=_armed.get("time"), written=time.time(),
                  issued=FLIGHT.seq, collectives=rows, torch=_torch_record())
    path = out / f"rank{record['rank']}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=0))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


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
    """Once per process (the first engine calls it): dumps on failure, SIGUSR1 and (with
    MINISHARD_FLIGHT_DIR set) exit; faulthandler into ``rank<r>.fault``; DTensor's collectives
    recorded from now on."""
    if _armed.get("pid") == os.getpid():
        return
    _armed.update(pid=os.getpid(), rank=_rank(), world=dist.get_world_size(), time=time.time())
    FLIGHT.on_failure = _on_failure
    for signum, handler in ((signal.SIGUSR1, lambda *_: _dump_quietly("SIGUSR1")),
                            (signal.SIGTERM, _on_sigterm)):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signum) in (signal.SIG_DFL, None)):
            signal.signal(signum, handler)
    if os.environ.get("MINISHARD_FLIGHT_DIR"):
        atexit.register(lambda: FLIGHT.ring and "failed" not in _armed and _dump_quietly("exit"))
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError):
            directory().mkdir(parents=True, exist_ok=True)
            _armed["fault"] = open(directory() / f"rank{_rank()}.fault", "w")  # noqa: SIM115
            faulthandler.enable(_armed["fault"], all_threads=True)
    _armed["watch"] = contextlib.ExitStack()
    _armed["watch"].enter_context(params.torch_collectives())


def _on_sigterm(signum, frame) -> None:
    """torchrun stops every rank once one fails: write the record (unless a failure's is
    there), then die of SIGTERM all the same."""
    if "failed" not in _armed:
        _dump_quietly("SIGTERM: stopped from outside (torchrun stops every rank once one fails)")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _on_failure(message: str) -> None:
    _armed["failed"] = True  # the exit keeps this record
    _dump_quietly(f"failed: {message}")


def _dump_quietly(why: str) -> None:
    try:
        dump_flight_record(why=why)
    except Exception:  # noqa: BLE001 - the error being raised matters more than its record
        pass
