"""Tutorial 12: minishard beside the stock tools (DDP, ZeroRedundancyOptimizer, FSDP1, FSDP2).

    torchrun --standalone --nproc_per_node=2 tutorials/12_beside_the_stock_tools.py
    torchrun --standalone --nproc_per_node=4 tutorials/12_beside_the_stock_tools.py

You have learned the ideas on minishard; at work you will use torch's FSDP (FSDP2's
``fully_shard`` is where new code goes), DDP, or DeepSpeed. They implement the same four stages,
with other names. This lesson trains ONE small model with each minishard stage AND its stock
equivalent, side by side on the same data, and asserts that they end with equal parameters (and
both equal one process trained on the global batch):

    minishard              stock equivalent trained beside it
    stage 0                DistributedDataParallel
    stage 1                DDP + ZeroRedundancyOptimizer (the optimizer state is sharded)
    stage 2                FSDP1 SHARD_GRAD_OP,  FSDP2 fully_shard(reshard_after_forward=False)
    stage 3                FSDP1 FULL_SHARD,     FSDP2 fully_shard (the default)

Every step is the complete loop of tutorial 06 in each tool's own spelling: two micro-batches, the
first without gradient synchronisation (minishard ``no_sync``, FSDP2
``set_requires_gradient_sync(False)``), clipping by the global gradient norm, an SGD step; the
final parameters are read the way each tool offers (``full_state_dict()``, ``summon_full_params``,
``DTensor.full_tensor()``). SGD keeps the comparison strict: float rounding that differs between
tools stays at rounding size (Adam divides by the square root of tiny second moments in its first
steps and can amplify it).

One difference the numbers do not show: DDP + ZeroRedundancyOptimizer still all-reduces the FULL
gradient (DDP does), then each rank updates its shard and broadcasts it: 3 x (N-1)/N x Ψ bytes
per rank where minishard's stage 1 sends 2 x (a reduce-scatter and an all-gather). FSDP offers
no stage 1 of its own.

The same options, spelled four ways (this table is printed at the end too):

--- options ---
minishard.ZeRO(m, stage=0)
    FSDP1      DistributedDataParallel(m)  (FSDP(m, sharding_strategy=NO_SHARD) is the same)
    FSDP2      replicate(m), or DistributedDataParallel(m)
    DeepSpeed  "zero_optimization": {"stage": 0}
stage=1
    FSDP1      DDP(m) + ZeroRedundancyOptimizer(params, optimizer_class=...)
    FSDP2      (no stage 1)
    DeepSpeed  "zero_optimization": {"stage": 1}
stage=2
    FSDP1      FSDP(m, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    FSDP2      fully_shard(m, reshard_after_forward=False)
    DeepSpeed  "zero_optimization": {"stage": 2}
stage=3
    FSDP1      FSDP(m, sharding_strategy=ShardingStrategy.FULL_SHARD)  (the default)
    FSDP2      fully_shard(m)  (reshard_after_forward=True, the default)
    DeepSpeed  "zero_optimization": {"stage": 3}
units={Block}
    FSDP1      auto_wrap_policy=ModuleWrapPolicy({Block})
    FSDP2      fully_shard(block) for every Block, then fully_shard(m)
    DeepSpeed  no units: stage 3 gathers each submodule as it runs
mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    FSDP1      mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)
    FSDP2      mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)
    DeepSpeed  "bf16": {"enabled": true}, "communication_data_type": "fp32"
prefetch=True
    FSDP1      forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE
    FSDP2      on by default (one unit ahead); set_modules_to_forward_prefetch([...]) for more
    DeepSpeed  "overlap_comm": true, "stage3_prefetch_bucket_size": bytes
bucket_bytes=4 * 2**20  (stages 2-3: several units per collective)
    FSDP1      (none: one all-gather per FSDP unit; wrap coarser units)
    FSDP2      fully_shard([block_a, block_b]): a list of modules is one communication group
    DeepSpeed  "stage3_prefetch_bucket_size": bytes, "reduce_bucket_size": bytes
with m.no_sync():
    FSDP1      with m.no_sync():
    FSDP2      m.set_requires_gradient_sync(False) ... m.set_requires_gradient_sync(True)
    DeepSpeed  "gradient_accumulation_steps": k  (engine.backward / engine.step count them)
m.clip_grad_norm_(max_norm)
    FSDP1      m.clip_grad_norm_(max_norm)
    FSDP2      torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)  (DTensor grads)
    DeepSpeed  "gradient_clipping": max_norm
with m.gathered():
    FSDP1      with FSDP.summon_full_params(m):
    FSDP2      m.unshard() ... m.reshard(), or p.full_tensor() for one parameter
    DeepSpeed  with deepspeed.zero.GatheredParameters(params):
m.full_state_dict()
    FSDP1      with FSDP.state_dict_type(m, StateDictType.FULL_STATE_DICT): m.state_dict()
    FSDP2      get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    DeepSpeed  "stage3_gather_16bit_weights_on_model_save": true, or zero_to_fp32.py
process_group=pg
    FSDP1      process_group=pg
    FSDP2      mesh=init_device_mesh("cuda", (N,))  (a 1-D DeviceMesh)
    DeepSpeed  deepspeed.initialize(..., mpu=...)  (its data-parallel group)
mesh=init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    FSDP1      sharding_strategy=ShardingStrategy.HYBRID_SHARD
    FSDP2      fully_shard(m, mesh=init_device_mesh("cuda", (R, S)))  (HSDP)
    DeepSpeed  "zero_optimization": {"stage": 3, "zero_hpz_partition_size": S}  (ZeRO++ hpZ)
param_groups=[{"params": no_decay, "weight_decay": 0.0}]; AdamW(m.param_groups())
    FSDP1      use_orig_params=True, then groups over m.named_parameters() as usual
    FSDP2      groups over m.named_parameters() as usual (DTensor parameters)
    DeepSpeed  deepspeed.initialize(model=m, model_parameters=groups)
find_unused_parameters=True  (stages 0-2)
    FSDP1      (none: every rank must use the same modules)
    FSDP2      (none: every rank must use the same modules)
    DeepSpeed  (none at stage 3; stages 1-2 reduce every gradient)
m.module.block.requires_grad_(False)  (freeze whole units)
    FSDP1      use_orig_params=True, then p.requires_grad_(False) (uniform per FSDP unit)
    FSDP2      p.requires_grad_(False) on the DTensor parameters
    DeepSpeed  p.requires_grad_(False) before deepspeed.initialize
--- end ---
DeepSpeed has no explicit units: at stage 3 it gathers each submodule's parameters as it runs,
tuned by stage3_prefetch_bucket_size, stage3_max_live_parameters and
stage3_param_persistence_threshold (parameters smaller than it stay gathered).
"""
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard



def options_table() -> str:
    """The table of spellings, as this file's docstring has it."""
    return __doc__.split("--- options ---\n")[1].split("--- end ---")[0].rstrip()


WIDTH, BLOCKS, GLOBAL_BATCH, STEPS = 10, 3, 24, 3   # 110 parameters a block: padding at 3 and 4
LR, MOMENTUM, MAX_NORM = 0.1, 0.9, 0.1               # MAX_NORM below the norm: clipping acts
TOL = 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def fresh_model() -> nn.Module:
    torch.manual_seed(0)  # every tool starts from the same weights
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, WIDTH,
                                                                       generator=g)


def loss_fn(model, x, y):
    return (model(x) - y).square().mean()


def reference() -> dict[str, torch.Tensor]:
    """One process, the global batch: each micro-batch is half of every rank's slice, so the two
    micro-batches together are the whole batch and their gradients add up to its gradient."""
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    world = dist.get_world_size()
    for step in range(STEPS):
        x, y = data(step)
        for mb in range(2):
            rows = [r for rank in range(world) for r in local_rows(rank, world, mb)]
            # mean over the global batch = average over ranks of their local means (equal sizes)
            (loss_fn(model, x[rows], y[rows]) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM, norm  # the clipping really scales the gradients: it is tested
        opt.step()
        opt.zero_grad()
    return named(model)


def named(module: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full tensor}, names as in the unwrapped model (wrappers add prefixes)."""
    out = {}
    for name, p in module.named_parameters():
        for prefix in ("_fsdp_wrapped_module.", "module."):
            name = name.replace(prefix, "")
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p
    return {k: v.detach().clone() for k, v in out.items()}


def local_rows(rank: int, world: int, mb: int) -> list[int]:
    per_rank = GLOBAL_BATCH // world
    start = rank * per_rank + mb * per_rank // 2
    return list(range(start, start + per_rank // 2))


def train(model, opt, no_sync, clip) -> None:
    """The same loop for every tool: ``no_sync()`` a context for the first micro-batch,
    ``clip()`` clips by the global norm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = data(step)
        for mb in range(2):
            rows = local_rows(rank, world, mb)
            with no_sync() if mb == 0 else _nothing():
                (loss_fn(model, x[rows], y[rows]) / 2).backward()
        clip()
        opt.step()
        opt.zero_grad()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# ------------------------------------------------------------------------------ each tool
def run_minishard(stage: int) -> dict[str, torch.Tensor]:
    model = minishard.ZeRO(fresh_model(), stage=stage, units={Block})
    train(model, sgd(model.parameters()), model.no_sync,
          lambda: model.clip_grad_norm_(MAX_NORM))
    return model.full_state_dict()  # full tensors on every rank, the unwrapped model's names


def run_ddp(zero_optimizer: bool) -> dict[str, torch.Tensor]:
    model = DDP(fresh_model())
    opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=LR,
                                   momentum=MOMENTUM)
           if zero_optimizer else sgd(model.parameters()))
    # DDP keeps full gradients on every rank: the local norm IS the global norm.
    train(model, opt, model.no_sync,
          lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    return named(model)


def run_fsdp1(strategy: ShardingStrategy) -> dict[str, torch.Tensor]:
    model = FSDP(fresh_model(), sharding_strategy=strategy,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                 device_id=torch.device("cpu"))  # FSDP1 needs the device named to run on CPU
    train(model, sgd(model.parameters()), model.no_sync,
          lambda: model.clip_grad_norm_(MAX_NORM))
    with FSDP.summon_full_params(model):  # minishard: with model.gathered():
        return named(model)


def run_fsdp2(reshard_after_forward: bool) -> dict[str, torch.Tensor]:
    model = fresh_model()
    for block in model:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)

    class no_sync:  # FSDP2 has no context manager: a flag on the module
        def __enter__(self):
            model.set_requires_gradient_sync(False)

        def __exit__(self, *exc):
            model.set_requires_gradient_sync(True)

    # The parameters are DTensors (Shard(0) over the ranks): clip_grad_norm_ reduces the norm
    # across ranks by itself.
    train(model, sgd(model.parameters()), no_sync,
          lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    return named(model)  # each DTensor parameter's full_tensor(): an all-gather


PAIRS = [
    (0, "DDP", lambda: run_ddp(zero_optimizer=False)),
    (1, "DDP + ZeroRedundancyOptimizer", lambda: run_ddp(zero_optimizer=True)),
    (2, "FSDP1 SHARD_GRAD_OP", lambda: run_fsdp1(ShardingStrategy.SHARD_GRAD_OP)),
    (2, "FSDP2 reshard_after_forward=False", lambda: run_fsdp2(False)),
    (3, "FSDP1 FULL_SHARD", lambda: run_fsdp1(ShardingStrategy.FULL_SHARD)),
    (3, "FSDP2 fully_shard", lambda: run_fsdp2(True)),
]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} rank{'s' if world > 1 else ''}; {BLOCKS} blocks of Linear({WIDTH}, {WIDTH}); "
        f"{STEPS} steps of SGD "
        f"(momentum {MOMENTUM}), each 2 micro-batches (the first without gradient sync) and "
        f"clipping to norm {MAX_NORM}.\n")
    want = reference()
    ours = {stage: run_minishard(stage) for stage in range(4)}
    say(f"{'minishard':<12}{'stock equivalent':<36}{'|ours - stock|':>15}{'|ours - 1 proc|':>17}"
        f"{'|stock - 1 proc|':>18}")
    for stage, name, run in PAIRS:
        stock = run()
        d_pair, d_ours, d_stock = (max_diff(ours[stage], stock), max_diff(ours[stage], want),
                                   max_diff(stock, want))
        say(f"stage {stage:<6}{name:<36}{d_pair:>15.1e}{d_ours:>17.1e}{d_stock:>18.1e}")
        assert d_pair < TOL and d_ours < TOL and d_stock < TOL, (stage, name, d_pair, d_ours,
                                                                 d_stock)
    say(f"\nEvery pair ended with equal parameters (< {TOL:g}), and equal to one process on the "
        "global batch.\n")
    say("The same options in each tool:\n")
    say(options_table())
    say("All assertions held.")


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session({1, 2, 3, 4, 6}, why=f"a batch of {GLOBAL_BATCH} in 2 "
                                  "micro-batches per rank") as (rank, world):
        main(rank, world)
