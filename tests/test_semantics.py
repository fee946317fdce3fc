"""ZeRO semantics that once gave silently wrong numbers (issue 12), each against an oracle.

The oracle is always the plain model and a plain torch optimizer trained in ONE process on the
global batch, unmodified: where a unit gets no gradient, its gradient stays None and the optimizer
leaves it alone, and the engine must do the same.

  * a unit no rank used (a branch skipped identically everywhere)       -> grad None, not moved
  * a unit used on SOME ranks only (find_unused_parameters=True)        -> the global gradient
  * freezing after wrapping through original names                      -> never trains
  * one module object under two names in different units                -> trains; both names
  * param groups by original names                                       -> AdamW with groups
  * gathered() under bf16 mixed precision                                -> masters bit-identical
  * keyword inputs under mixed precision                                 -> cast like positional
  * a stage-3 parameter read outside its unit                            -> a named error
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

from minishard import MixedPrecision, ZeRO

TOL = 2e-6  # fp32, a few steps: only the order of additions differs


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """a -> (b, skippable) -> c -> head. ``skip`` says which ranks skip ``b`` in this call."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(d), Block(d), Block(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x, skip_b: bool = False):
        x = self.a(x)
        if not skip_b:
            x = self.b(x)
        return self.head(self.c(x))


def _rows(n_rank: int, world: int) -> list[int]:
    """Uneven per-rank batch sizes (some rank may get none, not all), same on every rank."""
    rows = [(n_rank + 2 * r) % 5 for r in range(world)]
    return rows if sum(rows) else rows[:-1] + [1]


def _adamw(params):  # eps large enough that summation-order noise is not amplified to ±lr
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def _diff(model: ZeRO, oracle: nn.Module) -> float:
    got, want = model.full_state_dict(), oracle.state_dict()
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[k] - v).abs().max().item() for k, v in want.items())


def _step_both(oracle, ref_opt, model, opt, x, rows: int) -> None:
    """One step of the oracle on the global batch ``x`` and of the engine on this rank's rows
    (equal per-rank batches: the mean loss's gradient is the average of the ranks')."""
    r = dist.get_rank()
    for m, o, xs in ((oracle, ref_opt, x), (model, opt, x[rows * r:rows * r + rows])):
        o.zero_grad()
        m(xs).pow(2).mean().backward()
        o.step()


def _local_loss(out, rows_before, total):
    """This rank's share of the GLOBAL mean loss, times the world size: the engine averages the
    ranks' gradients, so sum_r (N * share_r) / N = the global-batch gradient."""
    return out.pow(2).sum() / total * dist.get_world_size()


def unused_units_keep_no_gradient(stage: int, n_rank: int, skips: list[bool], rank_dep: bool,
                                  opt_name: str) -> float:
    r, n = dist.get_rank(), dist.get_world_size()
    rows = _rows(n_rank, n)
    total, start = sum(rows), sum(rows[:r])
    torch.manual_seed(0)
    oracle = Net()
    model = ZeRO(copy.deepcopy(oracle), stage=stage, units={Block},
                 find_unused_parameters=rank_dep)
    make = {"adamw": _adamw,
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[opt_name]
    ref_opt, opt = make(oracle.parameters()), make(model.parameters())
    for step, skip in enumerate(skips):
        x = torch.randn(total, 5, generator=torch.Generator().manual_seed(step))
        # rank-dependent: rank j skips b when (skip and j is even); the oracle runs each rank's
        # rows through the branch that rank took (an empty piece too: a module run on no rows
        # still gets a zero gradient, in one process as on a rank).
        skip_of = [skip and (j % 2 == 0 or not rank_dep) for j in range(n)]
        ref_opt.zero_grad()
        pieces = torch.split(x, rows)
        sum((oracle(p, skip_b=s).pow(2).sum() for p, s in zip(pieces, skip_of)),
            torch.zeros(())).div(total).backward()
        ref_opt.step()
        opt.zero_grad()
        _local_loss(model(x[start:start + rows[r]], skip_b=skip_of[r]), start, total).backward()
        opt.step()
    return _diff(model, oracle)


@given(stage=st.sampled_from([0, 1, 2, 3]), ws=st.integers(1, 4), n_rank=st.integers(0, 4),
       skips=st.lists(st.booleans(), min_size=2, max_size=4), opt_name=st.sampled_from(
           ["adamw", "sgd"]))
def test_a_unit_no_rank_used_keeps_no_gradient(pools, stage, ws, n_rank, skips, opt_name):
    assert max(pools(ws).run(unused_units_keep_no_gradient, stage, n_rank, skips, False,
                             opt_name)) < TOL


@given(stage=st.sampled_from([0, 1, 2]), ws=st.integers(2, 4), n_rank=st.integers(0, 4),
       skips=st.lists(st.booleans(), min_size=2, max_size=4), opt_name=st.sampled_from(
           ["adamw", "sgd"]))
def test_a_unit_used_on_some_ranks_only_with_find_unused_parameters(pools, stage, ws, n_rank,
                                                                     skips, opt_name):
    assert max(pools(ws).run(unused_units_keep_no_gradient, stage, n_rank, skips, True,
                             opt_name)) < TOL


def find_unused_bitmap_cost(stage: int) -> list:
    from minishard import comm
    torch.manual_seed(0)
    model = ZeRO(Net(), stage=stage, units={Block}, find_unused_parameters=True)
    with comm.ledger() as led:
        model(torch.randn(2, 5)).sum().backward()
    return [(e.numel, e.dtype) for e in led.entries if e.tag == "ZeRO used flats"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_find_unused_parameters_costs_one_byte_per_trainable_flat(pools, stage):
    # 4 units (root with the head, a, b, c), one fp32 trainable buffer each
    assert pools(2).run(find_unused_bitmap_cost, stage)[0] == [(4, torch.uint8)]


def test_find_unused_parameters_is_refused_at_stage_3():
    with pytest.raises(ValueError, match="stage 3"):
        ZeRO(Net(), stage=3, find_unused_parameters=True)


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def freezing_after_wrapping(stage: int, when: int, what: str, units, steps: int = 3) -> float:
    """Freeze (then unfreeze) a module through its original name after wrapping: with one unit
    for the whole model, part of a flat buffer freezes while the rest trains."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    oracle = Net()
    model = ZeRO(copy.deepcopy(oracle), stage=stage, units=units)
    ref_opt, opt = _adamw(oracle.parameters()), _adamw(model.parameters())
    for step in range(steps):
        if step == when:
            oracle.get_submodule(what).requires_grad_(False)
            model.module.get_submodule(what).requires_grad_(False)
        if step == when + 1:  # and back: unfreezing works the same way
            oracle.get_submodule(what).requires_grad_(True)
            model.module.get_submodule(what).requires_grad_(True)
        x = torch.randn(3 * n, 5, generator=torch.Generator().manual_seed(step))
        _step_both(oracle, ref_opt, model, opt, x, 3)
    return _diff(model, oracle)


@given(stage=st.sampled_from([0, 1, 2, 3]), ws=st.integers(1, 4), when=st.integers(0, 1),
       what=st.sampled_from(["a", "b", "c", "b.lin", "head"]),
       units=st.sampled_from([{Block}, None]))
def test_freezing_through_original_names_never_trains_a_frozen_weight(pools, stage, ws, when,
                                                                       what, units):
    assert max(pools(ws).run(freezing_after_wrapping, stage, when, what, units)) < TOL


class Shared(nn.Module):
    """``b1.shared is b2.shared``: one module object under two names, in two units."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        self.b1 = nn.Sequential(shared, nn.Tanh())
        self.b2 = nn.Sequential(nn.Linear(4, 4), shared)

    def forward(self, x):
        return self.b2(self.b1(x))


def shared_module_trains(stage: int) -> tuple[float, list[str]]:
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    oracle = Shared()
    model = ZeRO(copy.deepcopy(oracle), stage=stage, units={nn.Sequential})
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x = torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(step))
        _step_both(oracle, ref_opt, model, opt, x, 2)
    return _diff(model, oracle), sorted(model.full_state_dict())


@pytest.mark.parametrize("ws", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_module_under_two_names_trains_and_lists_both(pools, ws, stage):
    for diff, keys in pools(ws).run(shared_module_trains, stage):
        assert diff < TOL
        assert keys == sorted(Shared().state_dict())  # b1.0.* and b2.1.* both


def groups_by_original_names(stage: int, at_wrap: bool, steps: int = 3) -> float:
    """Groups by name: given as ``param_groups=`` when wrapping (the old way), or formed over
    ``model.module`` after wrapping like any torch optimizer's (its parameters keep their names)."""
    r, n = dist.get_rank(), dist.get_world_size()

    def groups(module):
        decay = [p for k, p in module.named_parameters() if not k.endswith("bias")]
        no_decay = [p for k, p in module.named_parameters() if k.endswith("bias")
                    and not k.startswith("head")]
        return [{"params": decay, "weight_decay": 0.5},
                {"params": no_decay, "weight_decay": 0.0, "lr": 0.05}]  # head.bias: defaults

    torch.manual_seed(0)
    oracle = Net()
    base = copy.deepcopy(oracle)
    model = ZeRO(base, stage=stage, units={Block}, param_groups=groups(base) if at_wrap else None)
    ref_groups = groups(oracle) + [{"params": [oracle.head.bias]}]
    ref_opt = torch.optim.SGD(ref_groups, lr=0.1, momentum=0.5)
    mine = model.param_groups() if at_wrap else \
        groups(model.module) + [{"params": [model.module.head.bias]}]
    opt = torch.optim.SGD(mine, lr=0.1, momentum=0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0, 0]
    for step in range(steps):
        x = torch.randn(3 * n, 5, generator=torch.Generator().manual_seed(step))
        _step_both(oracle, ref_opt, model, opt, x, 3)
    return _diff(model, oracle)


@given(stage=st.sampled_from([0, 1, 2, 3]), ws=st.integers(1, 4), at_wrap=st.booleans())
def test_param_groups_by_original_names_match_torch(pools, stage, ws, at_wrap):
    assert max(pools(ws).run(groups_by_original_names, stage, at_wrap)) < TOL


def gathered_keeps_masters(stage: int) -> float:
    torch.manual_seed(0)
    model = ZeRO(Net(), stage=stage, units={Block},
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()  # masters now hold values bf16 cannot represent
    rows = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    before = [r.detach().clone() for r in rows]
    with model.gathered():
        assert model.module.a.lin.weight.dtype == torch.float32  # the master values
    with model.gathered(writeback=False):
        pass
    return max((p - b).abs().max().item() if p.numel() else 0.0  # ws 3: a rank may hold no rows
               for p, b in zip(rows, before))


@pytest.mark.parametrize("ws", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gathered_never_rounds_master_weights(pools, ws, stage):
    assert max(pools(ws).run(gathered_keeps_masters, stage)) == 0.0


def gathered_edits_are_kept_in_full_precision(stage: int) -> float:
    torch.manual_seed(0)
    model = ZeRO(Net(), stage=stage, units={Block},
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with model.gathered():
        model.module.a.lin.weight.fill_(1 / 3)
    return (model.full_state_dict()["a.lin.weight"] - 1 / 3).abs().max().item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gathered_writes_back_edits_in_the_master_dtype(pools, stage):
    assert max(pools(2).run(gathered_edits_are_kept_in_full_precision, stage)) < 1e-7


class KW(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *, scale):
        return self.lin(x) * scale


def keyword_inputs(stage: int) -> list:
    model = ZeRO(KW(), stage=stage, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    x, scale = torch.randn(2, 3), torch.tensor(2.0)
    return [model(x=x, scale=scale).dtype, torch.equal(model(x=x, scale=scale),
                                                       model(x, scale=scale))]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_keyword_inputs_are_cast_under_mixed_precision(pools, stage):
    assert pools(2).run(keyword_inputs, stage)[0] == [torch.bfloat16, True]


class Outside(nn.Module):  # the head multiplies by the embedding's weight in its own code
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.emb(x)) @ self.emb.weight


def outside_reads(stage: int, units) -> str:
    model = ZeRO(Outside(), stage=stage, units=units)
    return _error(lambda: model(torch.randn(2, 3)).sum().backward())


def test_a_stage3_parameter_read_outside_its_unit_raises_a_named_error(pools):
    pool = pools(2)
    error = pool.run(outside_reads, 3, {nn.Linear})[0]
    assert error.startswith("RuntimeError") and "'emb.weight' (owned by unit 'emb')" in error
    for stage in (0, 1, 2):  # the full parameters always exist there: it works
        assert pool.run(outside_reads, stage, {nn.Linear})[0] == "no error"
    assert pool.run(outside_reads, 3, None)[0] == "no error"  # one unit holds both users
