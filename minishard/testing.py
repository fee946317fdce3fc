"""RankPool: warm gloo ranks for tests (public: users test their own code with it too).

Starting a rank costs seconds (importing torch). A property test that spawned ranks per example would
spend its whole budget starting processes. A pool starts ``world_size`` processes once; each joins a
gloo process group (with a timeout) and then waits for work::

    with RankPool(2) as pool:
        results = pool.run(my_function, arg1, arg2)   # my_function(arg1, arg2) on every rank
        # results[r] is what rank r returned

``my_function`` must be picklable by reference: a module-level function (not a lambda or closure).
Inside it, ``torch.distributed`` is initialized (``dist.get_rank()``, ``dist.get_world_size()``).

Failure handling:
  * an exception on any rank is re-raised here as :class:`RankError`, naming the rank and carrying
    its traceback;
  * if any rank has not answered within ``timeout`` seconds (a hang: say one rank skipped a
    collective), :class:`TimeoutError` is raised naming the ranks that did not answer, the pool's
    processes are killed, and the next ``run`` starts fresh ranks.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
import weakref
from datetime import timedelta

__all__ = ["RankPool", "RankError"]


class RankError(RuntimeError):
    """An exception raised by a function on one of the pool's ranks."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        lines = remote_traceback.rstrip().splitlines()
        # The exception (possibly several lines) follows the last indented frame line.
        frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
        last = "\n".join(lines[frames[-1] + 1:] if frames else lines[-1:])
        super().__init__(f"rank {rank} raised: {last}\n\n--- traceback on rank {rank} ---\n"
                         f"{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, pg_timeout: float, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # a pool started inside a torchrun job
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share few cores, as torchrun arranges
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = tasks.get()
        if job is None:
            break
        call_id, payload = job
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(*args, **kwargs)
            results.put((rank, call_id, ("ok", pickle.dumps(out))))
        except BaseException:
            results.put((rank, call_id, ("error", traceback.format_exc())))
    dist.destroy_process_group()


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class RankPool:
    """``world_size`` warm processes in one gloo process group. See the module docstring.

    ``timeout`` bounds every :meth:`run` (seconds); the ranks' process group uses the same timeout,
    so a collective that can never complete also fails on the rank that is stuck in it. Once one
    rank has raised, the others get ``error_grace`` seconds to answer before the pool is rebuilt.
    """

    def __init__(self, world_size: int, timeout: float = 60.0, error_grace: float = 3.0) -> None:
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout, self.error_grace = world_size, timeout, error_grace
        self._procs: list = []
        self._calls, self._died_at = 0, None
        self.startup_seconds: float | None = None
        # A pool nobody closed is still cleaned up when the interpreter exits: no orphan ranks.
        self._finalizer = weakref.finalize(self, _kill, self._procs)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> "RankPool":
        """Start the ranks (a no-op if they run). The rendezvous port is picked free just before
        use, and another process can take it in between: a failed start is retried on a new port."""
        if self._procs:
            return self
        t0 = time.perf_counter()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                break
            except (RankError, TimeoutError):
                if attempt == attempts:
                    raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    def _start_once(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        for r in range(self.world_size):
            p = ctx.Process(target=_worker, daemon=True, name=f"minishard-rank{r}",
                            args=(r, self.world_size, port, self.timeout, self._tasks[r],
                                  self._results))
            p.start()
            self._procs.append(p)
        ready = set()
        deadline = time.monotonic() + max(self.timeout, 120.0)
        while len(ready) < self.world_size:
            try:
                rank, kind, info = self._get(deadline)
            except TimeoutError as exc:
                self._teardown()
                raise TimeoutError(f"RankPool({self.world_size}) did not start: {exc}") from None
            if kind == "error":
                self._teardown()
                raise RankError(rank, info)
            ready.add(rank)

    def close(self) -> None:
        """Stop the ranks. The pool can be started again by the next :meth:`run`."""
        if not self._procs:
            return
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 3.0  # a clean exit normally takes milliseconds
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill(self._procs)
        self._procs.clear()

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- work --------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # lambdas, closures, local classes, open files...
            raise TypeError(
                f"RankPool.run: could not pickle the function or its arguments ({exc}). The ranks "
                "are separate processes: pass a module-level function (not a lambda, closure or "
                "nested function) and picklable arguments.") from exc
        self.start()
        self._calls, self._died_at = self._calls + 1, None
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, payload))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        outs: dict[int, tuple] = {}
        while len(outs) < self.world_size:
            try:
                rank, cid, out = self._get(deadline)
            except TimeoutError as exc:
                self._teardown()
                errors = sorted(r for r, o in outs.items() if o[0] == "error")
                if errors:  # the others are stuck waiting for the rank that failed
                    raise RankError(errors[0], outs[errors[0]][1]) from None
                silent = [r for r in range(self.world_size) if r not in outs]
                raise TimeoutError(
                    f"RankPool({self.world_size}): ranks {silent} did not finish "
                    f"{getattr(fn, '__name__', fn)} ({exc}). Probably they wait in a collective "
                    "that another rank never called (ranks took different code paths). The pool "
                    "was torn down; the next run() starts fresh ranks.") from None
            if cid != call_id:
                continue  # a late answer from an earlier, abandoned call
            outs[rank] = out
            if out[0] == "error":  # give the other ranks a moment, not the whole timeout
                deadline = min(deadline, time.monotonic() + self.error_grace)
        for r in range(self.world_size):
            if outs[r][0] == "error":
                raise RankError(r, outs[r][1])
        return [pickle.loads(outs[r][1]) for r in range(self.world_size)]

    def _get(self, deadline: float):
        """The next message from any rank; TimeoutError at the deadline, or ``error_grace``
        seconds after a rank died (meanwhile the others may still answer: a rank left waiting
        for the dead one fails in its own words and writes its flight record)."""
        while True:
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead:
                self._died_at = self._died_at or time.monotonic()
                if time.monotonic() - self._died_at > self.error_grace:
                    raise TimeoutError(f"rank processes died: {dead}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            try:
                return self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue

    def _teardown(self) -> None:
        procs = list(self._procs)
        self._procs.clear()
        _kill(procs)
