"""What a step will hold and allocate, predicted from the plan alone: no wrap, no process group,
no memory (a module on the meta device will do).

    parts = predict_memory(module, stage=3, world=4, rank=0, units={Block}, optimizer="adam")
    # {"parameters": ..., "optimizer state": ..., "gathered parameters": ..., ...}

The same rules as the engine, not a copy of them: the units, each parameter's owner and the flat
buffers come from zero/build.py (``owned_params``, ``flat_groups``, ``flat_mode_of``), the cut
from ``flat.Layout``, and the step's buffers from ``zero.meters.transients``, which the engine's
own ``model.step_transients()`` calls. tests/test_predict.py holds each plan against the
wrapped model, buffer by buffer, and its bytes against what the model holds.

  parameters       what a rank holds at rest: stage 0 every buffer whole; stages 1-2 whole too
                   (under mixed precision also the fp32 shard); stage 3 its shard
  optimizer state  bytes a master element (OPTIMIZER_STATE) x this rank's real rows
  the rest         the buffers a training step allocates ([Note: a step's memory], meters.py)

``python -m minishard.plan --check`` (under torchrun) puts the sum, plus the module's forward
activations counted on the meta device, beside a run here: :func:`check`. The sum is an upper
bound (the step formula adds each buffer's largest size, whenever it occurs): bench/RESULTS.md,
"The planner beside a run", has how far above.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from minishard import comm
from minishard.observe.allocations import Allocations
from minishard.zero.build import flat_groups, flat_mode_of, owned_params, replicated_predicate
from minishard.zero.config import MixedPrecision
from minishard.zero.engine import STAGES, ZeRO
from minishard.zero.flat import FlatMode, Layout
from minishard.zero.meters import transients

__all__ = ["PlannedBuffer", "plan_buffers", "predict_memory", "OPTIMIZER_STATE", "check"]

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


class _Block(nn.Module):  # bench/zero_vs_stock.py's MLP block
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return nn.functional.gelu(self.linear(x))


def check(width: int = 512, blocks: int = 8, batch: int = 32, steps: int = 3) -> list[str]:
    """Under a process group: bench/'s MLP (``blocks`` Linear(width, width) + GELU, a batch of
    ``batch`` rows a rank, Adam) at stages 0-3, one line each: the peak allocated bytes of the
    rank where it is largest, predicted (:func:`predict_memory`, plus the forward's peak counted
    on the meta device, twice: its gradients in backward, as tests/test_memory_wall.py bounds a
    step) and measured (``Allocations`` over ``steps`` steps after a warm-up, the states held
    included). The prediction is the step formula's upper bound, not an estimate."""
    world, rank, lines = dist.get_world_size(), dist.get_rank(), []
    for stage in range(4):
        torch.manual_seed(0)
        net, x = nn.Sequential(*[_Block(width) for _ in range(blocks)]), torch.randn(batch, width)
        meta = copy.deepcopy(net).to("meta")
        with Allocations(meta=True) as forward:
            meta(x.to("meta"))
        predicted = sum(predict_memory(meta, stage, world, rank, units={_Block}).values())
        with Allocations() as measured:
            model = ZeRO(net, stage=stage, units={_Block})
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            for i in range(1 + steps):
                if i == 1:
                    measured.reset_peak()  # from what the warm-up step left held
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        both = torch.tensor([predicted + 2 * forward.peak, measured.peak], dtype=torch.float64)
        comm.all_reduce(both, "max", tag="plan --check")
        lines.append(f"minishard stage {stage} peak_allocated predicted={both[0] / 2**20:.2f} "
                     f"measured={both[1] / 2**20:.2f}")
    return lines
