"""A dry run: the engine's own step, in one process, seen from one rank of a world that is not
there. What that rank allocates is then measured, not modelled::

    with dry_run(world=4, rank=3):                       # no other process, no network
        model = ZeRO(build(), stage=3, units={Block})
        opt = torch.optim.Adam(model.parameters())
        with Allocations() as alloc:                     # observe/allocations.py
            for _ in range(2):
                model(x).sum().backward(); opt.step(); opt.zero_grad()
    alloc.peak                                           # rank 3's peak on 4 ranks

Inside, the default process group is a :class:`Mirror`: every collective completes at once, as if
every rank had sent what this one sent. So the engine runs its real code, on its real buffers,
in its real order, and each check that compares ranks (the config check, the gathers' stamps,
the stamped sums) agrees with itself. The mirror takes gloo's paths in comm.py (it stands for
gloo: ``dist.get_backend`` says "gloo"), so comm's own buffers (the exchange's) are made too.

Why not a formula: the step formula (``zero.meters.transients``) adds each buffer's largest size
wherever it occurs in the step, a bound; the peak is one moment, and which buffers are alive at
that moment is the schedule's business (bench/RESULTS.md, "The planner beside a run").

What it is not: a training. Point-to-point receives (the gloo reduce-scatter's exchange) come
back as zeros, so the numbers are not a real run's. Nor a race: gloo's worker thread lets go of
a collective's tensors just after the wait returns, and now and then a real peak holds them one
moment more (one collective's buffers; tests/test_predict.py sizes its models past that). The
dry run spends this machine's memory for this rank's share, and its time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.futures import Future

from minishard import checks, comm

__all__ = ["Mirror", "Call", "dry_run"]


@dataclasses.dataclass
class Call:
    """One call the backend got: its kind, the bytes of its tensors, the collective of comm.py
    that made it (``what``: "all_gather blocks.3"; "" for a caller outside comm: DDP's; ``of``:
    its number, this process's n-th of comm.py's collectives; 0 outside comm), when
    it was issued and first waited for (``perf_counter``; DDP's, made in backward: when backward
    ends, where DDP's reducer waits for them; None: not waited yet)."""
    op: str
    nbytes: int
    what: str = ""
    issued: float = 0.0
    waited: float | None = None
    of: int = 0


class _Done(dist.Work):
    """A collective already complete; ``then`` runs at the first ``wait()``."""

    def __init__(self, result, call: Call, then=None) -> None:
        super().__init__()
        self._result, self._call, self._then = result, call, then

    def wait(self, timeout=None) -> bool:
        if self._then is not None:
            self._then()
            self._then = None
        _waited(self._call)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Future:
        future = Future()
        future.set_result(self._result)
        return future


def _waited(call: Call) -> None:
    if call.waited is None:
        call.waited = time.perf_counter()


class Mirror(dist.ProcessGroup):
    """``world`` ranks, of which only ``rank`` exists: each collective's result is what it would
    be if every rank had sent this rank's tensors."""

    stands_for = "gloo"  # dist.get_backend's answer: comm.py takes gloo's paths

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.together, self._barriers = None, 0  # dry_run's
        self._rank, self._world = rank, world
        self._sent: dict[int, weakref.ref] = {}  # storage -> this rank's slice, broadcast by it
        self.calls: list[Call] = []  # every call, in order: observe/predict.py times a step
        self._what, self._of, self._collectives = "", 0, 0  # comm.py's collective issuing now

    def _done(self, op: str, tensors, then=None) -> _Done:
        call = Call(op, sum(t.numel() * t.element_size() for t in tensors), self._what,
                    time.perf_counter(), of=self._of)
        self.calls.append(call)
        if not self._what and torch._C._current_graph_task_id() != -1:  # DDP's, in backward:
            Variable._execution_engine.queue_callback(partial(_waited, call))  # waited at its end
        return _Done(tensors, call, then)

    # comm.py's observer (comm.set_observer): which collective the backend calls between are for
    def issued(self, entry) -> None:
        self._collectives += 1
        self._what, self._of = f"{entry.op} {entry.tag}".strip(), self._collectives

    def started(self, works) -> None:
        self._what, self._of = "", 0

    def waited(self, works, start: float, end: float) -> None:
        pass

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "mirror"

    @property
    def group_name(self) -> str:  # DeviceMesh (DTensor parameters) names groups
        return dist.distributed_c10d._world.pg_names[self]

    def _reduced(self, t: torch.Tensor, op) -> None:
        """N equal tensors reduced: a sum is N times one, a product its N-th power."""
        if op == dist.ReduceOp.SUM:
            t.mul_(self._world)
        elif op == dist.ReduceOp.PRODUCT:
            t.pow_(self._world)

    def allreduce(self, tensors, opts=None):
        for t in tensors:
            self._reduced(t, opts.reduceOp)
        return self._done("allreduce", tensors)

    def broadcast(self, tensors, opts=None):
        """From this rank: remembered. From another, into a slice of a buffer this rank also
        broadcast a slice of (comm's all-gather by broadcasts): that rank's row is this one's."""
        t = tensors[0]
        if opts.rootRank == self._rank:
            self._sent[t.untyped_storage()._cdata] = weakref.ref(t)
            return self._done("broadcast", tensors)

        def land() -> None:  # at wait: every rank's broadcast of the gather has been issued
            mine = self._sent.get(t.untyped_storage()._cdata, lambda: None)()
            if mine is not None and mine.untyped_storage()._cdata == t.untyped_storage()._cdata:
                t.copy_(mine)
        return self._done("broadcast", tensors, land)

    def allgather(self, outputs, inputs, opts=None):  # DDP's, when it is built
        for out in outputs[0]:
            out.copy_(inputs[0])
        return self._done("allgather", outputs[0])

    def send(self, tensors, dst, tag):
        return self._done("send", tensors)

    def recv(self, tensors, src, tag):
        for t in tensors:
            t.zero_()
        return self._done("recv", tensors)

    def barrier(self, opts=None):
        if self.together is not None:  # every rank's dry run at once: in step, as for real
            self._barriers += 1
            key = f"barrier {self._barriers}"
            if self.together.add(key, 1) == self._world:
                self.together.set(key + " all", "")
            self.together.wait([key + " all"])
        return self._done("barrier", [])


dist.Backend.register_backend("mirror", lambda store, rank, world, timeout: Mirror(rank, world),
                              devices=["cpu"])


@contextlib.contextmanager
def dry_run(world: int, rank: int = 0, together: dist.Store | None = None):
    """The default process group, inside: a :class:`Mirror` of ``world`` ranks, this process its
    ``rank``. Outside any process group only (the default group is one a process). ``together``:
    a store every rank's dry run shares (a fresh prefix of torchrun's): their barriers meet there,
    so the ranks' dry runs step together and share the cores as the real ranks will."""
    if dist.is_initialized():
        raise RuntimeError("dry_run: this process already has a process group; run the dry run "
                           "before init_process_group (python -m minishard.plan --check does)")
    if not 0 <= rank < world:
        raise ValueError(f"dry_run: rank {rank} is not one of {world} ranks")
    with comm.FLIGHT.kept_apart():  # a world that is not there: in no flight record, arms none
        dist.init_process_group("mirror", store=dist.HashStore(), rank=rank, world_size=world)
        mirror, worlds = dist.group.WORLD, dist.distributed_c10d._world.pg_map
        mirror.together = together
        worlds[mirror] = (Mirror.stands_for, worlds[mirror][1])  # what dist.get_backend answers
        debug = checks.DEBUG["on"]  # MINISHARD_DEBUG's check compares ranks: one agrees with itself
        comm.set_debug(False)
        comm.set_observer(mirror)
        try:
            yield mirror
        finally:
            comm.set_observer(None)
            comm.set_debug(debug)
            dist.destroy_process_group()
