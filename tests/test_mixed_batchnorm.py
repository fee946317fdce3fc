"""Mixed precision with plain BatchNorm layers (1d, 2d, 3d), at stages 0-3.

Before: ``MixedPrecision(param_dtype=torch.bfloat16)`` cast a BatchNorm's weight and bias to
bf16 while its running statistics stayed fp32, and torch's CPU batch norm refused the forward
("expected scalar type BFloat16 but found Float"). Now a BatchNorm's parameters compute in
their own dtype, as FSDP keeps BatchNorm in full precision; the other layers in bf16.

The oracle emulates the N ranks in ONE process with plain torch: for each rank's rows, a copy
of the model whose convolutions and linear layers hold bf16 copies of the fp32 weights and whose
BatchNorm keeps fp32 weights (a plain BatchNorm normalises each rank's rows alone, as under DDP);
input in bf16; each rank's gradients cast to fp32 and averaged (``reduce_dtype=fp32``); one SGD
step on the fp32 weights. Running statistics are each rank's own.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

from minishard import MixedPrecision, ZeRO

WORLD_SIZES = (1, 2, 3, 4)
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
LR = 0.1


def build(dims: int, c: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(CONV[dims](2, c, 1), NORM[dims](c), nn.ReLU(), nn.Flatten(),
                         nn.Linear(c * 2 ** dims, 3))


def batch(dims: int, world: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(world, rows, 2, *[2] * dims, generator=g)


def one_rank_in_bf16(model: nn.Module, x: torch.Tensor):
    """One rank of the emulation: bf16 copies of every weight but BatchNorm's."""
    local = copy.deepcopy(model)
    for m in local.modules():
        if not isinstance(m, nn.modules.batchnorm._BatchNorm):
            for p in m.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    local(x.to(torch.bfloat16)).float().square().mean().backward()
    grads = {n: p.grad.float() for n, p in local.named_parameters()}
    return grads, {n: b for n, b in local.named_buffers()}


def _train(stage: int, dims: int, c: int, rows: int, seed: int, buffer_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ZeRO(build(dims, c, seed), stage=stage, units={CONV[dims], nn.Linear},
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=buffer_dtype))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = batch(dims, world, rows, seed)
    model(x[rank]).float().square().mean().backward()
    opt.step()
    return model.full_state_dict()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@given(stage=st.sampled_from([0, 1, 2, 3]), dims=st.sampled_from([1, 2, 3]),
       c=st.integers(1, 5), rows=st.integers(2, 4), seed=st.integers(0, 2**16),
       buffer_dtype=st.sampled_from([None, torch.bfloat16]))
def test_batchnorm_under_bf16_trains_as_the_emulated_ranks(pools, ws, stage, dims, c, rows,
                                                           seed, buffer_dtype):
    model = build(dims, c, seed)
    x = batch(dims, ws, rows, seed)
    per_rank = [one_rank_in_bf16(model, x[r]) for r in range(ws)]
    mean = {n: sum(g[n] for g, _ in per_rank) / ws for n in per_rank[0][0]}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p -= LR * mean[n]
    got = pools(ws).run(_train, stage, dims, c, rows, seed, buffer_dtype)
    for rank, sd in enumerate(got):
        for n, p in model.named_parameters():
            assert sd[n].dtype == torch.float32
            assert torch.allclose(sd[n], p, rtol=1e-5, atol=1e-6), (rank, n, sd[n], p)
        for n, b in per_rank[rank][1].items():  # each rank's own running statistics, in fp32
            assert sd[n].dtype == b.dtype and torch.allclose(sd[n].double(), b.double(),
                                                             rtol=1e-5, atol=1e-6), (rank, n)
