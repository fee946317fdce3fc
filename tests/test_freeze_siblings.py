"""Freezing by name after wrapping freezes exactly that module, not a sibling whose name starts
with the same characters (issue 28, blind spot 2): ``b`` and ``b2``, ``blocks.1`` and
``blocks.10``. The oracle is the unwrapped model, frozen the same way, trained on the global
batch in one process."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard


class Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.b2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)])  # blocks.1, blocks.10

    def forward(self, x):
        return self.blocks(self.b2(self.b(x)))


def train_beside(model, opt, oracle, ref) -> dict:
    """Two SGD steps: the engine on this rank's rows, the oracle on the global batch; the
    largest difference of each tensor after them."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x[4 * r:4 * (r + 1)]).square().mean().backward()
        opt.step(), opt.zero_grad()
        oracle(x).square().mean().backward()
        ref.step(), ref.zero_grad()
    got, want = model.full_state_dict(), oracle.state_dict()
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


def freeze_then_train(stage: int, frozen: str):
    torch.manual_seed(0)
    oracle = Siblings()
    model = minishard.ZeRO(copy.deepcopy(oracle), stage=stage, units={nn.Linear})
    oracle.get_submodule(frozen).requires_grad_(False)
    model.module.get_submodule(frozen).requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.1)
    return train_beside(model, opt, oracle, ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("frozen", ["b", "blocks.1"])
def test_freezing_a_module_leaves_its_prefix_siblings_training(pools, stage, frozen):
    for errors in pools(2).run(freeze_then_train, stage, frozen):
        assert max(errors.values()) < 1e-6, {k: v for k, v in errors.items() if v >= 1e-6}


def units_then_train(stage: int):
    """``b`` and ``blocks.1`` are units, their prefix siblings ``b2`` and ``blocks.10`` are not:
    those belong to the root unit (a path prefix decides who owns a parameter, not a name
    prefix). Trained against the unwrapped model on the global batch."""
    torch.manual_seed(0)
    oracle = Siblings()
    wrapped = copy.deepcopy(oracle)
    mine = {id(wrapped.b), id(wrapped.blocks[1])}
    model = minishard.ZeRO(wrapped, stage=stage, units=lambda m: id(m) in mine)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    owners = {u.name: sorted(p.name for p in u.params()) for u in model.units}
    return train_beside(model, opt, oracle, ref), owners


@pytest.mark.parametrize("stage", [0, 3])
def test_a_unit_does_not_own_its_prefix_siblings(pools, stage):
    for errors, owners in pools(2).run(units_then_train, stage):
        assert owners["b"] == ["b.bias", "b.weight"], owners
        assert owners["blocks.1"] == ["blocks.1.bias", "blocks.1.weight"], owners
        assert max(errors.values()) < 1e-6, {k: v for k, v in errors.items() if v >= 1e-6}
