"""find_unused_parameters=True, a SyncBatchNorm (a collective inside backward) and a branch only
some ranks run (issue 28, defect 2). Stage 2 used to deadlock: a rank that ran the branch waited
for the branch's reduction (at most two in flight) that the other rank launches only at the end
of backward, while the other waited in SyncBatchNorm's backward all-reduce for the first. Now
every rank launches its reductions at the end of backward ([Note: find_unused] in
zero/schedule.py). The oracle: torch DDP(find_unused_parameters=True) on the same model and data."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard


class BranchAfterSyncBN(nn.Module):
    """x1, x2 are registered BEFORE the branch but run AFTER it: in the fixed reduction order
    (reverse registration) they come after the branch, and are ready before SyncBN's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.bn = nn.Linear(4, 4), minishard.SyncBatchNorm(4)
        self.x1, self.x2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)

    def forward(self, x, use_branch: bool):
        h = self.bn(self.trunk(x))
        if use_branch:
            h = self.branch(h)
        return self.x2(self.x1(h))


def train_both(stage: int):
    torch.manual_seed(0)
    base = BranchAfterSyncBN()
    model = minishard.ZeRO(copy.deepcopy(base), stage=stage, units={nn.Linear},
                           find_unused_parameters=True)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(ddp.parameters(), lr=0.1)
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(5 + r)
    for step in range(3):
        x = torch.randn(3, 4, generator=gen)
        use = (r + step) % 2 == 0  # some ranks run the branch, the others not
        for m, o in ((model, opt), (ddp, ref)):
            m(x, use).square().mean().backward()
            o.step()
            o.zero_grad()
    got, want = model.full_state_dict(), ddp.module.state_dict()
    return {k: (got[k].double() - want[k].double()).abs().max().item() for k in want}


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_branch_some_ranks_run_beside_syncbn_neither_hangs_nor_drifts(pools, ws, stage):
    for errors in pools(ws).run(train_both, stage):
        assert max(errors.values()) < 1e-6, {k: v for k, v in errors.items() if v >= 1e-6}
