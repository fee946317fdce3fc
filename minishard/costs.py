"""What a collective costs: the bytes it sends (the ring cost model, recorded by the Ledger) and
the time it takes (the alpha-beta model behind ``comm.all_reduce(..., algorithm="auto")``).

comm.py does the collectives; this module only counts them, and imports nothing of ours. Inside
``with ledger() as led:`` every collective this rank issues through comm is recorded with its op,
dtype, element count, group size, the bytes this rank sends, and the group it ran on (its global
ranks, and the ``DeviceMesh`` dimension when the group is one). Tests assert those bytes exactly
against the ZeRO formulas, per group: hybrid sharding's inside-a-node and across-nodes traffic
apart.

Ring cost model (bytes *sent per rank*; ``S`` = bytes of the full tensor, ``N`` = group size)::

    all_reduce      2 (N-1)/N * S     reduce-scatter pass, then all-gather pass
    all_gather        (N-1)/N * S     S = bytes of the gathered (output) tensor
    reduce_scatter    (N-1)/N * S     S = bytes of the full (input) tensor
    broadcast         (N-1)/N * S     pipelined chain: N-1 of the N ranks forward S

Latency: the alpha-beta model (Hockney's; Thakur, Rabenseifner & Gropp 2005 for these algorithms)
prices an all_reduce by what one rank sends, time = messages * ALPHA + bytes * BETA::

                         messages    bytes sent per rank
    ring all_reduce      2(N-1)      2(N-1)/N * S
    direct exchange      N-1         (N-1) * S    (its whole tensor to every other rank)
    recursive doubling   log2 N      log2 N * S   (N a power of two; at N = 2 it IS the exchange)

``all_reduce(..., algorithm="auto")`` picks the cheapest with ALPHA and BETA measured on this
machine (below; small S: the fewest messages; MiBs: the ring, under 2S per rank whatever N); the
ledger records the algorithm that ran and the bytes it really sends. The default stays the ring:
ZeRO's per-step byte formulas are a contract; SyncBatchNorm's few statistics ask for "auto". Why
all_reduce = reduce_scatter + all_gather, where the ring starts to win: tutorial 01, parts 5-7.
"""
from __future__ import annotations

import contextlib
import dataclasses
from fractions import Fraction
from typing import Iterator

import torch
import torch.distributed as dist


def group_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group), in group order."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_dim(group=None) -> str:
    """The ``DeviceMesh`` dimension ``group`` was made for, or "". torch describes the groups it
    makes for a mesh as ``mesh_<dim name>``; a dimension spanning every rank reuses the default
    group, which has no dimension."""
    desc = getattr(group, "group_desc", "") if group is not None else ""
    return desc[len("mesh_"):] if desc.startswith("mesh_") else ""


# --------------------------------------------------------------------------------------- ledger
@dataclasses.dataclass(frozen=True)
class Entry:
    """One collective as seen by this rank."""
    op: str              # "all_reduce" | "all_gather" | "reduce_scatter" | "broadcast"
    dtype: torch.dtype
    numel: int           # elements of the FULL tensor (output of all_gather, input of reduce_scatter)
    group_size: int
    bytes_sent: Fraction  # what `algorithm` sends from this rank; a Fraction so sums stay exact
    tag: str = ""        # who asked: a SyncBN layer, a ZeRO unit, ...
    algorithm: str = "ring"  # what ran: "ring" (the cost model above), "direct" or "doubling"
    ranks: tuple[int, ...] = ()  # the group's GLOBAL ranks, in group order
    dim: str = ""        # the DeviceMesh dimension of that group ("shard", "replicate"), if any


_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}


def ring_bytes(op: str, full_bytes: int, group_size: int) -> Fraction:
    """Bytes one rank sends for ``op`` on a tensor of ``full_bytes`` bytes (see the module doc)."""
    return Fraction(_RING_FACTOR[op] * (group_size - 1) * full_bytes, group_size)


class Ledger:
    """The list of collectives issued on this rank inside a ``with ledger():`` block."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        # Seconds this rank sat blocked in wait() for collectives to finish: the communication
        # time NOT hidden behind computation (benchmarks report it; tests assert bytes only).
        self.blocked_s = 0.0

    def total_bytes(self, op: str | None = None, *, group=None, dim: str | None = None
                    ) -> Fraction:
        """Bytes sent, optionally only by ``op``, on one ``group`` (a process group, or its global
        ranks in any order) or on one mesh dimension ``dim``."""
        return sum((e.bytes_sent for e in self._select(op, group, dim)), Fraction(0))

    def count(self, op: str | None = None, *, group=None, dim: str | None = None) -> int:
        return sum(1 for _ in self._select(op, group, dim))

    def by_group(self) -> dict[tuple[str, tuple[int, ...]], Fraction]:
        """Bytes sent per group: ``{(dim, ranks): bytes}``, in order of first use."""
        out: dict[tuple[str, tuple[int, ...]], Fraction] = {}
        for e in self.entries:
            out[(e.dim, e.ranks)] = out.get((e.dim, e.ranks), Fraction(0)) + e.bytes_sent
        return out

    def _select(self, op, group, dim) -> Iterator[Entry]:
        ranks = None
        if group is not None:
            ranks = frozenset(group) if isinstance(group, (list, tuple, set, frozenset, range)) \
                else frozenset(group_ranks(group))
        for e in self.entries:
            if ((op is None or e.op == op) and (dim is None or e.dim == dim)
                    and (ranks is None or frozenset(e.ranks) == ranks)):
                yield e

    def numel(self, op: str | None = None) -> int:
        return sum(e.numel for e in self.entries if op is None or e.op == op)

    def table(self) -> str:
        """A readable summary: one row per (op, dtype, group size, tag), with counts and bytes."""
        rows: dict[tuple, list] = {}
        for e in self.entries:
            op = e.op if e.algorithm == "ring" else f"{e.op}:{e.algorithm}"
            key = (op, str(e.dtype).replace("torch.", ""), e.group_size, e.tag)
            row = rows.setdefault(key, [0, 0, Fraction(0)])
            row[0] += 1
            row[1] += e.numel
            row[2] += e.bytes_sent
        head = f"{'op':<18}{'dtype':<10}{'N':>3}  {'calls':>6}{'elements':>12}{'bytes sent':>14}  tag"
        lines = [head, "-" * len(head)]
        for (op, dt, n, tag), (calls, numel, sent) in rows.items():
            lines.append(f"{op:<18}{dt:<10}{n:>3}  {calls:>6}{numel:>12}{float(sent):>14.0f}  {tag}")
        lines.append(f"{'total':<31}  {len(self.entries):>6}{'':>12}{float(self.total_bytes()):>14.0f}")
        return "\n".join(lines)


OPEN: list[Ledger] = []  # the ledgers of the open ``with ledger()`` blocks: comm adds to each


@contextlib.contextmanager
def ledger() -> Iterator[Ledger]:
    """Record every collective this rank issues inside the block. Ledgers nest. The outermost
    also opens each of :data:`WATCHERS` (zero/params.py: the collectives torch runs on DTensors)."""
    led = Ledger()
    with contextlib.ExitStack() as stack:
        for watcher in WATCHERS if not OPEN else ():
            stack.enter_context(watcher())
        OPEN.append(led)
        try:
            yield led
        finally:
            OPEN.remove(led)


def all_reduce_terms(algorithm: str, full_bytes: int, group_size: int) -> tuple[int, Fraction]:
    """``(messages sent, bytes sent)`` by one rank in an all_reduce of ``full_bytes`` bytes by
    ``algorithm`` (the table in the module doc)."""
    n = group_size
    if n == 1:
        return 0, Fraction(0)
    if algorithm == "direct":
        return n - 1, Fraction((n - 1) * full_bytes)
    if algorithm == "doubling":
        steps = n.bit_length() - 1
        return steps, Fraction(steps * full_bytes)
    return 2 * (n - 1), ring_bytes("all_reduce", full_bytes, n)


WATCHERS: list = []  # context managers that record collectives comm does not issue


# -------------------------------------------------------------------- the alpha-beta model
# Measured on this machine (2-core CI kind, gloo over loopback, one thread per rank) by
#     python bench/alpha_beta.py
# which times the all_reduce algorithms at 2 and 4 ranks over 8 B - 4 MiB and fits
# time = c + messages * ALPHA + bytes sent * BETA by least squares (c, the per-call overhead, is
# the same for every algorithm and cancels in the choice). See bench/RESULTS.md.
ALPHA = 360e-6        # seconds per message (ranks sharing 2 busy cores: mostly scheduling)
BETA = 1.3e-9         # seconds per byte sent by one rank (0.72 GiB/s)


def all_reduce_cost(algorithm: str, full_bytes: int, group_size: int) -> float:
    """Seconds the alpha-beta model predicts for an all_reduce of ``full_bytes`` bytes."""
    messages, sent = all_reduce_terms(algorithm, full_bytes, group_size)
    return messages * ALPHA + float(sent) * BETA


def all_reduce_algorithms(group_size: int) -> list[str]:
    """The algorithms that can run on ``group_size`` ranks (doubling pairs ranks up: it needs a
    power of two, and at 2 ranks it is the direct exchange)."""
    n = group_size
    return ["direct", "ring"] + (["doubling"] if n > 2 and power_of_two(n) else [])


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def pick_all_reduce(full_bytes: int, group_size: int, backend: str) -> str:
    """The algorithm the model says is cheapest (ties: the first of ``all_reduce_algorithms``).
    Only on gloo: the constants were measured there (NCCL has its own low-latency
    algorithms)."""
    if backend != "gloo" or group_size < 2:
        return "ring"
    return min(all_reduce_algorithms(group_size),
               key=lambda a: all_reduce_cost(a, full_bytes, group_size))
