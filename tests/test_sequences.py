"""Drawn sequences of what users do, against one process on the global batch.

A user's loop is more than train steps: micro-batches accumulated under ``no_sync`` (nanoGPT's
gradient accumulation), one discarded (``no_sync`` backward, then ``zero_grad``: "skip this
micro-batch"), evaluations with and without ``torch.no_grad()`` (the output of a grad-enabled one
dropped), ``gathered()``, full state round trips, a block frozen and thawed between steps,
learning-rate changes, clipping. Each is drawn into a sequence, at stages 0-3 and 1-4 ranks,
for-loop and foreach SGD with momentum built before or after wrapping; the oracle runs the same
sequence on the unwrapped model in one process (float64: the two agree to summation order).

After every event the model must be at rest as a user sees it (:func:`at_rest`): every unit
SHARDED, its state agreeing with what its memory holds and its module shows (:func:`agrees`),
the parameters leaves an optimizer can be built over; and during every step, at each event the
engine emits, each unit's state agrees with its memory and module.
"""
import copy

import pytest

import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st
from torch import nn

import minishard
from minishard.zero.engine import Phase
from minishard.zero.flat import FlatMode
from minishard.zero.guards import Released
from minishard.zero.unit import UnitState

D, BATCH = 5, 2  # features; rows per rank per micro-batch

EVENTS = ["step", "accumulate", "discard", "discard_in_place", "discard_by_module", "eval",
          "eval_with_grad", "gathered", "round_trip", "freeze", "thaw", "lr", "clip",
          "scale_grads"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Scale(nn.Module):
    """A 0-dim parameter (one row: replicated, its gradient averaged over every rank)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.9))

    def forward(self, x):
        return x * self.s


def build():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(D, 2), Scale()).double()


def batch(i: int, world: int) -> torch.Tensor:
    return torch.randn(BATCH * world, D, generator=torch.Generator().manual_seed(i),
                       dtype=torch.float64)


class Run:
    """One side of the comparison: the wrapped model on its ranks (``stage`` set), or the plain
    module in one process on the global batch (``stage`` None)."""

    def __init__(self, stage, world, foreach, before):
        self.stage, self.world = stage, world
        self.rank = dist.get_rank() if stage is not None else 0
        module = build()
        make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach)
        self.opt = make(module.parameters()) if before else None
        self.model = minishard.ZeRO(module, stage=stage, units={Block}) \
            if stage is not None else module
        self.opt = self.opt or make(self.model.parameters())
        self.module = self.model.module if stage is not None else self.model
        self.i = 0

    def loss(self, eval_: bool = False):
        self.i += 1
        x = batch(self.i, self.world)
        if self.stage is not None:
            x = x[self.rank * BATCH:(self.rank + 1) * BATCH]
        return self.model(x).square().mean()

    def no_sync(self):
        return self.model.no_sync() if self.stage is not None else _Nothing()

    def do(self, event: str) -> None:
        if event in ("step", "clip"):
            self.loss().backward()
            if event == "clip":
                torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 0.05)
            self.opt.step()
            self.opt.zero_grad()
        elif event == "accumulate":
            with self.no_sync():
                self.loss().backward()
        elif event.startswith("discard"):
            with self.no_sync():
                self.loss().backward()
            if event == "discard":
                self.opt.zero_grad()
            elif event == "discard_in_place":
                self.opt.zero_grad(set_to_none=False)
            else:
                self.model.zero_grad()
        elif event == "eval":
            with torch.no_grad():
                self.loss()
        elif event == "eval_with_grad":
            self.loss()  # no backward: its output is dropped
        elif event == "gathered" and self.stage is not None:
            with self.model.gathered():
                sum(p.sum() for p in self.model.parameters())
        elif event == "round_trip" and self.stage is not None:
            self.model.load_full_state_dict(self.model.full_state_dict())
            self.opt.load_state_dict(self.opt.state_dict())
        elif event in ("freeze", "thaw"):
            self.module[1].requires_grad_(event == "thaw")
        elif event == "scale_grads":  # between micro-batches: each .grad, whatever it shows
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
        elif event == "lr":
            for group in self.opt.param_groups:
                group["lr"] *= 0.5
        elif event not in ("gathered", "round_trip"):
            raise ValueError(event)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def agrees(unit, resting: bool = True) -> list[str]:
    """What is wrong between ``unit.state`` and what its module shows and its memory holds.
    During a step a gather may be filling ``full`` before the state changes (a prefetch, a
    bucket): only at rest (``resting``) must a SHARDED or RESHARDED unit's be freed."""
    wrong = []
    for flat in unit.flats:
        shown = [place.module._parameters[place.attr] for param in unit.params(flat)
                 for place in param.places]
        users = [param.user for param in unit.params(flat) for _ in param.places]
        freed = not (flat.mode is FlatMode.OWN and unit.reshard_after_forward
                     and flat.is_gathered) or not resting
        if unit.state is UnitState.SHARDED:
            ok = all(a is b for a, b in zip(shown, users)) and freed
        elif unit.state is UnitState.UNSHARDED:
            ok = flat.is_gathered and not any(a is b for a, b in zip(shown, users))
        else:  # RESHARDED
            ok = freed and (flat.mode is not FlatMode.OWN
                            or all(isinstance(a, Released) for a in shown))
        if not ok:
            wrong.append(f"{unit.name} is {unit.state.name}, but {flat.name} holds otherwise")
    return wrong


def at_rest(run: Run) -> list[str]:
    """What is wrong with the model between events, as the user and the engine see it: every
    unit SHARDED (its state agreeing with its memory and module), the phase one of rest's, the
    parameters leaves an optimizer takes."""
    wrong = [w for unit in run.model.units for w in agrees(unit)]
    wrong += [f"{unit.name} is {unit.state.name} between events" for unit in run.model.units
              if unit.state is not UnitState.SHARDED]
    if run.model.phase is Phase.BACKWARD:
        wrong.append("the engine is still in its backward phase")
    params = list(run.model.parameters())
    if not all(p.is_leaf for p in params):
        wrong.append("model.parameters() holds non-leaf tensors")
    try:
        torch.optim.SGD(params, lr=0.1)
    except ValueError as exc:
        wrong.append(f"an optimizer cannot be built: {exc}")
    return wrong


def play(stage, world, events, foreach, before):
    """The sequence on the wrapped model; returns (what was wrong at rest after each event, the
    final full state dict)."""
    run = Run(stage, world, foreach, before)
    wrong = []

    def listen(event, unit=None, *payload):  # inside every step, at each of its events
        wrong.extend(f"at {event}: {w}" for w in (agrees(unit, False) if unit else []))
    run.model.listeners.append(listen)
    for event in events:
        run.do(event)
        wrong += [f"after {event}: {w}" for w in at_rest(run)]
    run.do("step")  # the last micro-batches land in a step
    return wrong, run.model.full_state_dict()


def oracle(world, events, foreach, before):
    run = Run(None, world, foreach, before)
    for event in events + ["step"]:
        run.do(event)
    return run.model.state_dict()


@settings(max_examples=25)
@given(world=st.integers(1, 4), stage=st.integers(0, 3),
       events=st.lists(st.sampled_from(EVENTS), min_size=1, max_size=8),
       foreach=st.booleans(), before=st.booleans())
@example(world=2, stage=1, events=["eval_with_grad", "freeze", "step"], foreach=False,
         before=True)
@example(world=2, stage=0, events=["discard", "step"], foreach=False, before=False)
@example(world=3, stage=3, events=["discard_in_place", "accumulate", "step"], foreach=True,
         before=False)
@example(world=4, stage=2, events=["eval", "discard_by_module", "eval_with_grad", "round_trip"],
         foreach=False, before=True)
@example(world=4, stage=1, events=["accumulate", "discard_in_place"], foreach=False, before=False)
@example(world=2, stage=1, events=["eval", "freeze", "step"], foreach=True, before=False)
@example(world=4, stage=3, events=["accumulate", "scale_grads"], foreach=False, before=False)
def test_drawn_sequences_equal_one_process(pools, world, stage, events, foreach, before):
    want = oracle(world, events, foreach, before)
    for rank, (wrong, got) in enumerate(pools(world).run(play, stage, world, events, foreach,
                                                         before)):
        assert not wrong, (rank, wrong)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")


# ------------------------------------------- a discarded micro-batch under mixed precision
DISCARDS = {"zero_grad": lambda run: run.opt.zero_grad(),
            "zero_grad(set_to_none=False)": lambda run: run.opt.zero_grad(set_to_none=False),
            "model.zero_grad()": lambda run: run.model.zero_grad()}


def discard_in_bf16(stage: int, how: str) -> dict:
    """bf16 compute, bf16 reductions: a micro-batch under no_sync, discarded ``how``, then a
    step on the next, against FSDP2 with the same policy taking that step alone (at 2 ranks
    their arithmetic coincides bitwise: test_training's bf16 test). Here ``.grad`` cannot show
    the bf16 local gradient (unit.py: [Note: local gradients]): what it shows is discarded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rank, bf16 = dist.get_rank(), torch.bfloat16
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block(), Block(), nn.Linear(D, 2))
    model = minishard.ZeRO(copy.deepcopy(plain), stage=stage, units={Block},
                           mixed_precision=minishard.MixedPrecision(bf16, bf16))
    fsdp = copy.deepcopy(plain)
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in list(fsdp)[:3]:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    fully_shard(fsdp, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    x = [batch(i, 2)[2 * rank:2 * rank + 2].float() for i in (1, 2)]
    run = Run.__new__(Run)
    run.model, run.opt = model, torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(x[0]).square().mean().backward()
    DISCARDS[how](run)
    model(x[1]).square().mean().backward()
    run.opt.step()
    fsdp_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(x[1]).square().mean().backward()
    fsdp_opt.step()
    got = model.full_state_dict()
    return {n: (got[n] - p.full_tensor()).abs().max().item() for n, p in fsdp.named_parameters()}


@pytest.mark.parametrize("how", sorted(DISCARDS))
@pytest.mark.parametrize("stage", [0, 3])
def test_a_micro_batch_discarded_under_mixed_precision_is_gone(pools, stage, how):
    for errors in pools(2).run(discard_in_bf16, stage, how):
        assert max(errors.values()) == 0.0, errors


# ------------------------------------------------- what .grad shows between micro-batches
def local_grads(stage: int) -> float:
    """After a backward under no_sync each parameter's ``.grad`` is this rank's whole local
    gradient, as DDP's is (a DTensor Replicate()d at stages 1-3: each rank holds its own):
    the largest difference from DDP's on this rank, the same micro-batch, 0-dim one included."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, r = dist.get_world_size(), dist.get_rank()
    x = batch(1, n)[BATCH * r:BATCH * (r + 1)]
    model = minishard.ZeRO(build(), stage=stage, units={Block})
    ddp = DDP(build())
    for m in (model, ddp):
        with m.no_sync():
            m(x).square().mean().backward()
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ddp.named_parameters()):
        shown = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        worst = max(worst, (shown - q.grad).abs().max().item())
    return worst


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_grad_between_micro_batches_is_the_local_gradient_as_under_ddp(pools, stage):
    for world in (2, 4):  # 4: ranks with no rows of the small parameters
        assert max(pools(world).run(local_grads, stage)) == 0.0
