"""'Rank 0' in the state-dict API means GLOBAL rank 0 (issue 28, defect 3): the file is on one
machine. On a 2-D mesh, ``full_state_dict(rank0_only=True)`` used to give the dict to every
replica's first rank (global ranks 0 and 2 on 2x2), and ``load_full_state_dict(sd,
from_rank0=True)`` with the dict on global rank 0 alone raised on the other replica."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard
from test_contiguous import WithTable
from test_hybrid import mesh_of


def rank0_on_a_mesh(shape, stage):
    torch.manual_seed(0)
    model = minishard.ZeRO(WithTable(), stage=stage, units={nn.Linear}, mesh=mesh_of(shape))
    before = model.full_state_dict()  # every rank: the oracle for rank0_only
    only = model.full_state_dict(rank0_only=True)
    gen = torch.Generator().manual_seed(11)
    source = {k: torch.randn(v.shape, generator=gen) for k, v in before.items()}
    model.load_full_state_dict(source if dist.get_rank() == 0 else None, from_rank0=True)
    after = model.full_state_dict()
    return (sorted(only) if only else None,
            all(torch.equal(only[k], before[k]) for k in only),
            all(torch.equal(after[k], source[k]) for k in source))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_rank0_is_global_rank_0_on_a_mesh(pools, shape, stage):
    results = pools(4).run(rank0_on_a_mesh, shape, stage)
    keys = sorted(WithTable().state_dict())
    assert [r[0] for r in results] == [keys, None, None, None], "rank0_only: who got the dict"
    assert all(r[1] for r in results), "rank0_only: global rank 0's dict differs from the full one"
    assert all(r[2] for r in results), "from_rank0: a rank did not load global rank 0's dict"
