"""find_unused_parameters=True and a unit that NO rank used in a step (issue 28, blind spot 1):
in one process its parameters get ``grad=None`` and SGD's momentum leaves them alone; the engine
must restore that after reducing the zeros every rank sent for it. The oracle is the unwrapped
model trained on the global batch in one process, skipping the branch in the same steps."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, use_branch: bool):
        h = self.trunk(x)
        return self.head(self.branch(h) if use_branch else h)


def skipped_by_every_rank(stage: int, pattern):
    torch.manual_seed(0)
    oracle = Branchy()
    model = minishard.ZeRO(copy.deepcopy(oracle), stage=stage, units={nn.Linear},
                           find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(2)
    for use in pattern:  # the same on every rank: a step where no rank runs the branch
        x = torch.randn(3 * n, 4, generator=gen)
        model(x[3 * r:3 * (r + 1)], use).square().mean().backward()
        opt.step(), opt.zero_grad(set_to_none=True)
        oracle(x, use).square().mean().backward()
        ref.step(), ref.zero_grad(set_to_none=True)
    got, want = model.full_state_dict(), oracle.state_dict()
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_unit_no_rank_used_keeps_no_gradient(pools, ws, stage):
    for errors in pools(ws).run(skipped_by_every_rank, stage, [True, False, False, True]):
        assert max(errors.values()) < 1e-6, {k: v for k, v in errors.items() if v >= 1e-6}
