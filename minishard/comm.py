"""The one door to ``torch.distributed`` collectives.

Every collective minishard issues goes through a function in this module. That buys three things:

1. One place to hide differences between torch versions and backends (the ``*_single`` names that
   torch 2.13 prefers over ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; averaging on a
   backend that only sums; on gloo, all_gather done as N broadcasts and reduce_scatter as a
   direct exchange, each faster in a training step there than gloo's own).
2. One place to *count* communication. Inside ``with ledger() as led:`` every collective this rank
   issues is recorded with the bytes it sends (costs.py: the ring cost model, the Ledger, and the
   alpha-beta model that ``all_reduce(..., algorithm="auto")`` uses to pick an algorithm).
3. One place a reader has to look to know when ranks talk to each other.
Each takes ``group`` (None: the default group), ``async_op`` (True: returns a :class:`Handle`)
and a ``tag`` saying what it is. What comm checks and records about each (the flight record,
stamps, timeouts, the debug check) is checks.py's: the collectives here stay one page."""
from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as dist

from minishard import checks, costs
from minishard.checks import (FLIGHT, STAMP_BYTES, SUM_STAMP_NUMEL, CollectiveError,
                              CollectiveMismatch, row_stamp, set_debug, set_timeout, stamp,
                              stamps_differ, sum_stamp)
from minishard.costs import (ALPHA, BETA, Entry, Ledger, all_reduce_algorithms, all_reduce_cost,
                             all_reduce_terms, group_dim, group_ranks, ledger, pick_all_reduce,
                             power_of_two, ring_bytes)

__all__ = ["Handle", "Ledger", "Entry", "ledger", "all_reduce", "all_gather", "reduce_scatter",
           "broadcast", "group_size", "group_rank", "ring_bytes", "all_reduce_terms",
           "all_reduce_cost", "all_reduce_algorithms", "pick_all_reduce", "set_debug",
           "CollectiveMismatch", "group_ranks", "group_dim", "ALPHA", "BETA", "FLIGHT",
           "set_observer", "FINISHED_KEPT_BY_BACKEND", "OPS", "STAMP_BYTES", "stamp",
           "SUM_STAMP_NUMEL", "sum_stamp", "row_stamp", "stamps_differ",
           "CollectiveError", "set_timeout"]

# The flat-tensor collectives: torch 2.13's names, else those of torch 2.5-2.12.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def record(op: str, tensor_numel: int, dtype: torch.dtype, n: int, tag: str,
           algorithm: str = "ring", group=None) -> checks.Flown:
    """Give the flight record and the open ledgers (costs.py) this collective's entry (params.py:
    DTensor's too); returns its place in the flight record."""
    flown = FLIGHT.issued(op, tensor_numel, dtype, group, tag)
    if costs.OPEN or _observer is not None:
        _to_ledgers(op, tensor_numel, dtype, n, tag, algorithm, group)
    return flown


def _to_ledgers(op: str, tensor_numel: int, dtype: torch.dtype, n: int, tag: str,
                algorithm: str, group) -> None:
    """The ledger's entry: the bytes this rank sends under the algorithm's cost model."""
    full_bytes = tensor_numel * torch.empty((), dtype=dtype).element_size()
    sent = (ring_bytes(op, full_bytes, n) if algorithm == "ring"
            else all_reduce_terms(algorithm, full_bytes, n)[1])
    entry = Entry(op, dtype, tensor_numel, n, sent, tag, algorithm,
                  ranks=group_ranks(group), dim=group_dim(group))
    for led in costs.OPEN:
        led.entries.append(entry)
    if _observer is not None:
        _observer.issued(entry)


_observer = None  # trace.py's recorder inside model.trace(), else None: one comparison each


def set_observer(observer) -> None:
    """(For trace.py.) ``observer.issued(entry)``, ``.started(works)`` and ``.waited(works,
    start, end)`` see every collective, its works and every wait; None removes it."""
    global _observer
    if observer is not None and _observer is not None:
        raise RuntimeError("comm: a trace is already being recorded; one at a time")
    _observer = observer


# gloo's worker threads (two a group) each keep their last collective's tensors until the next:
FINISHED_KEPT_BY_BACKEND = 2  # after ``wait()`` that many finished ones may live on (meters.py)


def _before(op: str, tensor: torch.Tensor, numel: int, group, n: int, tag: str,
            algorithm: str = "ring") -> checks.Flown:
    """Every collective passes here first: the flight record, the ledger, the debug check.
    A backend moves memory in STORAGE order (a transposed tensor would arrive scrambled,
    silently): every collective below hands it ``x.contiguous()`` and copies a result back."""
    assert tensor.is_contiguous(), f"comm.{op}: a strided tensor reached the backend"
    flown = record(op, numel, tensor.dtype, n, tag, algorithm, group)
    if checks.DEBUG["on"] and n > 1:
        checks.check_same_collective(op, tensor, group, n, tag)
    return flown


# ------------------------------------------------------------------------------------ groups
group_size, group_rank = dist.get_world_size, dist.get_rank  # (group=None: the default group)


# ------------------------------------------------------------------------------------ handles
class Handle:
    """What an async collective returns. ``wait()`` blocks until the result is in place, and
    raises :class:`CollectiveError` naming the collective (``flown``) if it never comes."""

    def __init__(self, work=None, then=(), flown: checks.Flown | None = None) -> None:
        self._works = work if isinstance(work, list) else [] if work is None else [work]
        self._then = [f for f in (then if isinstance(then, (list, tuple)) else [then]) if f]
        self.flown = flown

    waited = property(lambda self: not self._works and not self._then)  # result in place

    @torch.no_grad()  # collectives are not differentiable; some backends copy at wait time
    def wait(self) -> None:
        """Wait for every work (blocked time to the open ledgers), then each of ``then``."""
        if self._works:
            works, self._works, start = self._works, [], time.perf_counter()
            try:
                for work in works:
                    work.wait(timeout=checks.TIMEOUT["limit"])
            except RuntimeError as exc:
                raise checks.failed(self.flown, exc, time.perf_counter() - start) from exc
            end = time.perf_counter()
            for led in costs.OPEN:
                led.blocked_s += end - start
            if _observer is not None:
                _observer.waited(works, start, end)
        if self.flown is not None and self.flown.t1 is None:
            self.flown.t1 = time.perf_counter()
        then, self._then = self._then, []
        for step in then:
            step()


def _finish(work, async_op: bool, then=(), tensor=None, dense=None, flown=None):
    """Issued async; a synchronous caller waits here (the ledger's ``blocked_s`` sees it). A
    result in ``dense``, a contiguous copy of ``tensor``, is copied back after ``then``."""
    then = [f for f in (then if isinstance(then, (list, tuple)) else [then]) if f]
    if dense is not tensor:
        then.append(lambda: tensor.copy_(dense))
    handle = Handle(work, then, flown)
    if _observer is not None:
        _observer.started(handle._works)
    if async_op:
        return handle
    handle.wait()
    return None


# -------------------------------------------------------------------------------- collectives
@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, async_op: bool = False,
               tag: str = "", algorithm: str = "ring", stamped: bool = False):
    """In place: ``tensor`` becomes the ``op`` of every rank's (:data:`OPS`: "sum", "avg",
    "max", "min", "product"); any other op is refused before anything is sent. ``stamped``
    (avg, max or min): its last SUM_STAMP_NUMEL elements are comm's, for ``tag``'s stamp,
    checked before the result is used (checks.py; left out of the ledger).

    ``algorithm``: "ring" (the backend's own), "direct" (:func:`_all_reduce_by_exchange`),
    "doubling" or "auto" (the cheaper under the alpha-beta model, see the module doc). Every
    rank must pass the same ``algorithm``; "auto" decides from what every rank shares.
    """
    if algorithm not in ("ring", "direct", "doubling", "auto"):
        raise ValueError(f"all_reduce: algorithm must be 'ring', 'direct', 'doubling' or 'auto', "
                         f"got {algorithm!r}")
    n, (red, _) = dist.get_world_size(group), _op(op, "all_reduce", tensor)
    if algorithm == "auto":
        nbytes = tensor.numel() * tensor.element_size()
        algorithm = pick_all_reduce(nbytes, n, dist.get_backend(group) if n > 1 else "")
    if algorithm == "doubling" and not power_of_two(n):
        raise ValueError(f"all_reduce: 'doubling' needs a power-of-two group, this one has {n} "
                         "ranks; use 'direct', 'ring' or 'auto'")
    dense = tensor.contiguous()
    room = SUM_STAMP_NUMEL if stamped else 0
    if stamped:  # in the room the caller left: checks.py's [Note: stamps]
        dense.view(-1)[-room:] = sum_stamp(tag, dense.dtype, dense.device)
    flown = _before("all_reduce", dense, dense.numel() - room, group, n, tag, algorithm)
    if algorithm == "direct" and n > 1:
        work, then = _all_reduce_by_exchange(dense, op, group, n)
    elif algorithm == "doubling" and n > 1:
        work, then = _all_reduce_by_doubling(dense, op, group, n)
    else:
        work = dist.all_reduce(dense, op=red, group=group, async_op=True) if n > 1 else None
        then = (lambda: dense.div_(n)) if op == "avg" and n > 1 else None
    check = stamped and (lambda: checks.check_sum(dense.view(-1)[-room:], tag, group))
    return _finish(work, async_op, [then, check], tensor, dense, flown=flown)


# op -> (the backend's ReduceOp, how two ranks' values meet in comm's own algorithms); "avg"
# is a sum divided by N at the end, on every backend (older gloo builds have no AVG).
OPS = {"sum": (dist.ReduceOp.SUM, torch.add), "avg": (dist.ReduceOp.SUM, torch.add),
       "max": (dist.ReduceOp.MAX, torch.maximum), "min": (dist.ReduceOp.MIN, torch.minimum),
       "product": (dist.ReduceOp.PRODUCT, torch.mul)}


def _op(op: str, who: str, tensor: torch.Tensor):
    """The op's pair from OPS; refused (before anything is sent) if unknown, or "avg" of an
    integer tensor (a mean that cannot be stored in its dtype)."""
    if op not in OPS or (op == "avg" and not (tensor.is_floating_point() or tensor.is_complex())):
        raise ValueError(f"comm.{who}: op must be one of {sorted(OPS)} (avg of a floating "
                         f"tensor), got {op!r} for a {tensor.dtype} tensor")
    return OPS[op]


def _all_reduce_by_exchange(tensor, op, group, n):
    """One round: every rank sends its whole tensor to every other rank and receives theirs, then
    reduces the N tensors in RANK ORDER::

        rank r:  --tensor-->  every rank j != r          (N-1 sends of S bytes)
                 part[j] = rank j's tensor               (N-1 receives; part[r] = its own)
                 tensor  = ((part[0] + part[1]) + part[2]) + ...

    Every rank adds the same numbers in the same order, so every rank gets the same bits (a sum
    in each rank's own order would differ in the last bits from rank to rank). Costs (N-1)·S bytes
    sent and an (N-1)·S receive buffer: worth it only for small tensors (see the module doc)."""
    r, flat = dist.get_rank(group), tensor.view(-1)
    recv = torch.empty((n - 1, flat.numel()), dtype=tensor.dtype, device=tensor.device)
    parts = [flat if j == r else recv[j - (j > r)] for j in range(n)]  # rank order
    works = []
    for step in range(1, n):  # every rank sends to r+step while receiving from r-step
        to, frm = (r + step) % n, (r - step) % n
        works.append(dist.isend(flat, _global(group, to), group=group, tag=_ALL_REDUCE_TAG))
        works.append(dist.irecv(parts[frm], _global(group, frm), group=group, tag=_ALL_REDUCE_TAG))

    def total() -> None:  # runs after every send finished: the own tensor may change now
        # Accumulate in recv[0], which holds part[0] or part[1]: no buffer beyond recv.
        combine = OPS[op][1]
        acc = combine(parts[0], parts[1], out=recv[0])
        for part in parts[2:]:
            combine(acc, part, out=acc)
        if op == "avg":
            acc.div_(n)
        flat.copy_(acc)
    return works, total


def _all_reduce_by_doubling(tensor, op, group, n):
    """log2 N rounds (N a power of two). In round k rank r swaps its running total with rank
    r XOR 2^k and adds what it received::

        N = 4:   round 0  (0<->1) (2<->3)     t0 = t1 = a0+a1       t2 = t3 = a2+a3
                 round 1  (0<->2) (1<->3)     every t = (a0+a1) + (a2+a3)

    Every rank gets the same bits: IEEE x+y == y+x exactly (so are max, min, x*y), so partners
    that swap X and Y both hold X+Y. log2 N * S bytes in log2 N messages and rounds (the direct
    exchange: (N-1) * S in one); round 0 is in flight on return, the rest run in ``wait()``."""
    r, flat = dist.get_rank(group), tensor.view(-1)
    recv = torch.empty_like(flat)

    def swap(k: int) -> list:
        peer = _global(group, r ^ (1 << k))
        return [dist.isend(flat, peer, group=group, tag=_DOUBLING_TAG),
                dist.irecv(recv, peer, group=group, tag=_DOUBLING_TAG)]

    def add() -> None:  # runs after the round's send finished: flat may change now
        OPS[op][1](flat, recv, out=flat)

    def rest() -> None:
        add()
        for k in range(1, n.bit_length() - 1):
            Handle(swap(k)).wait()
            add()
        if op == "avg":
            flat.div_(n)
    return swap(0), rest


@torch.no_grad()
def all_gather(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False,
               tag: str = "", stamped: bool = False):
    """``output`` (N * shard.numel() elements): every rank's ``shard``, in rank order; each
    shard's last STAMP_BYTES // itemsize elements comm's if ``stamped`` (checks.py: stamps)."""
    n = dist.get_world_size(group)
    if output.numel() != n * shard.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"{n} ranks x {shard.numel()}")
    out, shard = output.contiguous(), shard.contiguous()
    room = STAMP_BYTES // shard.element_size() if stamped else 0
    if stamped:  # in the room the caller left: checks.py's [Note: stamps]
        shard.view(-1)[-room:] = row_stamp(tag, shard.dtype, shard.device)
    flown = _before("all_gather", out, out.numel() - n * room, group, n, tag)
    if n == 1:
        output.copy_(shard.view_as(output))
        return _finish(None, async_op, flown=flown)
    if dist.get_backend(group) == "gloo":
        work = _all_gather_by_broadcasts(out, shard, group, n)
    else:
        work = _all_gather_flat(out, shard, group=group, async_op=True)
    check = stamped and (lambda: checks.check_rows(out.view(n, -1)[:, -room:], group, tag))
    return _finish(work, async_op, [check], output, out, flown=flown)


# [Note: gloo's all-gather] N broadcasts, one per rank, each straight into that rank's slice:
#
#     rank r:  out[r] = shard;   broadcast(out[j], src=j)  for every j      (in place)
#
# The ring's (N-1)/N·S bytes per rank, with no staging copy. gloo runs a send on the calling
# thread, the one that computes, while a broadcast runs on gloo's worker thread: so in a
# training step broadcasts overlap the computation that a direct exchange would hold up (whole
# steps compared: bench/RESULTS.md).
def _all_gather_by_broadcasts(output, shard, group, n):
    """``output`` filled by N broadcasts ([Note: gloo's all-gather]); returns their works."""
    k, r, out = shard.numel(), dist.get_rank(group), output.view(-1)
    mine = out[r * k:(r + 1) * k]
    if mine.data_ptr() != shard.data_ptr():  # not already in place
        mine.copy_(shard.reshape(-1))
    ranks = range(n) if group is None else dist.get_process_group_ranks(group)  # global
    return [dist.broadcast(out[j * k:(j + 1) * k], src=ranks[j], group=group, async_op=True)
            for j in range(n)]


@torch.no_grad()
def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, op: str = "sum", group=None,
                   async_op: bool = False, tag: str = ""):
    """``shard`` becomes this rank's slice ``full[r*k:(r+1)*k]`` of the ``op`` (:data:`OPS`) of
    every rank's ``full``. On gloo its messages carry ``tag``'s CRC: a rank reducing something
    else never meets them (checks.py's [Note: stamps])."""
    n, (red, _) = dist.get_world_size(group), _op(op, "reduce_scatter", full)
    if full.numel() != n * shard.numel():
        raise ValueError(f"reduce_scatter: input has {full.numel()} elements, expected "
                         f"{n} ranks x {shard.numel()}")
    mine, full = shard.contiguous(), full.contiguous()
    flown = _before("reduce_scatter", full, full.numel(), group, n, tag)
    if n == 1:
        shard.copy_(full.view_as(shard))
        return _finish(None, async_op, flown=flown)
    if dist.get_backend(group) == "gloo":
        works, total = _reduce_scatter_by_exchange(mine, full, op, group, n, tag)
        return _finish(works, async_op, total, shard, mine, flown=flown)
    work = _reduce_scatter_flat(mine, full, op=red, group=group, async_op=True)
    then = (lambda: mine.div_(n)) if op == "avg" else None
    return _finish(work, async_op, then, shard, mine, flown=flown)


# [Note: gloo's reduce-scatter] A direct exchange, a third of gloo's own reduce_scatter's time
# (bench/RESULTS.md). Rank r sends chunk j of its ``full`` to rank j, receives chunk r of every
# other rank's, combines them in order:
#
#     rank r:  full = [c0 | c1 | ... | c(N-1)]    --c_j-->  rank j       (N-1 sends)
#              part[j] = rank j's c_r             <------   rank j       (N-1 receives)
#              shard   = part[0] + ... + part[N-1]          (part[r] = its own c_r)
#
# The same (N-1)/N * S bytes per rank as the ring, and a (N-1)/N * S receive buffer.
def _reduce_scatter_by_exchange(shard, full, op, group, n, tag):
    """([Note: gloo's reduce-scatter]) The works of the exchange, and what combines the parts."""
    k, r = shard.numel(), dist.get_rank(group)
    said = _EXCHANGE_TAG << 24 | zlib.crc32(tag.encode()) & 0xFFFFFF  # checks.py: stamps
    chunks = full.reshape(n, k)
    ranks = range(n) if group is None else dist.get_process_group_ranks(group)  # global
    recv = torch.empty((n - 1, k), dtype=full.dtype, device=full.device)
    parts = [chunks[j] if j == r else recv[j - (j > r)] for j in range(n)]  # rank order
    works = []
    for step in range(1, n):  # every rank sends to r+step while receiving from r-step
        to, frm = (r + step) % n, (r - step) % n
        works.append(dist.isend(chunks[to], ranks[to], group=group, tag=said))
        works.append(dist.irecv(parts[frm], ranks[frm], group=group, tag=said))

    def total() -> None:
        out = shard.view(k)
        in_place = out.data_ptr() == parts[r].data_ptr()  # shard IS full's own chunk
        combine = OPS[op][1]
        acc = combine(parts[0], parts[1], out=None if in_place else out)
        for part in parts[2:]:
            combine(acc, part, out=acc)
        if op == "avg":
            acc.div_(n)
        if in_place:
            out.copy_(acc)
    return works, total


# Messages match on (peer, tag): the exchange's carry its byte over 24 bits of a stamp's CRC.
_EXCHANGE_TAG, _ALL_REDUCE_TAG, _DOUBLING_TAG = 0x6D, 0x6D74, 0x6D76  # never a user's (0)
_P2P_TAG = 0x7032  # "p2": send_recv's, apart from the exchanges' messages and users' tag 0


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False,
              tag: str = ""):
    """In place: every rank's ``tensor`` becomes the one held by group rank ``src``."""
    n = dist.get_world_size(group)
    dense = tensor.contiguous()
    flown = _before("broadcast", dense, dense.numel(), group, n, tag)
    if n == 1:
        return _finish(None, async_op, flown=flown)
    work = dist.broadcast(dense, src=_global(group, src), group=group, async_op=True)
    return _finish(work, async_op, None, tensor, dense, flown=flown)


# ------------------------------------------------------------------------------ point to point
@torch.no_grad()
def send_recv(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group=None) -> None:
    """Send ``send`` to group rank ``dst`` WHILE receiving ``recv`` (in place) from group rank
    ``src``; returns when both are done. Both at once, because in a ring where every rank first
    sends (blocking) and then receives, every rank can wait for a receiver that is itself still
    sending. Point-to-point, not a collective: the ledger does not record it (the exercises in
    minishard/course/exercise.py count its bytes themselves)."""
    if not recv.is_contiguous():
        raise ValueError("send_recv: recv must be contiguous (it is received in place)")
    works = [dist.isend(send.contiguous(), _global(group, dst), group=group, tag=_P2P_TAG),
             dist.irecv(recv, _global(group, src), group=group, tag=_P2P_TAG)]
    for work in works:
        work.wait()
