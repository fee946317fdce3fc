"""Tutorial 12: minishard beside the stock tools (DDP, ZeroRedundancyOptimizer, FSDP1, FSDP2).

    torchrun --standalone --nproc_per_node=2 tutorials/12_beside_the_stock_tools.py
    torchrun --standalone --nproc_per_node=4 tutorials/12_beside_the_stock_tools.py

You have learned the ideas on minishard; at work you will use torch's FSDP (FSDP2's
``fully_shard`` is where new code goes), DDP, or DeepSpeed. They shard the same three things,
with other names and other schedules. This lesson trains ONE small model with each minishard
stage AND the stock tool closest to it, side by side on the same data, and asserts that they end
with equal parameters (and both equal one process trained on the global batch). Then it
MEASURES both sides of every row, the bytes sent in one step and the bytes held between steps,
and asserts how they relate: equal names do not mean equal costs.

    stage 0 beside DistributedDataParallel
        same     one all-reduce of the gradients per step
        differs  DDP keeps its gradient bucket (4Ψ) between steps; stage 0 frees its gradients
    stage 1 beside DDP + ZeroRedundancyOptimizer (FSDP has no stage 1)
        same     the optimizer state is sharded
        differs  DDP all-reduces the FULL gradient, then each rank broadcasts its updated
                 shard: 3 passes per step where stage 1 sends 2 (reduce-scatter, all-gather);
                 ZeroRedundancyOptimizer's shards are whole parameters, minishard's each
                 parameter's rows cut in N (FSDP2's layout)
    stage 2 beside FSDP1 SHARD_GRAD_OP and FSDP2 fully_shard(reshard_after_forward=False)
        same     gradients and optimizer state sharded; FSDP1 sends the passes stage 2 sends
                 (one all-gather and one reduce-scatter of the parameters per step)
        differs  between steps FSDP holds parameter SHARDS (torch's docstring: it reshards after
                 backward), minishard's stage 2 the FULL parameters; FSDP2 also reshards after
                 a no_sync backward and gathers again: 3 passes where stage 2 sends 2
    stage 3 beside FSDP1 FULL_SHARD and FSDP2 fully_shard
        same     everything sharded; gathered before forward and before backward, gradients
                 reduce-scattered after it: 5 passes per step here (with no_sync, 2 gathers per
                 micro-batch and one reduce-scatter)
        differs  minishard and FSDP2 cut each parameter along dim 0 and pad its rows to a
                 multiple of N; FSDP1 cuts a unit's flat buffer and pads its END (with
                 use_orig_params=True also between parameters, to 16-byte alignment), so its passes
                 are shorter when N does not divide the rows (but its shards are 1-D slices
                 across parameters: no names, shapes or per-parameter freezing); both FSDPs
                 keep some bytes of their own between steps beyond shards and momentum (printed)

(A pass: one all-gather or reduce-scatter over all the parameters, (N-1)/N x 4 bytes per element
sent per rank in the ring model; an all-reduce is two passes, a broadcast one.)

Every step is the complete loop of tutorial 06 in each tool's own spelling: two micro-batches, the
first without gradient synchronisation (minishard ``no_sync``, FSDP2
``set_requires_gradient_sync(False)``), clipping by the global gradient norm, an SGD step; the
final parameters are read the way each tool offers (``full_state_dict()``, ``summon_full_params``,
``DTensor.full_tensor()``). SGD keeps the comparison strict: float rounding that differs between
tools stays at rounding size (Adam divides by the square root of tiny second moments in its first
steps and can amplify it). What each stock tool sends is recorded by wrapping torch.distributed's
collectives for the last step (DDP's reducer calls C++ directly: the lesson registers torch's own
``allreduce_hook``, which goes through ``dist.all_reduce``); what it holds, from the storage of
every tensor Python can see.

Where DeepSpeed differs (read from its documentation, not run here): its engine refuses
``no_sync()`` at stages 2-3 ("no_sync context manager is incompatible with gradient
partitioning"), and ``gradient_accumulation_steps`` there reduces every micro-batch's gradients
(minishard and FSDP skip the reduction under no_sync and hold full gradients instead). Its
hierarchical partitioning (ZeRO++ hpZ, ``zero_hpz_partition_size``) keeps optimizer state and
gradients sharded over ALL ranks and adds a secondary copy of the parameters, sharded inside a
node, for the backward all-gather; minishard's ``mesh=`` shards everything inside a node and
replicates across nodes, as FSDP's HYBRID_SHARD and DeepSpeed's MiCS (``mics_shard_size``) do.

The same options, spelled four ways (this table is printed at the end too):

--- options ---
minishard.ZeRO(m, stage=0)
    FSDP1      DistributedDataParallel(m)  (or FSDP(m, sharding_strategy=NO_SHARD))
    FSDP2      replicate(m), or DistributedDataParallel(m)
    DeepSpeed  "zero_optimization": {"stage": 0}
stage=1
    FSDP1      DDP(m) + ZeroRedundancyOptimizer(params, optimizer_class=...)  (3 passes, not 2)
    FSDP2      (no stage 1)
    DeepSpeed  "zero_optimization": {"stage": 1}
stage=2
    FSDP1      FSDP(m, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)  (shards between steps)
    FSDP2      fully_shard(m, reshard_after_forward=False)  (shards between steps)
    DeepSpeed  "zero_optimization": {"stage": 2}
stage=3
    FSDP1      FSDP(m, sharding_strategy=ShardingStrategy.FULL_SHARD)  (the default)
    FSDP2      fully_shard(m)  (reshard_after_forward's default: True, except for the root)
    DeepSpeed  "zero_optimization": {"stage": 3}
units={Block}
    FSDP1      auto_wrap_policy=ModuleWrapPolicy({Block})
    FSDP2      fully_shard(block) for every Block, then fully_shard(m)
    DeepSpeed  no units: stage 3 gathers each submodule as it runs
replicate=nn.LayerNorm, persist_below=n  (stages 1-3: these parameters whole on every rank)
    FSDP1      (none: ignored_modules leaves them out of every gradient average)
    FSDP2      replicate(norm) (_composable.replicate_with_fsdp) + fully_shard(rest), one mesh
    DeepSpeed  "stage3_param_persistence_threshold": n  (elements; its default 1e5, ours 0)
mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    FSDP1      mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)
    FSDP2      mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)
    DeepSpeed  "bf16": {"enabled": true}, "communication_data_type": "fp32"
prefetch=True
    FSDP1      forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE
    FSDP2      on by default (one unit ahead); set_modules_to_forward_prefetch([...]) for more
    DeepSpeed  "overlap_comm": true, "stage3_prefetch_bucket_size": elements (not bytes)
bucket_bytes=4 * 2**20  (stages 2-3: several units per collective)
    FSDP1      (none: one all-gather per FSDP unit; wrap coarser units)
    FSDP2      fully_shard([block_a, block_b]): a list of modules is one communication group
    DeepSpeed  "stage3_prefetch_bucket_size", "reduce_bucket_size": elements (not bytes)
with m.no_sync():
    FSDP1      with m.no_sync():  (SHARD_GRAD_OP then keeps the parameters gathered, as stage 2)
    FSDP2      m.set_requires_gradient_sync(False) ... (True)  (reshards: 3 passes, above; not with set_reshard_after_backward(False))
    DeepSpeed  engine.no_sync() at stages 0-1 only; "gradient_accumulation_steps": k at any
m.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
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
    FSDP1      ShardingStrategy.HYBRID_SHARD (stage 3), _HYBRID_SHARD_ZERO2 (stage 2); none for 1
    FSDP2      fully_shard(m, mesh=init_device_mesh("cuda", (R, S)))  (HSDP; stages 2-3)
    DeepSpeed  "zero_optimization": {"stage": 3, "mics_shard_size": S}  (MiCS; hpZ is not this)
AdamW(groups by name, e.g. decay where p.dim() >= 2)  (before wrapping or after: DTensors)
    FSDP1      use_orig_params=True, then groups over m.named_parameters() as usual
    FSDP2      groups over m.named_parameters() as usual (DTensor parameters)
    DeepSpeed  deepspeed.initialize(model=m, model_parameters=groups)
get_state_dict(m.module, opt) / set_state_dict(m.module, opt, ...), then dcp.save / dcp.load
    FSDP1      get_state_dict(m, opt)
    FSDP2      get_state_dict(m, opt)  (m is the module: fully_shard wraps nothing)
    DeepSpeed  engine.save_checkpoint(dir) / engine.load_checkpoint(dir)
find_unused_parameters=True  (stages 0-2)
    FSDP1      (none: every rank must use the same modules)
    FSDP2      (none: every rank must use the same modules)
    DeepSpeed  (none at stage 3; stages 1-2 reduce every gradient)
minishard.ShardedOptimizer(params, torch.optim.AdamW, lr=...)  (ZeRO-1 over parameters)
    FSDP1      ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=...)
    FSDP2      (none: fully_shard's DTensor parameters shard the optimizer state already)
    DeepSpeed  "zero_optimization": {"stage": 1}  (over the engine's model, not parameters)
m.module.block.linear.weight.requires_grad_(False)  (any parameter, also after wrapping)
    FSDP1      use_orig_params=True, then p.requires_grad_(False) (False: uniform per FSDP unit)
    FSDP2      p.requires_grad_(False) on the DTensor parameters
    DeepSpeed  p.requires_grad_(False) before deepspeed.initialize
--- end ---
DeepSpeed has no explicit units: at stage 3 it gathers each submodule's parameters as it runs,
tuned by stage3_prefetch_bucket_size, stage3_max_live_parameters and
stage3_param_persistence_threshold (parameters smaller than it stay gathered).
"""
import contextlib
import gc
import inspect
import textwrap
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard
from minishard import comm


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


def train(model, opt, no_sync, clip, watch, before: int) -> tuple[list, int]:
    """The same loop for every tool: ``no_sync()`` a context for the first micro-batch,
    ``clip()`` clips by the global norm. ``watch()`` records the collectives of the LAST step
    (the steady state). Returns them, and the bytes this tool holds between steps: tensor storage
    alive after that step, gradients zeroed (set to None), less ``before`` (taken before the
    model was built)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = data(step)
        with (watch() if step == STEPS - 1 else contextlib.nullcontext()) as seen:
            for mb in range(2):
                rows = local_rows(rank, world, mb)
                with no_sync() if mb == 0 else contextlib.nullcontext():
                    (loss_fn(model, x[rows], y[rows]) / 2).backward()
            clip()
            opt.step()
            opt.zero_grad()
    del x, y, rows
    return seen, tensor_bytes_alive() - before


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# ------------------------------------------------------------- what each tool sends and holds
def tensor_bytes_alive() -> int:
    """Bytes of every distinct tensor storage alive in this process that Python can see (the
    garbage collector's tensors; a storage shared by views counted once). Collectives first:
    each gloo worker thread keeps the last collective's tensors until it runs another, so
    several small ones at once give every thread one of the same size each time."""
    for work in [dist.all_reduce(torch.zeros(1), async_op=True) for _ in range(4)]:
        work.wait()
    dist.barrier()
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and the deprecated
        # torch.distributed.reduce_op object warns on every attribute read
        if type(obj) in (torch.Tensor, nn.Parameter) or type(obj).__name__ == "FlatParameter":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# torch.distributed's collectives that the stock wrappers call from Python, by ledger name.
STOCK_OPS = {"all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


@contextlib.contextmanager
def stock_traffic():
    """Records every collective issued through torch.distributed inside the block as (op, bytes
    of the full tensor): an all-gather's output, a reduce-scatter's input, as minishard's ledger
    counts them. DDP's reducer calls C++ directly; run_ddp registers torch's own
    ``allreduce_hook``, which all-reduces each bucket through ``dist.all_reduce``."""
    seen, saved = [], {name: getattr(dist, name) for name in STOCK_OPS}

    def counting(name):
        def call(*args, **kwargs):
            first, second = (list(inspect.signature(saved[name]).bind(*args, **kwargs)
                                  .arguments.values()) + [None])[:2]
            full = second if name == "reduce_scatter_single" else first
            tensors = full if isinstance(full, (list, tuple)) else [full]
            seen.append((STOCK_OPS[name], sum(t.numel() * t.element_size() for t in tensors)))
            return saved[name](*args, **kwargs)
        return call

    for name in STOCK_OPS:
        setattr(dist, name, counting(name))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def minishard_traffic():
    """The same records from minishard's own ledger."""
    with minishard.ledger() as led:
        seen = []
        yield seen
    seen += [(e.op, e.numel * e.dtype.itemsize) for e in led.entries]


SMALL = 16  # bytes: the norms and flags that clipping all-reduces are left out of the counts


def traffic_summary(seen: list, world: int) -> tuple[dict[str, int], Fraction]:
    """({op: calls}, bytes sent per rank in the ring model) of the parameter-sized collectives."""
    big = [(op, b) for op, b in seen if b >= SMALL]
    calls = {op: sum(1 for o, _ in big if o == op) for op in dict.fromkeys(o for o, _ in big)}
    return calls, sum((comm.ring_bytes(op, b, world) for op, b in big), Fraction(0))


# ------------------------------------------------------------------------------ each tool
def run_minishard(stage: int):
    before = tensor_bytes_alive()
    model = minishard.ZeRO(fresh_model(), stage=stage, units={Block})
    seen, held = train(model, sgd(model.parameters()), model.no_sync,
                       lambda: model.clip_grad_norm_(MAX_NORM), minishard_traffic, before)
    return model.full_state_dict(), seen, held  # full_state_dict: every rank, plain names


def run_ddp(zero_optimizer: bool):
    before = tensor_bytes_alive()
    model = DDP(fresh_model())
    model.register_comm_hook(None, allreduce_hook)  # what DDP does, through dist.all_reduce
    opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=LR,
                                   momentum=MOMENTUM)
           if zero_optimizer else sgd(model.parameters()))
    # DDP keeps full gradients on every rank: the local norm IS the global norm.
    seen, held = train(model, opt, model.no_sync,
                       lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                       stock_traffic, before)
    return named(model), seen, held


def run_fsdp1(strategy: ShardingStrategy):
    before = tensor_bytes_alive()
    model = FSDP(fresh_model(), sharding_strategy=strategy,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                 device_id=torch.device("cpu"))  # FSDP1 needs the device named to run on CPU
    seen, held = train(model, sgd(model.parameters()), model.no_sync,
                       lambda: model.clip_grad_norm_(MAX_NORM), stock_traffic, before)
    with FSDP.summon_full_params(model):  # minishard: with model.gathered():
        return named(model), seen, held


def run_fsdp2(reshard_after_forward: bool):
    before = tensor_bytes_alive()
    model = fresh_model()
    for block in model:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)

    @contextlib.contextmanager
    def no_sync():  # FSDP2 has no context manager: a flag on the module
        model.set_requires_gradient_sync(False)
        yield
        model.set_requires_gradient_sync(True)

    # The parameters are DTensors (Shard(0) over the ranks): clip_grad_norm_ reduces the norm
    # across ranks by itself.
    seen, held = train(model, sgd(model.parameters()), no_sync,
                       lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                       stock_traffic, before)
    return named(model), seen, held  # each DTensor parameter's full_tensor(): an all-gather


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


def padded(world: int) -> dict[str, int]:
    """Elements one pass over the parameters moves, by each tool's padding rule, from the
    unwrapped block's shapes: FSDP1 pads a unit's flat buffer to a multiple of N (and, with
    use_orig_params=True, each parameter to a 16-byte boundary: none needed here); minishard and
    FSDP2 pad each parameter's dim 0 to a multiple of N; DDP and ZeroRedundancyOptimizer move
    the parameters as they are."""
    shapes = [p.shape for p in Block().parameters()]
    per_block = sum(s.numel() for s in shapes)
    return {"plain": BLOCKS * per_block,
            "flat": BLOCKS * -(-per_block // world) * world,
            "dim0": BLOCKS * sum(-(-s[0] // world) * world * s[1:].numel() for s in shapes)}


# What one step (two micro-batches, the first under no_sync) sends, in passes over the
# parameters (a pass = one all-gather or reduce-scatter of all of them, (N-1)/N x 4 bytes per
# element; an all-reduce is two, a broadcast one), and each tool's padding (padded() above).
PASSES = {0: (2, "plain"), "DDP": (2, "plain"),  # one all-reduce after the last micro-batch
          1: (2, "dim0"), "DDP + ZeroRedundancyOptimizer": (3, "plain"),  # + broadcast of shards
          2: (2, "dim0"), "FSDP1 SHARD_GRAD_OP": (2, "flat"),  # one gather, one reduce-scatter
          "FSDP2 reshard_after_forward=False": (3, "dim0"),  # it reshards after EVERY backward
          3: (5, "dim0"), "FSDP1 FULL_SHARD": (5, "flat"), "FSDP2 fully_shard": (5, "dim0")}


def compare_costs(say, world: int, ours: dict, stocks: dict) -> None:
    """Bytes sent in the last step and bytes held after it, both sides of every row, measured;
    then the relations the options table states, asserted on the measurements."""
    sizes = padded(world)

    def expected(key) -> Fraction:
        passes, rule = PASSES[key]
        return passes * Fraction(world - 1, world) * 4 * sizes[rule]

    say(textwrap.fill(f"Measured on rank 0, the last step: bytes sent (ring model, collectives "
                      f"under {SMALL} bytes left out) and bytes of tensors held after it "
                      "(params, optimizer state and whatever the tool keeps; gradients set to "
                      "None):", 100))
    say(f"{'minishard':<10}{'sent':>7}{'held':>7}   {'stock equivalent':<36}{'sent':>7}{'held':>7}"
        "   collectives (ours | stock)")
    for stage, name, _ in PAIRS:
        (our_calls, our_sent), (calls, sent) = (traffic_summary(ours[stage][0], world),
                                                traffic_summary(stocks[name][0], world))
        assert our_sent == expected(stage) and sent == expected(name), (stage, name, our_sent,
                                                                         sent)
        say(f"stage {stage:<4}{float(our_sent):>7,.0f}{ours[stage][1]:>7,}   {name:<36}"
            f"{float(sent):>7,.0f}{stocks[name][1]:>7,}   {fmt_calls(our_calls)} | "
            f"{fmt_calls(calls)}")
    held = {k: v[1] for k, v in list(ours.items()) + list(stocks.items())}
    full_minus_shard = 4 * sizes["dim0"] * (world - 1) // world
    # Between steps: DDP keeps its gradient bucket, a full gradient (stage 0 frees its own;
    # each of its buffers ends with room for a stamp, 64 elements a block, and the one
    # all-reduce of them has its stamp made once, 64 more: checks.py's [Note: stamps]); the
    # stock stage-2 equivalents reshard after backward (they then hold what their stage 3
    # holds), where minishard's stage 2 keeps the full parameters.
    stamps = 4 * comm.SUM_STAMP_NUMEL * (BLOCKS + 1)
    assert held["DDP"] - held[0] == 4 * sizes["plain"] - stamps, held
    assert held["FSDP1 SHARD_GRAD_OP"] == held["FSDP1 FULL_SHARD"], held
    assert held["FSDP2 reshard_after_forward=False"] == held["FSDP2 fully_shard"], held
    # A gather's stamp is made once and kept (STAMP_BYTES): stage 2 gathers every block in one
    # all-gather (one stamp), stage 3 each block on its own (BLOCKS; none on one rank, where a
    # stage-3 shard is the whole parameter and nothing is gathered).
    stamps_2_less_3 = comm.STAMP_BYTES * (1 - (BLOCKS if world > 1 else 0))
    assert held[2] - held[3] == full_minus_shard + stamps_2_less_3, (held, full_minus_shard)
    say(textwrap.fill(
        "Asserted on these numbers: stage 0 sends what DDP sends, but DDP holds its gradient "
        f"bucket between steps (+{4 * sizes['plain']:,} B = 4Ψ, less the {stamps:,} B of "
        "stage 0's stamps); DDP + ZeroRedundancyOptimizer "
        "sends 3 passes where stage 1 sends 2; FSDP1 SHARD_GRAD_OP sends the passes stage 2 sends, "
        "FSDP2 with reshard_after_forward=False a third pass more (it reshards after the no_sync "
        "backward too, and gathers again); between steps both hold what their FULL_SHARD "
        f"holds, while minishard's stage 2 holds {full_minus_shard:,} B more than its stage 3 "
        f"(the full parameters; {stamps_2_less_3:+,} B of kept stamps); stage 3 and both FULL_SHARDs send 5 passes (2 gathers per "
        "micro-batch, 1 reduce-scatter), and stage 3 sends exactly what FSDP2 sends (the same "
        "layout: every parameter's dim 0 padded to a multiple of N). Where the passes agree, "
        + (f"FSDP1 sends less when N does not divide the rows: {sizes['flat']:,} elements a pass "
           f"against {sizes['dim0']:,} (it pads the end of each flat buffer)."
           if sizes["flat"] < sizes["dim0"] else
           f"FSDP1 sends as many here: {sizes['flat']:,} elements a pass."),
        100) + "\n")


def fmt_calls(calls: dict[str, int]) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
    return " ".join(f"{short[op]}x{n}" for op, n in calls.items()) or "-"


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
    stocks = {}
    for stage, name, run in PAIRS:
        stock = stocks[name] = run()
        d_pair, d_ours, d_stock = (max_diff(ours[stage][0], stock[0]),
                                   max_diff(ours[stage][0], want), max_diff(stock[0], want))
        say(f"stage {stage:<6}{name:<36}{d_pair:>15.1e}{d_ours:>17.1e}{d_stock:>18.1e}")
        assert d_pair < TOL and d_ours < TOL and d_stock < TOL, (stage, name, d_pair, d_ours,
                                                                 d_stock)
    say(f"\nEvery pair ended with equal parameters (< {TOL:g}), and equal to one process on the "
        "global batch.\n")
    compare_costs(say, world, {stage: run[1:] for stage, run in ours.items()},
                  {name: run[1:] for name, run in stocks.items()})
    say("The same options in each tool:\n")
    say(options_table())
    say("All assertions held.")


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session({1, 2, 3, 4, 6}, why=f"a batch of {GLOBAL_BATCH} in 2 "
                                  "micro-batches per rank") as (rank, world):
        main(rank, world)
