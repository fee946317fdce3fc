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
    timeline(run.dry_steps[0], world=4)      # that step in time: computing, each collective

``torchrun --nproc_per_node=N -m minishard.plan --check --model M`` puts both beside a run here,
for DDP and stages 0-3 (:func:`check`); ``--timeline SYSTEM`` prints every rank's step in time
(:func:`describe`); M is bench/'s ``mlp`` or ``gpt`` or yours (observe/models.py). How close:
bench/RESULTS.md, "The planner beside a run".
A dry run spends this rank's memory and one process's time: for a model bigger than this
machine, the plan's bound and plan.py's formulas are what there is.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from minishard import comm
from minishard.observe.allocations import Allocations
from minishard.observe.dry_run import dry_run
from minishard.observe.models import GPT_UNITS, MLP_UNITS, Model, gpt, mean_square, mlp
from minishard.zero.build import flat_groups, flat_mode_of, owned_params, replicated_predicate
from minishard.zero.config import MixedPrecision
from minishard.zero.engine import STAGES, ZeRO
from minishard.zero.flat import FlatMode, Layout
from minishard.zero.meters import transients

__all__ = ["PlannedBuffer", "plan_buffers", "predict_memory", "OPTIMIZER_STATE", "Run", "train",
           "train_all", "predict", "DryStep", "Span", "timeline", "step_time", "price",
           "predictions", "check", "timelines", "describe", "check_here", "print_timeline",
           "SYSTEMS", "mlp", "MLP_UNITS", "gpt", "GPT_UNITS", "Model"]

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


@dataclasses.dataclass
class Run:
    """A few training steps of one system on this rank: the peak allocated bytes (the states
    held included), what was alive then (Allocations' records), each timed step's seconds, and
    what stayed allocated after a step beyond what ``build()`` made besides the module (the
    batch): ``at_rest``, the parameters, the optimizer's state and what the system keeps."""
    peak: int
    at_peak: list
    step_s: list[float]
    dry_steps: list["DryStep"] = dataclasses.field(default_factory=list)  # a dry run's
    at_rest: int = 0

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


def train(build, system, steps: int = 2, timed: int = 0, optimizer=None, loss=None,
          **zero) -> Run:
    """On the current process group: ``build()`` -> (module, batch) under a fixed seed (a
    batch that is a tuple is ``module(*batch)``'s), wrapped as ``system`` ("ddp": torch's
    DistributedDataParallel; 0-3: ``ZeRO(stage=...)`` with ``zero``'s arguments), trained one
    warm-up step and ``steps`` steps counted by ``Allocations`` (from before the module is
    built), then ``timed`` steps under a clock. ``optimizer(params)``: torch.optim.Adam by
    default (lr 1e-4); ``loss(output)``: the output's mean square by default."""
    return train_all(build, [system], steps, timed, optimizer, loss, **zero)[0]


def train_all(build, systems, steps: int = 2, timed: int = 0, optimizer=None, loss=None,
              **zero) -> list[Run]:
    """:func:`train` for each of ``systems``, the peaks one system at a time, then the timed
    steps taken in turns (a step of each, ``timed`` times): this machine's drift moves every
    system's time alike, so their order is the systems', not the minute's."""
    runs, steps_of = [], []
    for system in systems:
        run, step = _trained(build, system, steps, optimizer, loss or mean_square, **zero)
        runs.append(run)
        steps_of.append(step)
    calls = getattr(dist.group.WORLD, "calls", None)  # a dry run's: predicted
    for _ in range(timed):
        for run, step in zip(runs, steps_of):
            dist.barrier()
            first, start = len(calls or ()), time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            if calls is None:
                run.step_s.append(seconds)
            else:
                run.dry_steps.append(DryStep(start, seconds, calls[first:],
                                             dist.group.WORLD.together is not None))
                run.step_s.append(step_time(run.dry_steps[-1], dist.get_world_size()))
    return runs


def _trained(build, system, steps: int, optimizer, loss, **zero):
    """(its Run, untimed yet; its step)."""
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-4))

    def backpropagate(loss) -> None:  # (three functions: Run.parts names what each made)
        loss.backward()

    def update() -> None:
        opt.step()
        opt.zero_grad()

    def step() -> None:
        backpropagate(loss(model(*batch) if isinstance(batch, tuple) else model(batch)))
        update()
    with Allocations() as alloc:
        torch.manual_seed(0)
        module, batch = build()
        data = alloc.now - sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                for t in (*module.parameters(), *module.buffers())}.values())
        model = (nn.parallel.DistributedDataParallel(module) if system == "ddp"
                 else ZeRO(module, stage=system, **zero))
        opt = make(model.parameters())
        step()
        alloc.reset_peak()
        for _ in range(steps):
            step()
    return Run(alloc.peak, alloc.at_peak, [], at_rest=alloc.now - data), step


def predict(build, system, world: int, rank: int = 0, together: dist.Store | None = None,
            **kwargs) -> Run:
    """:func:`train` in a dry run (observe/dry_run.py): rank ``rank`` of ``world`` (stepping
    with the others' dry runs ``together``, else alone); its step times are :func:`step_time`'s."""
    with dry_run(world, rank, together):
        return train(build, system, **kwargs)


@dataclasses.dataclass
class DryStep:
    """A timed step of a dry run: when it started (``perf_counter``), its seconds, the backend
    calls it made (observe/dry_run.py's ``Call``: when each was issued and waited), and whether
    it was timed together with every other rank's dry run (sharing the cores) or alone."""
    start: float
    seconds: float
    calls: list
    together: bool = False


@dataclasses.dataclass
class Span:
    """A stretch of one rank's predicted step: computing ("compute"), or one collective (its
    backend calls together: "all_gather blocks.3"; DDP's bucket "allreduce"); seconds from the
    step's start; ``exposed``: the seconds of it the rank spent waiting."""
    what: str
    start: float
    seconds: float
    exposed: float = 0.0


def timeline(step: DryStep, world: int, wire: bool = False,
             cores: int | None = None) -> list[Span]:
    """One rank's step on ``world`` ranks, from a dry run of it: the computation as the dry run
    timed it, each collective at :func:`price`, laid out by one of two rules:

    wire=False   this machine's: the cores that compute also move every byte (gloo copies it to
                 and from the sockets), so a collective stops the computation for its price, all
                 of it exposed (measured: bench/RESULTS.md, "The planner beside a run")
    wire=True    a link of its own (NCCL on a GPU): collectives run one after another from their
                 issue while the computation goes on; the rank waits where the engine waited in
                 the dry run, for what has not landed by then: that is the exposed part

    When the ranks outnumber the cores, they share them: the prices count ``world / cores``
    times, and so does the computation of a dry run timed alone (one timed ``together`` with
    the other ranks' shared them already). A call made outside comm.py in backward (DDP's
    buckets) is waited when backward ends, where DDP waits for it."""
    shared = max(1.0, world / (cores or len(os.sched_getaffinity(0))))
    alone = 1.0 if step.together else shared
    collectives, of = [], 0  # [what, issued, waited, price], from the step's start
    for call in step.calls:
        issued = call.issued - step.start  # (never waited: waited when the step ends)
        waited = max(issued, step.seconds if call.waited is None else call.waited - step.start)
        cost = shared * price(call.op, call.nbytes, world)
        if call.of and call.of == of:  # another backend call of comm.py's collective
            collectives[-1][2:] = max(collectives[-1][2], alone * waited), collectives[-1][3] + cost
        else:
            collectives.append([call.what or call.op, alone * issued, alone * waited, cost])
        of = call.of
    spans = (_on_own_wire if wire else _stopping)(collectives, alone * step.seconds)
    return sorted((s for s in spans if s.seconds > 0), key=lambda s: s.start)


def _stopping(collectives, seconds: float) -> list[Span]:
    """Each collective stops the computation for its price where it is issued."""
    spans, done, delay = [], 0.0, 0.0  # done: the dry run's seconds laid out; delay: added
    for what, issued, _, cost in collectives:
        spans += [Span("compute", done + delay, issued - done),
                  Span(what, issued + delay, cost, exposed=cost)]
        done, delay = issued, delay + cost
    return spans + [Span("compute", done + delay, seconds - done)]


def _on_own_wire(collectives, seconds: float) -> list[Span]:
    """Collectives one after another on the wire from their issue; the computation stops only
    where it waits for one that has not landed, and what is on the wire meanwhile is exposed."""
    spans, done, delay, free, on_wire = [], 0.0, 0.0, 0.0, {}
    events = sorted([(c[1], 0, i) for i, c in enumerate(collectives)] +
                    [(c[2], 1, i) for i, c in enumerate(collectives)])  # issues first at a tie
    for at, is_wait, i in events:
        what, _, _, cost = collectives[i]
        if not is_wait:
            on_wire[i] = Span(what, max(free, at + delay), cost)
            free = on_wire[i].start + cost
            spans.append(on_wire[i])
            continue
        landed, now = on_wire[i].start + cost, at + delay
        if landed > now:  # blocked until then
            spans.append(Span("compute", done + delay, at - done))
            for s in on_wire.values():
                s.exposed += max(0.0, min(landed, s.start + s.seconds) - max(now, s.start))
            done, delay = at, delay + landed - now
    return spans + [Span("compute", done + delay, seconds - done)]


def step_time(step: DryStep, world: int, wire: bool = False, cores: int | None = None) -> float:
    """A step's seconds on ``world`` ranks: where its :func:`timeline` ends."""
    return max(s.start + s.seconds for s in timeline(step, world, wire, cores))


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
    is one): this rank's dry run of every system (:func:`train_all`), its own peak. The ranks
    time their dry runs together, stepping in turn through torchrun's store, so they share the
    cores as the real ranks will; without torchrun's store (its agent's), rank 0 times alone.
    Outside torchrun: [] (launch.session refuses)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(1)  # as launch.session sets for the run
    together = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        together = dist.PrefixStore(f"minishard dry runs {next(_predicted)}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
    with dry_run(world, rank, together):
        return train_all(build, systems, timed=timed if together or rank == 0 else 0, **zero)


_predicted = itertools.count()  # predictions() calls in this process: a fresh prefix each


def name_of(system) -> str:
    return "DDP" if system == "ddp" else f"minishard stage {system}"


def check(predicted: list[Run], build=mlp, systems=SYSTEMS, timed: int = 20,
          **zero) -> list[str]:
    """Under a process group: each of ``systems`` trained here (:func:`train`, on ``build()``,
    bench/'s MLP by default) beside ``predicted``, this rank's :func:`predict` runs (made before
    the process group was: a dry run is a process's only one). A line a system: the peak
    allocated bytes on the rank where it is largest; and where ``predicted`` has step times
    (:func:`predictions`: every rank's, or rank 0's alone), a line: this rank's median step
    time."""
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


def timelines(build, world: int, systems=SYSTEMS, timed: int = 10, **zero) -> list[list[Run]]:
    """Every rank's dry run of each system, one rank after another in this process (no torchrun,
    no process group): [rank][system] -> its Run, with ``timed`` dry steps."""
    runs, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as launch.session sets for a rank
    try:
        for rank in range(world):
            with dry_run(world, rank):
                runs.append(train_all(build, systems, timed=timed, **zero))
    finally:
        torch.set_num_threads(threads)
    return runs


def describe(runs: list[list[Run]], systems=SYSTEMS, shown=3, wire: bool = False) -> list[str]:
    """``python -m minishard.plan --timeline``'s report of :func:`timelines`: a table, each system
    at its slowest rank's median step, by both rules; then ``shown``'s timeline on every rank."""
    world = len(runs)

    def median(run: Run) -> DryStep:
        return sorted(run.dry_steps, key=lambda s: step_time(s, world))[len(run.dry_steps) // 2]

    def sums(step: DryStep, on_wire: bool) -> tuple[float, float, float, float]:
        spans = timeline(step, world, on_wire)
        talk = [s for s in spans if s.what != "compute"]
        return (sum(s.seconds for s in spans if s.what == "compute"),
                sum(s.seconds for s in talk), sum(s.exposed for s in talk),
                max(s.start + s.seconds for s in spans))
    lines = [f"Predicted on {world} ranks (dry runs here, ms; each system's slowest rank, its "
             "median step):",
             f"{'':18}{'compute':>9}{'comm':>9}{'step':>9}  | a link of its own:"
             f"{'exposed':>9}{'step':>9}"]
    for i, system in enumerate(systems):
        slowest = max((median(rank[i]) for rank in runs), key=lambda s: step_time(s, world))
        compute, talk, _, step = sums(slowest, False)
        _, _, exposed, own = sums(slowest, True)
        lines.append(f"{name_of(system):18}{1e3 * compute:9.2f}{1e3 * talk:9.2f}{1e3 * step:9.2f}"
                     f"  | {'':17}{1e3 * exposed:9.2f}{1e3 * own:9.2f}")
    rule = ("a link of its own: collectives run beside the computation, which waits where the "
            "engine waits" if wire else "this machine's: each collective stops the computation")
    for rank, by_system in enumerate(runs):
        lines += ["", f"{name_of(shown)}, rank {rank} of {world}, its median step ({rule}):",
                  f"{'start ms':>10}{'ms':>9}{'exposed':>9}  what"]
        for s in timeline(median(by_system[list(systems).index(shown)]), world, wire):
            exposed = f"{1e3 * s.exposed:9.2f}" if s.what != "compute" else " " * 9
            lines.append(f"{1e3 * s.start:10.2f}{1e3 * s.seconds:9.2f}{exposed}  {s.what}")
    return lines


def check_here(model: Model, timed: int = 20) -> None:
    """``python -m minishard.plan --check --model MODEL`` (under torchrun): :func:`check`."""
    from minishard.launch import session
    made = model.check(runs=True)
    zero = {"units": made["units"], "loss": made["loss"]}
    predicted = predictions(model, timed=timed, **zero)  # dry runs: before the process group
    with session() as (rank, _):
        lines = check(predicted, model, timed=timed, **zero)
        if rank == 0:
            print("\n".join(lines))


def print_timeline(model: Model, world: int, shown: str, wire: bool, timed: int = 10) -> None:
    """``python -m minishard.plan --timeline SYSTEM``: :func:`describe`."""
    made = model.check(runs=True)
    runs = timelines(model, world, timed=timed, units=made["units"], loss=made["loss"])
    print("\n".join(describe(runs, shown=shown if shown == "ddp" else int(shown), wire=wire)))
