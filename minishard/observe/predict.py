"""What a step will hold, allocate and take, predicted without the ranks it will run on.

Two predictions, for two questions:

  the plan (a bound)   plan_buffers / predict_memory: from any module (the meta device too), no
                       process group, no memory: the flat buffers ZeRO would build, by the
                       engine's own rules (zero/build.py's ``owned_params``, ``flat_groups``,
                       ``flat_mode_of``; ``flat.Layout``'s cut), what a rank holds at rest, and
                       the step formula ``zero.meters.transients`` (the engine's own
                       ``step_transients()`` calls it): each buffer at its largest, an upper bound
  the dry run (the     predict(build, system, world, rank): the engine's real step, run in this
  peak, and a time)    process as rank ``rank`` of ``world`` (observe/dry_run.py), measured by
                       ``Allocations``: the same code and order as the real run, so the peak is
                       the real one (tests/test_predict.py: within 5% on every rank, drawn
                       configurations); its time, with comm's alpha-beta prices, predicts the
                       step's (:func:`step_time`)

    run = predict(mlp, 3, world=4, rank=0, units=MLP_UNITS, timed=10)
    run.peak, run.at_peak, run.median_s      # bytes, what was alive then, seconds

``python -m minishard.plan --check [--model gpt]`` (under torchrun) puts both beside a run here,
for DDP and stages 0-3 (:func:`check`). How close: bench/RESULTS.md, "The planner beside a run".
A dry run spends this rank's memory and one process's time: for a model bigger than this
machine, the plan's bound and plan.py's formulas are what there is.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from minishard import comm
from minishard.observe.allocations import Allocations
from minishard.observe.dry_run import dry_run
from minishard.zero.build import flat_groups, flat_mode_of, owned_params, replicated_predicate
from minishard.zero.config import MixedPrecision
from minishard.zero.engine import STAGES, ZeRO
from minishard.zero.flat import FlatMode, Layout
from minishard.zero.meters import transients

__all__ = ["PlannedBuffer", "plan_buffers", "predict_memory", "OPTIMIZER_STATE", "Run", "train",
           "train_all", "predict", "step_time", "price", "predictions", "check", "SYSTEMS", "mlp", "MLP_UNITS",
           "gpt", "GPT_UNITS", "MODELS"]

# Elements of optimizer state a master element keeps (torch's optimizers, after their first step).
OPTIMIZER_STATE = {"adam": 2, "adamw": 2, "sgd": 1, "sgd-nomomentum": 0}


class PlannedBuffer(Layout):
    """A flat buffer as the engine would build it: its cut, mode and dtypes, no storage."""

    def __init__(self, shapes, chunks: int, chunk: int, mode: FlatMode, dtype: torch.dtype,
                 compute: torch.dtype | None, requires_grad: bool) -> None:
        super().__init__(shapes, chunks, chunk)
        self.mode, self.dtype, self.requires_grad = mode, dtype, requires_grad
        self.param_dtype = compute or dtype
        self.tail = comm.SUM_STAMP_NUMEL if mode is FlatMode.REPLICATED else 0
        self.full_bytes = (self.padded_numel + self.tail) * self.param_dtype.itemsize

    def held_bytes(self, reshard: bool) -> int:
        """What it holds at rest: full (unless freed after each use) and an owned shard."""
        shard = {FlatMode.OWN: self.shard_numel,
                 FlatMode.REPLICATED: self.padded_numel + self.tail if self.param_dtype !=
                 self.dtype else 0, FlatMode.VIEW: 0}[self.mode] * self.dtype.itemsize
        return shard + (0 if reshard and self.mode is FlatMode.OWN else self.full_bytes)


def plan_buffers(module: nn.Module, stage: int, world: int, rank: int = 0, units=None,
                 mixed_precision: MixedPrecision | None = None, replicate=None,
                 persist_below: int = 0) -> list[tuple[bool, list[PlannedBuffer]]]:
    """[(is it the root unit, its buffers)] in the engine's order, for ``ZeRO(module, stage,
    units=..., ...)`` on ``world`` ranks (one shard group), seen from ``rank``."""
    policy, mp = STAGES[stage], mixed_precision or MixedPrecision()
    owned, places = owned_params(module, units)
    is_replicated = replicated_predicate(replicate, persist_below)
    out = []
    for name, params in owned:
        buffers = []
        for (dtype, rg, _, _, compute, replicated), ps in flat_groups(
                params, places, policy.flat_mode, mp.param_dtype, lambda p: 0,
                is_replicated).items():
            mode = flat_mode_of(policy.flat_mode, dtype, compute, replicated)
            chunks = 1 if mode is FlatMode.REPLICATED else world
            buffers.append(PlannedBuffer([p.shape for p in ps], chunks, rank % chunks, mode,
                                         dtype, compute, rg))
        out.append((name == "", buffers))
    return out


def predict_memory(module: nn.Module, stage: int, world: int, rank: int = 0, units=None,
                   optimizer: str = "adam", mixed_precision: MixedPrecision | None = None,
                   prefetch: bool = False, bucket_bytes: int = 0, replicate=None,
                   persist_below: int = 0, find_unused: bool = False) -> dict[str, int]:
    """Bytes rank ``rank`` holds at rest (parameters, optimizer state) and the buffers a training
    step allocates on top of them, by name (activations are the module's: not counted)."""
    policy, mp = STAGES[stage], mixed_precision or MixedPrecision()
    plan = plan_buffers(module, stage, world, rank, units, mp, replicate, persist_below)
    buffers = [b for _, bs in plan for b in bs]
    state = OPTIMIZER_STATE[optimizer]
    parts = {"parameters": sum(b.held_bytes(policy.reshard_after_forward) for b in buffers),
             "optimizer state": sum(state * b.dtype.itemsize * _real(b) for b in buffers
                                    if b.requires_grad)}
    return parts | transients(plan, policy, world=world, prefetch=prefetch,
                              bucket_bytes=bucket_bytes, reduce_dtype=mp.reduce_dtype,
                              find_unused=find_unused)


def _real(b: PlannedBuffer) -> int:
    """Elements of this rank's rows that carry optimizer state (a 0-dim parameter's is 0-dim:
    memory_report leaves it out, as the step counter)."""
    return sum((hi - lo) * m for (lo, hi), m, shape in zip(b.row_ranges, b.row_numels, b.shapes)
               if len(shape))


class _Block(nn.Module):  # bench/zero_vs_stock.py's MLP block
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return nn.functional.gelu(self.linear(x))


def mlp(width: int = 512, blocks: int = 8, batch: int = 32):
    """bench/'s MLP: ``blocks`` Linear(width, width) + GELU, and a batch of ``batch`` rows."""
    return nn.Sequential(*[_Block(width) for _ in range(blocks)]), torch.randn(batch, width)


MLP_UNITS = {_Block}  # its ZeRO units


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), _Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, a head tied to the embedding."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def gpt(vocab: int = 512, seq: int = 64, d: int = 128, layers: int = 4, batch: int = 4):
    """A small GPT (4 heads) and a batch of ``batch`` sequences of ``seq`` tokens."""
    return _GPT(vocab, seq, d, 4, layers), torch.randint(0, vocab, (batch, seq))


GPT_UNITS = {_GPTBlock}
MODELS = {"mlp": (mlp, MLP_UNITS), "gpt": (gpt, GPT_UNITS)}  # --check --model's


@dataclasses.dataclass
class Run:
    """A few training steps of one system on this rank: the peak allocated bytes (the states
    held included), what was alive then (Allocations' records), each timed step's seconds."""
    peak: int
    at_peak: list
    step_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    def parts(self) -> dict[str, int]:
        """What was alive at the peak, by where it was made (``file:function``), largest first:
        the engine's buffers by its functions, the module's activations by its ``forward``s,
        gradients by ``backpropagate``, the optimizer's state by ``update``."""
        parts = collections.Counter()
        for allocation in self.at_peak:
            parts[allocation.site] += allocation.nbytes
        return dict(parts.most_common())


def train(build, system, steps: int = 2, timed: int = 0, optimizer=None, **zero) -> Run:
    """On the current process group: ``build()`` -> (module, batch) under a fixed seed, wrapped
    as ``system`` ("ddp": torch's DistributedDataParallel; 0-3: ``ZeRO(stage=...)`` with
    ``zero``'s arguments), trained one warm-up step and ``steps`` steps counted by
    ``Allocations`` (from before the module is built), then ``timed`` steps under a clock.
    ``optimizer(params)``: torch.optim.Adam by default (lr 1e-4). The loss: the output's mean
    square."""
    return train_all(build, [system], steps, timed, optimizer, **zero)[0]


def train_all(build, systems, steps: int = 2, timed: int = 0, optimizer=None,
              **zero) -> list[Run]:
    """:func:`train` for each of ``systems``, the peaks one system at a time, then the timed
    steps taken in turns (a step of each, ``timed`` times): this machine's drift moves every
    system's time alike, so their order is the systems', not the minute's."""
    runs, steps_of = [], []
    for system in systems:
        run, step = _trained(build, system, steps, optimizer, **zero)
        runs.append(run)
        steps_of.append(step)
    calls = getattr(dist.group.WORLD, "calls", None)  # a dry run's: predicted
    for _ in range(timed):
        for run, step in zip(runs, steps_of):
            dist.barrier()
            first, start = len(calls or ()), time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            run.step_s.append(seconds if calls is None else
                              step_time(calls[first:], seconds, dist.get_world_size()))
    return runs


def _trained(build, system, steps: int, optimizer, **zero):
    """(its Run, untimed yet; its step)."""
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-4))

    def backpropagate(loss) -> None:  # (three functions: Run.parts names what each made)
        loss.backward()

    def update() -> None:
        opt.step()
        opt.zero_grad()

    def step() -> None:
        backpropagate(model(batch).float().square().mean())
        update()
    with Allocations() as alloc:
        torch.manual_seed(0)
        module, batch = build()
        model = (nn.parallel.DistributedDataParallel(module) if system == "ddp"
                 else ZeRO(module, stage=system, **zero))
        opt = make(model.parameters())
        step()
        alloc.reset_peak()
        for _ in range(steps):
            step()
    return Run(alloc.peak, alloc.at_peak, []), step


def predict(build, system, world: int, rank: int = 0, **kwargs) -> Run:
    """:func:`train` in a dry run (observe/dry_run.py): rank ``rank`` of ``world``, alone; its
    step times are :func:`step_time`'s."""
    with dry_run(world, rank):
        return train(build, system, **kwargs)


def step_time(calls, seconds: float, world: int, cores: int | None = None) -> float:
    """A step's seconds on ``world`` ranks of this machine, from a dry run of it that took
    ``seconds`` and made the backend ``calls``: its computation, plus each call at comm's
    alpha-beta price (:func:`price`), times ``world / cores`` when the ranks outnumber the cores.

    Added, not overlapped: on a CPU the cores that compute also move every byte (gloo copies it
    to and from the sockets), so communication hidden behind computation slows that computation
    as much (bench/RESULTS.md, "The planner beside a run": the time a rank waits is about the
    communication's price, and its computation grows by about as much when waiting less)."""
    shared = max(1.0, world / (cores or len(os.sched_getaffinity(0))))
    return shared * (seconds + sum(price(c.op, c.nbytes, world) for c in calls))


def price(op: str, nbytes: int, world: int) -> float:
    """Seconds of one backend call under comm's alpha-beta model (costs.ALPHA, costs.BETA):
    messages x ALPHA + bytes this rank sends x BETA (a ring's, costs.py's table)."""
    n = world
    messages, sent = {"allreduce": (2 * (n - 1), 2 * (n - 1) * nbytes / n),
                      "allgather": (n - 1, (n - 1) * nbytes / n),
                      "broadcast": (1, (n - 1) * nbytes / n),
                      "send": (1, nbytes)}.get(op, (0, 0))
    return messages * comm.ALPHA + sent * comm.BETA


SYSTEMS = ("ddp", 0, 1, 2, 3)  # --check's: torch's DDP, then minishard's stages


def predictions(build, systems=SYSTEMS, timed: int = 20, **zero) -> list[Run]:
    """Under torchrun, BEFORE the process group (a process has one default group, and a dry run
    is one): this rank's dry run of every system (:func:`train_all`). Every rank predicts its own
    peak; rank 0 alone times its steps (N at once would time N processes sharing the cores),
    while the others wait in ``init_process_group``. Outside torchrun: [] (launch.session refuses)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(1)  # as launch.session sets for the run
    with dry_run(world, rank):
        return train_all(build, systems, timed=timed if rank == 0 else 0, **zero)


def name_of(system) -> str:
    return "DDP" if system == "ddp" else f"minishard stage {system}"


def check(predicted: list[Run], build=mlp, systems=SYSTEMS, timed: int = 20,
          **zero) -> list[str]:
    """Under a process group: each of ``systems`` trained here (:func:`train`, on ``build()``,
    bench/'s MLP by default) beside ``predicted``, this rank's :func:`predict` runs (made before
    the process group was: a dry run is a process's only one). A line a system: the peak
    allocated bytes on the rank where it is largest; and where ``predicted`` has step times
    (rank 0's: :func:`predictions`), a line: this rank's median step time."""
    lines = []
    for system, guess, run in zip(systems, predicted, train_all(build, systems, timed=timed,
                                                                 **zero)):
        peaks = torch.tensor([guess.peak, run.peak], dtype=torch.float64)
        comm.all_reduce(peaks, "max", tag="plan --check")
        name = name_of(system)
        lines.append(f"{name} peak_allocated predicted={peaks[0] / 2**20:.2f} "
                     f"measured={peaks[1] / 2**20:.2f}")
        if guess.step_s:
            lines.append(f"{name} step_time predicted={1e3 * guess.median_s:.2f} "
                         f"measured={1e3 * run.median_s:.2f}")
    return lines
