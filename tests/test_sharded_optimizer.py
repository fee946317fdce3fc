"""ShardedOptimizer (ZeRO-1 over parameters) against two independent, unmodified oracles:

  * the single-process optimizer: ``optimizer_class(groups, **defaults)`` over its own copy of the
    parameters, given the SAME gradients (every rank computes them from a seed: a plain model where
    every rank computes the same gradients). Nothing is reduced, so nothing but the order of
    operations inside the optimizer could differ: TIGHT tolerances, for AdamW too.
  * torch's ``ZeroRedundancyOptimizer`` over a third copy, same gradients: the same parameters
    after every step, the same partition (its ``_param_to_rank``), the same state bytes per rank.

Each example draws one huge parameter and many tiny ones, 1-3 param groups with their own
options, frozen parameters, parameters with no gradient in some steps, a group added after a
step, the world size (1-4) and the rank state is consolidated to. It checks, per step, the ledger
(broadcasts only, (N-1)/N x the trainable bytes, one per owner, or one per parameter when the
bucket cap is below every parameter), the balance bound (every rank <= Ψ/N + the largest
parameter), then the state-dict round trips both ways: consolidated -> a plain optimizer, and a
plain optimizer's -> a fresh ShardedOptimizer, each continuing identically.

Under DDP (ranks compute DIFFERENT per-rank gradients, averaged by DDP's all-reduce) it is
compared with DDP + ZeroRedundancyOptimizer (the same reduced gradients: tight) and with one
process on the global batch. There only the order of the reduction's additions differs: SGD keeps
that at rounding size, Adam divides by the square root of its second moment and turns rounding
noise on a near-zero gradient into up to lr per step, so AdamW gets ADAM_ATOL there, not tighter.
"""
from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

from minishard import ShardedOptimizer, ZeRO, comm, sharded_optimizer

TIGHT = dict(atol=1e-6, rtol=1e-5)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
              "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}
STEPS, MORE_STEPS = 3, 2


# ------------------------------------------------------------------------------ the setting
@st.composite
def settings_(draw):
    """Shapes (param 0 huge, the rest tiny), each one's group, the frozen ones, the ones without
    a gradient in step 0, the group added after step ``add_at``, options per group."""
    n_tiny = draw(st.integers(3, 24))
    shapes = [(draw(st.integers(40, 400)), 64)] + [
        draw(st.sampled_from([(k,), (2, k), (k, 1)])) for k in
        draw(st.lists(st.integers(1, 12), min_size=n_tiny, max_size=n_tiny))]
    n_groups = draw(st.integers(1, 3))
    group_of = [draw(st.integers(0, n_groups - 1)) for _ in shapes]
    frozen = draw(st.sets(st.integers(0, len(shapes) - 1), max_size=4))
    no_grad = draw(st.sets(st.integers(0, len(shapes) - 1), max_size=3))
    later = [(draw(st.integers(1, 200)),) for _ in range(draw(st.integers(0, 4)))]
    return dict(seed=draw(st.integers(0, 2**16)), shapes=shapes, group_of=group_of,
                frozen=frozen, no_grad=no_grad, later=later, add_at=draw(st.integers(0, STEPS - 1)),
                world=draw(st.integers(1, 4)), to=draw(st.integers(0, 3)),
                opt=draw(st.sampled_from(sorted(OPTIMIZERS))),
                tiny_buckets=draw(st.booleans()))


def make_params(shapes, seed: int, frozen=()) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g), requires_grad=i not in frozen)
            for i, s in enumerate(shapes)]


def make_groups(params, group_of) -> list[dict]:
    """Each group its own options: lr and weight decay."""
    return [{"params": [p for p, k in zip(params, group_of) if k == g],
             "lr": (1e-2, 5e-3, 2e-2)[g], "weight_decay": 0.01 * g}
            for g in sorted(set(group_of))]


def chained(opt) -> list[torch.Tensor]:
    """An optimizer's parameters in the order of its groups (the state dict's indices)."""
    return [p for g in opt.param_groups for p in g["params"]]


def build(kind: str, s: dict):
    """One side: its own copy of the parameters (same seed), its optimizer."""
    cls, kw = OPTIMIZERS[s["opt"]]
    params = make_params(s["shapes"], s["seed"], s["frozen"])
    groups = make_groups(params, s["group_of"])
    if kind == "plain":
        return params, cls(groups, **kw)
    if kind == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return params, ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kw)
    return params, ShardedOptimizer(groups, cls, **kw)


def set_grads(params, step: int, seed: int, skip=()) -> None:
    """The same gradients on every rank and every side: from (seed, step, index)."""
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(seed * 1000 + step * 100 + i)
        p.grad = (torch.randn(p.shape, generator=g) if p.requires_grad and i not in skip
                  else None)


def same(a, b, what: str, **tol) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x.detach(), y.detach(), **(tol or TIGHT),
                                   msg=lambda m: f"{what}, parameter {i}: {m}")


def state_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v))


def train_one_step(sides, s, step: int):
    """Every side steps on the same gradients; ours inside a ledger. Returns the ledger."""
    for kind, (params, opt) in sides.items():
        set_grads(params, step, s["seed"], s["no_grad"] if step == 0 else ())
        if kind == "ours":
            with comm.ledger() as led:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    if step == s["add_at"] and s["later"]:
        for params, opt in sides.values():
            extra = make_params(s["later"], s["seed"] + 1)
            opt.add_param_group({"params": extra, "lr": 3e-3})
            params.extend(extra)
    return led


# ------------------------------------------------------------------------- the rank function
def against_oracles(s: dict) -> int:
    n, rank = dist.get_world_size(), dist.get_rank()
    if s["tiny_buckets"]:  # a cap below every parameter: one broadcast per parameter
        sharded_optimizer.BUCKET_BYTES = 1
    try:
        sides = {kind: build(kind, s) for kind in ("plain", "torch", "ours")}
        for step in range(STEPS):
            led = train_one_step(sides, s, step)
            # the new group's parameters were added after this step's broadcasts
            added = len(s["later"]) if step == s["add_at"] else 0
            check_step(sides, led, s, n, f"step {step}", added)
        return check_state_dicts(sides, s, n, rank)
    finally:
        sharded_optimizer.BUCKET_BYTES = 4 * 2**20


def check_step(sides, led, s, n: int, where: str, added: int) -> None:
    (plain, _), (theirs, zro), (ours, opt) = sides["plain"], sides["torch"], sides["ours"]
    same(ours, plain, f"{where}: ShardedOptimizer vs one process")
    same(theirs, plain, f"{where}: ZeroRedundancyOptimizer vs one process")
    # the partition is torch's, parameter by parameter; so is the state each rank holds
    owners = [opt.owner[p] for p in ours]
    assert owners == [zro._param_to_rank[p] for p in theirs], where
    assert state_bytes(opt.state) == state_bytes(zro.optim.state), where
    assert all(opt.owner[p] == dist.get_rank() for p in opt.state), where
    loads = [sum(p.numel() for p, o in zip(ours, owners) if o == r) for r in range(n)]
    assert max(loads) <= sum(loads) / n + max(p.numel() for p in ours), (where, loads)
    # the ledger: broadcasts only, one pass over the trainable parameters (before add_param_group)
    trainable = [(p, o) for p, o in zip(ours[:len(ours) - added], owners) if p.requires_grad]
    sent = sum(p.numel() * p.element_size() for p, _ in trainable)
    assert led.total_bytes() == Fraction((n - 1) * sent, n), (where, led.table())
    assert {e.op for e in led.entries} <= {"broadcast"}, led.table()
    calls = len(trainable) if s["tiny_buckets"] else len({o for _, o in trainable})
    assert led.count() == (calls if n > 1 else 0), (where, calls, led.table())


def check_state_dicts(sides, s, n: int, rank: int) -> int:
    """Consolidated -> a plain optimizer (on ``to``), and a plain optimizer's -> a fresh
    ShardedOptimizer: each continues exactly as the one-process optimizer does."""
    cls, kw = OPTIMIZERS[s["opt"]]
    ref, opt = sides["plain"][1], sides["ours"][1]
    to = s["to"] % n
    opt.consolidate_state_dict(to=to)
    sides["torch"][1].consolidate_state_dict(to=to)
    reloaded = []
    if rank == to:
        sd, want = opt.state_dict(), ref.state_dict()
        assert sd["param_groups"] == want["param_groups"]
        assert sd["state"].keys() == want["state"].keys() == sides["torch"][1].state_dict()[
            "state"].keys()
        for k in sd["state"]:
            for name, value in want["state"][k].items():
                torch.testing.assert_close(sd["state"][k][name], value, **TIGHT)
        plain_again = cls(copied_groups(opt), **kw)
        plain_again.load_state_dict(sd)
        reloaded.append(plain_again)
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
    fresh = ShardedOptimizer(copied_groups(ref), cls, **kw)
    fresh.load_state_dict(copy.deepcopy(ref.state_dict()))  # a checkpoint, not live tensors
    reloaded.append(fresh)
    for step in range(STEPS, STEPS + MORE_STEPS):
        for o in [ref, opt] + reloaded:
            set_grads(chained(o), step, s["seed"])
            o.step()
            o.zero_grad()
        for o in [opt] + reloaded:
            same(chained(o), chained(ref), f"step {step} after the state-dict round trips")
    return len(reloaded)


def copied_groups(like: torch.optim.Optimizer) -> list[dict]:
    """Copies of ``like``'s parameters (current values), in its groups, with its options."""
    return [{k: v for k, v in g.items() if k != "params"}
            | {"params": [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                          for p in g["params"]]} for g in like.param_groups]


@given(s=settings_())
def test_matches_one_process_and_zero_redundancy_optimizer(pools, s):
    reloaded = pools(s["world"]).run(against_oracles, s)
    assert reloaded == [2 if r == s["to"] % s["world"] else 1 for r in range(s["world"])]


# ---------------------------------------------------------------- under DDP and stage 0
ADAM_ATOL = 1e-4  # lr 1e-3, 3 steps: rounding noise on a near-zero gradient, see the module doc


def net() -> nn.Module:
    torch.manual_seed(0)  # one big layer, small ones and their biases
    return nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 4), nn.Tanh(), nn.Linear(4, 3))


def under_ddp(opt_name: str) -> list[float]:
    """DDP + ShardedOptimizer vs DDP + ZeroRedundancyOptimizer (tight) and one process on the
    global batch; ZeRO(stage=0) + ShardedOptimizer vs ZeRO(stage=1) (the engine's ZeRO-1), with
    the ledger of one step: stage 0's all-reduce (2 passes) + the broadcasts (1 pass) = 3."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, rank = dist.get_world_size(), dist.get_rank()
    cls, kw = {"adamw": (torch.optim.AdamW, dict(lr=1e-3)),
               "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}[opt_name]
    ours, theirs, one = DDP(net()), DDP(net()), net()
    stage0, stage1 = ZeRO(net(), stage=0), ZeRO(net(), stage=1)
    opts = [ShardedOptimizer(ours.parameters(), cls, **kw),
            ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=cls, **kw),
            cls(one.parameters(), **kw), ShardedOptimizer(stage0.parameters(), cls, **kw),
            cls(stage1.parameters(), **kw)]
    psi = sum(p.numel() for p in one.parameters())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * n, 16, generator=g), torch.randn(4 * n, 3, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        for model, opt, rows in zip((ours, theirs, one, stage0, stage1), opts,
                                    (mine, mine, slice(None), mine, mine)):
            with comm.ledger() as led:
                (model(x[rows]) - y[rows]).square().mean().backward()
                opt.step()
            opt.zero_grad()
            if model is stage0:
                assert led.total_bytes() == Fraction(3 * (n - 1) * 4 * psi, n), led.table()
    tol = dict(atol=ADAM_ATOL, rtol=0) if opt_name == "adamw" else TIGHT
    same(ours.module.parameters(), theirs.module.parameters(), "DDP: ours vs torch's")
    same(ours.module.parameters(), one.parameters(), "DDP: ours vs one process", **tol)
    got, want = stage0.full_state_dict(), stage1.full_state_dict()
    same(got.values(), want.values(), "stage 0 + ShardedOptimizer vs stage 1", **tol)
    return [max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(),
                                                          one.parameters()))]


@pytest.mark.parametrize("world", [2, 3])
def test_under_ddp_and_stage0(pools, world):
    for opt_name in ("sgd", "adamw"):
        pools(world).run(under_ddp, opt_name)


# ---------------------------------------------------------------------------- refusals
def refusals() -> list[str]:
    """Each misuse refused with a message naming it, on every rank."""
    rank, said = dist.get_rank(), []
    p = nn.Parameter(torch.ones(3))
    cases = [(lambda: ShardedOptimizer([p], torch.optim.SGD(([p]), lr=1)), TypeError),
             (lambda: ShardedOptimizer([p], torch.optim.SGD, overlap_with_ddp=True, lr=1),
              ValueError),
             (lambda: ShardedOptimizer([p, p], torch.optim.SGD, lr=1), ValueError),
             (lambda: ShardedOptimizer([nn.Parameter(torch.full((3,), float(rank)))],
                                       torch.optim.SGD, lr=1), ValueError),     # values differ
             (lambda: ShardedOptimizer(ZeRO(net(), stage=1).parameters(), torch.optim.SGD,
                                       lr=1), ValueError),                      # shards
             (lambda: ShardedOptimizer([p], torch.optim.SGD, lr=1).state_dict(), RuntimeError)]
    for make, kind in cases:
        with pytest.raises(kind) as info:
            make()
        said.append(str(info.value))
    opt = ShardedOptimizer([p], torch.optim.SGD, lr=1)
    with pytest.raises(ValueError, match="same parameters, in the same groups"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1], "lr": 1}]})
    return said


def test_misuse_is_refused_on_every_rank(pools):
    expected = ["optimizer_class must be a torch.optim.Optimizer subclass",
                "overlap_with_ddp=True is not supported", "appears twice in one param group",
                "differs in its values between ranks", "it is already sharded",
                "call opt.consolidate_state_dict(to="]
    for rank, said in enumerate(pools(2).run(refusals)):
        assert len(said) == len(expected), said
        for message, phrase in zip(said, expected):
            assert phrase.lower() in message.lower(), (rank, message)
