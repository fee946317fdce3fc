"""Strided tensors through every collective (issue 28, defect 1).

A backend moves a tensor's memory in storage order. Before this test, rank 0 broadcasting a
buffer stored transposed (``load_full_state_dict(sd, from_rank0=True)``) gave the other ranks
its values in memory order: silently different weights on every rank but rank 0. The oracle here
is each tensor's LOGICAL value (what indexing it shows), computed on every rank from the same
seed; no collective is involved in computing it.
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

import minishard
from minishard import comm


def transposed(m: torch.Tensor) -> torch.Tensor:
    """The same logical values in fresh storage, column-major (non-contiguous unless a
    dimension has size 1)."""
    return m.t().clone(memory_format=torch.contiguous_format).t()


def every_other(n: int) -> torch.Tensor:
    """A 1-D view with stride 2 over fresh storage: non-contiguous, n elements."""
    return torch.zeros(2 * n, dtype=torch.float64)[::2]


def strided_collectives(rows: int, cols: int, seed: int) -> bool:
    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    mats = [torch.randn(rows, cols, generator=gen, dtype=torch.float64) for _ in range(n)]
    # Odd ranks hold their tensor transposed, even ranks contiguous: the ranks disagree on layout.
    mine = lambda: transposed(mats[r]) if r % 2 else mats[r].clone()
    total = sum(mats[1:], mats[0].clone())  # in rank order, as the ring's sum need not be
    for algorithm in comm.all_reduce_algorithms(n) + ["auto"]:
        x = mine()
        comm.all_reduce(x, "sum", algorithm=algorithm)
        torch.testing.assert_close(x, total, rtol=1e-12, atol=1e-12)
    src = n - 1  # the source holds its tensor transposed whenever n is even
    b = mine()
    comm.broadcast(b, src=src)
    assert torch.equal(b, mats[src]), "broadcast: a strided source sent its storage order"
    flat = [m.reshape(-1) for m in mats]
    k = rows * cols
    shard = every_other(k)
    shard.copy_(flat[r])
    out = every_other(n * k)
    comm.all_gather(out, shard)
    assert torch.equal(out, torch.cat(flat))
    if k % n == 0:
        full = every_other(k)
        full.copy_(flat[r])
        piece = every_other(k // n)
        comm.reduce_scatter(piece, full, "sum")
        want = sum(f[r * (k // n):(r + 1) * (k // n)] for f in flat)
        torch.testing.assert_close(piece, want, rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_strided_tensors_reach_every_rank_in_logical_order(pools, ws, rows, cols, seed):
    assert pools(ws).run(strided_collectives, rows, cols, seed) == [True] * ws


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("table", torch.zeros(3, 5))

    def forward(self, x):
        return self.lin(x) + self.table.sum()


def load_transposed_from_rank0(stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = minishard.ZeRO(WithTable(), stage=stage, units={nn.Linear})
    gen = torch.Generator().manual_seed(7)
    source = {"lin.weight": torch.randn(3, 4, generator=gen),
              "lin.bias": torch.randn(3, generator=gen),
              "table": torch.randn(3, 5, generator=gen)}
    sd = None
    if dist.get_rank() == 0:  # rank 0's dict stores the matrices transposed in memory
        sd = {k: transposed(v) if v.dim() == 2 else v for k, v in source.items()}
        assert not sd["table"].is_contiguous() and not sd["lin.weight"].is_contiguous()
    model.load_full_state_dict(sd, from_rank0=True)
    got = model.full_state_dict()
    for name, value in source.items():
        assert torch.equal(got[name], value), f"{name} differs from rank 0's on rank {dist.get_rank()}"
    return {k: v.clone() for k, v in got.items()}


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_full_state_dict_from_rank0_with_a_transposed_tensor(pools, ws, stage):
    results = pools(ws).run(load_transposed_from_rank0, stage)
    for other in results[1:]:
        assert all(torch.equal(other[k], results[0][k]) for k in results[0])
