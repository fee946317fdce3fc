"""Training-grade features of the ZeRO engine, each against an independent oracle.

    mixed precision   vs FSDP1 / FSDP2 with the same bf16 policy, vs a single-process fp32-master
                      bf16 oracle, the bf16 rounding bound of the gradient average, and the
                      Ledger's dtypes and bytes (gathers move param_dtype, reductions reduce_dtype)
    clip_grad_norm_   vs torch.nn.utils.clip_grad_norm_ on the unsharded model, global batch
    accumulation      no_sync() and plain repeated backward vs one big batch; no reductions inside
                      no_sync; full grads held inside it, shard grads outside
    prefetch          bitwise the same numbers and the same Ledger; stage-3 peak within bounds
    checkpointing     torch.utils.checkpoint inside (and around) a unit vs the oracle

The oracle is always the plain module trained in ONE process on the global batch (every rank's
micro-batches concatenated), so it shares no code with the engine. Every rank checks its own
view and the tests compare across ranks where that matters.

Tolerances: fp32 runs vs the oracle differ only by the order of floating-point sums (the
reductions average per rank, the oracle averages the whole batch): rtol 1e-4, atol 1e-5.
bf16 runs: no tolerance picked by eye; ``mixed_precision_matches_fsdp`` states what bf16 must
satisfy (bitwise where the arithmetic provably coincides, bf16's rounding bound elsewhere).
"""
from __future__ import annotations

import contextlib
import copy
import re
import unittest.mock
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import event, example, given, settings, strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minishard
from minishard import comm
from test_zero import numel, padded  # the layout oracle: FSDP2's dim-0 cut, from shapes alone

BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = {"bf16": BF16, "fp32": FP32}
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _examples(fraction: float) -> int:
    """A share of the active hypothesis profile's budget (ci: 25), for the expensive properties."""
    return max(2, round(settings().max_examples * fraction))


# ---------------------------------------------------------------------------------- the model
class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    """A residual block; with ``ckpt="inner"`` its forward checkpoints its MLP."""

    def __init__(self, width: int, hidden: int, ckpt: str = "none") -> None:
        super().__init__()
        self.norm, self.mlp, self.ckpt = nn.LayerNorm(width), MLP(width, hidden), ckpt

    def forward(self, x):
        h = self.norm(x)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.ckpt == "inner" else self.mlp(h)
        return x + h


class Net(nn.Module):
    """stem -> blocks -> head. Options:
    tie     "none" | "stem_head" (head.weight IS stem.weight: one unit, two users)
            | "across" (the last block's fc1.weight IS the first block's: owned by the root unit)
    frozen  "none" | "stem" | "block" (one block's fc2 has requires_grad=False)
    ckpt    "none" | "inner" (each block checkpoints its MLP) | "outer" (the root checkpoints
            each whole block, so a unit's own hooks run again during backward)
    early_stop  checkpoint's default stops recomputing once it has every saved tensor, so an
            outer-checkpointed unit's post-forward hook never runs in backward; False runs
            the whole recomputation, post-forward hook included
    buffer  a non-BatchNorm float buffer used in forward (mixed precision casts it)
    """

    def __init__(self, width, hidden, blocks, tie="none", frozen="none", ckpt="none",
                 buffer=False, early_stop=True) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, hidden, ckpt) for _ in range(blocks))
        self.head = nn.Linear(width, width)
        self.outer_ckpt, self.early_stop = ckpt == "outer", early_stop
        if tie == "stem_head":
            self.head.weight = self.stem.weight
        elif tie == "across":
            self.blocks[-1].mlp.fc1.weight = self.blocks[0].mlp.fc1.weight
        if frozen == "stem":
            self.stem.requires_grad_(False)
        elif frozen == "block":
            self.blocks[1].mlp.fc2.requires_grad_(False)
        if buffer:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        else:
            self.scale = None

    def forward(self, x):
        with set_checkpoint_early_stop(self.early_stop):
            x = self.stem(x)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.outer_ckpt else block(x)
            if self.scale is not None:
                x = x * self.scale
            return self.head(x)


def make_model(cfg: dict) -> Net:
    torch.manual_seed(cfg["seed"])
    return Net(cfg["width"], cfg["hidden"], cfg["blocks"], cfg.get("tie", "none"),
               cfg.get("frozen", "none"), cfg.get("ckpt", "none"), cfg.get("buffer", False),
               cfg.get("early_stop", True))


def _is_mlp(module: nn.Module) -> bool:
    return isinstance(module, MLP)


UNITS = {
    "block": {Block},          # one unit per block (+ the root: stem, head, shared weights)
    "nested": {Block, MLP},    # a block's MLP is a unit inside the block's unit
    "mlp_predicate": _is_mlp,  # units chosen by a predicate
    "whole": None,             # the whole model is one unit
}


def make_data(cfg: dict, ws: int, steps: int, micro: int = 1):
    """Per step, inputs and targets of shape (ws, micro, batch, width): rank r's j-th micro-batch
    is [r, j]; the global batch of the step is all of it."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (ws, micro, cfg["batch"], cfg["width"])
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(steps)]


def loss_fn(out, y):
    return F.mse_loss(out.float(), y)


def flat_batch(t):
    return t.reshape(-1, t.shape[-1])


def oracle_train(base: nn.Module, data, make_opt, clip=None):
    """The plain module, one process, the global batch. ``clip=(frac, norm_type)`` clips with
    max_norm = frac * (the unclipped norm). Returns (module, losses, norms, max_norms)."""
    model = copy.deepcopy(base)
    opt = make_opt(model.parameters())
    losses, norms, max_norms = [], [], []
    for x, y in data:
        loss = loss_fn(model(flat_batch(x)), flat_batch(y))
        loss.backward()
        if clip is not None:
            frac, norm_type = clip
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            max_norms.append(frac * torch.nn.utils.get_total_norm(grads, norm_type).item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norms[-1],
                                                        norm_type))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, losses, norms, max_norms


def sgd(lr=0.1):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def adam(lr=1e-2, eps=1e-8):
    return lambda params: torch.optim.Adam(params, lr=lr, eps=eps)


# Adam with eps=1e-3 for the bf16 comparisons: with the default 1e-8 Adam's first step is
# lr * sign(g), so a gradient that bf16 summation order rounds to exactly 0 on one side and to
# +-1e-4 on the other moves that element by a full lr (observed: 0.0100 at ws 4, lr 1e-2).
BF16_ADAM = adam(lr=1e-2, eps=1e-3)


def param_names(module: nn.Module) -> list[str]:
    """Every name a parameter is reachable by (tied weights: all of them), as state_dict has."""
    return [n for n, _ in module.named_parameters(remove_duplicate=False)]


def assert_params_close(got: dict, oracle: nn.Module, **tol) -> float:
    """``got`` (a full state dict) against the oracle's parameters; returns the max |diff|."""
    want = oracle.state_dict()
    worst = 0.0
    for name in param_names(oracle):
        torch.testing.assert_close(got[name].float(), want[name].float(), **tol,
                                   msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, (got[name].float() - want[name].float()).abs().max().item())
    return worst


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k] - b[k]).abs().max()}"


def ledger_summary(led: comm.Ledger) -> dict:
    """Per op: (calls, elements, bytes sent), exact."""
    return {op: (led.count(op), led.numel(op), led.total_bytes(op))
            for op in sorted({e.op for e in led.entries})}


def train_zero(base, cfg, stage, data, make_opt, **zero_kwargs):
    """Wrap a copy of ``base`` (units: cfg["units"], default per block) and train one step per
    element of ``data`` (one micro-batch each). Returns (model, optimizer, losses, output
    dtypes, ledger)."""
    rank = dist.get_rank()
    model = minishard.ZeRO(copy.deepcopy(base), stage=stage,
                           units=UNITS[cfg.get("units", "block")], **zero_kwargs)
    opt = make_opt(model.parameters())
    losses, out_dtypes = [], []
    with comm.ledger() as led:
        for x, y in data:
            out = model(x[rank, 0])
            out_dtypes.append(out.dtype)
            loss = loss_fn(out, y[rank, 0])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return model, opt, losses, out_dtypes, led


def _global_loss(local_losses):
    """The mean over ranks of each step's local loss (= the global-batch loss: equal batches)."""
    t = torch.stack([l.double() for l in local_losses])
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)  # an oracle-side collective, outside any ledger
    return torch.stack(gathered).mean(0)


# --------------------------------------------------------------------------- 1. mixed precision
def _fsdp1(module, stage, ws):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    strategy = {0: ShardingStrategy.NO_SHARD, 1: ShardingStrategy.SHARD_GRAD_OP,
                2: ShardingStrategy.SHARD_GRAD_OP, 3: ShardingStrategy.FULL_SHARD}[stage]
    return FSDP(module, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16,
                                               buffer_dtype=BF16),
                device_id=torch.device("cpu"), use_orig_params=True)


def _fsdp1_full_params(model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().float().clone()
                for n, p in model.named_parameters()}


def _fsdp2(module, stage, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    for block in module.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    return module


def _fsdp2_full_params(model) -> dict:
    return {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}


def _fsdp1_grads(model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        # (FSDP1 gives a frozen parameter in a flat parameter with trainable ones a zero grad)
        return {n.replace("_fsdp_wrapped_module.", ""): p.grad.detach().float().clone()
                for n, p in model.named_parameters() if p.grad is not None and p.requires_grad}


def _fsdp2_grads(model) -> dict:
    return {n: p.grad.full_tensor().detach().float().clone()
            for n, p in model.named_parameters() if p.grad is not None and p.requires_grad}


def _zero_grads(model) -> dict:
    """The engine's reduced (fp32 master) gradients under the original names; frozen ones out."""
    from test_differential import grads_by_name
    grads = grads_by_name(model)
    return {n: g for n, g in grads.items() if n in model.param_names and not torch.isnan(g).all()}


def _zero_bf16(module, stage, ws):
    policy = minishard.MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16)
    return minishard.ZeRO(module, stage=stage, units=UNITS["block"], mixed_precision=policy)


BF16_RUNS = {  # name: (wrap, full parameters, full gradients)
    "zero": (_zero_bf16, lambda m: {n: t.float() for n, t in m.full_state_dict().items()},
             _zero_grads),
    "fsdp1": (_fsdp1, _fsdp1_full_params, _fsdp1_grads),
    "fsdp2": (_fsdp2, _fsdp2_full_params, _fsdp2_grads),
}


def _train_bf16(name, base, stage, data, make_opt):
    """One of BF16_RUNS, 3 steps. Returns (first step's gradients, full params after each step,
    local losses, output dtypes)."""
    wrap, full_params, full_grads = BF16_RUNS[name]
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = wrap(copy.deepcopy(base), stage, ws)
    opt = make_opt(model.parameters())
    first_grads, params, losses, out_dtypes = None, [], [], []
    for x, y in data:
        out = model(x[rank, 0])
        out_dtypes.append(out.dtype)
        loss = loss_fn(out, y[rank, 0])
        loss.backward()
        if first_grads is None:
            first_grads = full_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append(full_params(model))
    return first_grads, params, losses, out_dtypes


def plain_bf16_step0(base, x, y):
    """What ONE rank computes before any reduction: the plain module cast to bf16 (parameters,
    buffers, input), the loss in fp32, one backward. Gradients by every parameter name."""
    model = copy.deepcopy(base).to(BF16)
    loss = loss_fn(model(x.to(BF16)), y)
    loss.backward()
    names = dict(base.named_parameters())
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None
            and n in names}, loss.detach()


def _ranks_stacked(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())  # an oracle-side collective, outside any ledger
    return torch.stack(out)


def fp32_master_bf16_oracle(base, data, make_opt):
    """Single process, global batch, the standard fp32-master recipe in plain torch: the
    optimizer owns fp32 parameters; every step casts them to a bf16 copy, which computes the
    forward and backward; its bf16 gradients, cast to fp32, are the masters' gradients."""
    master = copy.deepcopy(base)
    opt = make_opt(master.parameters())
    losses = []
    for x, y in data:
        compute = copy.deepcopy(master).to(BF16)
        loss = loss_fn(compute(flat_batch(x).to(BF16)), flat_batch(y))
        loss.backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = None if c.grad is None else c.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return master, losses


U_BF16 = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, round to nearest


def mixed_precision_matches_fsdp(cfg: dict, stage: int, steps: int = 3):
    """What a bf16 run (param_dtype = reduce_dtype = bf16, fp32 masters) must satisfy:

    1. its local computation is the plain module's in bf16: each rank's step-0 loss is bitwise
       the plain bf16 module's on its rows, and the outputs are bf16;
    2. its reduction is the AVERAGE of the ranks' bf16 gradients g_r, up to the rounding of a
       bf16 sum in some order (Higham): per element
           |g - mean_r g_r| <= (gamma_{N-1} + u) * mean_r |g_r| + 2u |mean_r g_r|
       (u = 2^-8, gamma_k = ku/(1-ku); the extra u: local accumulation order of a tied weight;
       2u: the division and the cast). FSDP1 and FSDP2 must meet the same bound (the bound is
       about bf16, not about us);
    3. with the same policy it IS FSDP1 and FSDP2 where their arithmetic provably coincides:
       at 1 and 2 ranks (one order for a sum of two; a division by 2 is exact) parameters and
       losses of all 3 Adam steps are bitwise equal. At 3-4 ranks the order of the bf16 sum
       differs, so after the first step the parameters differ by at most Adam's Lipschitz
       constant lr/eps (first step: update = lr g/(|g|+eps)) times the measured gradient
       difference, plus fp32 rounding; later steps are not compared (the runs diverge);
    4. at 1 rank the whole run is bitwise the fp32-master bf16 single-process oracle on the
       global batch (``fp32_master_bf16_oracle``), which shares no code with the engine."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    runs = {name: _train_bf16(name, base, stage, data, BF16_ADAM) for name in BF16_RUNS}
    names = set(dict(base.named_parameters()))
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    for name, (grads, params, _, out_dtypes) in runs.items():
        assert out_dtypes == [BF16] * steps, (name, out_dtypes)
        assert set(grads) == trainable, (name, sorted(set(grads) ^ trainable))
        keys = set(base.state_dict()) if name == "zero" else names  # FSDP: each tensor once
        for p in params:
            assert set(p) == keys, (name, sorted(set(p) ^ keys))
    # 1. local computation
    local_grads, local_loss = plain_bf16_step0(base, data[0][0][rank, 0], data[0][1][rank, 0])
    assert torch.equal(runs["zero"][2][0], local_loss), (runs["zero"][2][0], local_loss)
    # 2. the reduction
    gamma = (ws - 1) * U_BF16 / (1 - (ws - 1) * U_BF16)
    worst = {}
    for n in sorted(trainable):
        each = _ranks_stacked(local_grads[n]).double()
        mean, size = each.mean(0), each.abs().mean(0)
        bound = (gamma + U_BF16) * size + 2 * U_BF16 * mean.abs()
        for name, (grads, *_) in runs.items():
            err = (grads[n].double() - mean).abs()
            assert (err <= bound).all(), \
                f"{name} {n}: reduced gradient {(err - bound).max():.3g} beyond the bf16 bound"
            worst[name] = max(worst.get(name, 0.0), (err / bound.clamp_min(1e-30)).max().item())
    # 3. FSDP1 and FSDP2
    _, mine, my_losses, _ = runs["zero"]
    for name in ("fsdp1", "fsdp2"):
        their_grads, theirs, their_losses, _ = runs[name]
        if ws <= 2:
            for step in range(steps):
                for n in names:
                    assert torch.equal(mine[step][n], theirs[step][n]), \
                        (name, step, n, (mine[step][n] - theirs[step][n]).abs().max())
            assert torch.equal(torch.stack(my_losses), torch.stack(their_losses)), name
        else:
            lr, eps = 1e-2, 1e-3  # BF16_ADAM
            assert torch.equal(my_losses[0], their_losses[0]), name  # same parameters
            for n in names:
                dg = (runs["zero"][0][n] - their_grads[n]).abs() if n in trainable else 0.0
                dp = (mine[0][n] - theirs[0][n]).abs()
                assert (dp <= lr / eps * dg + 1e-6).all(), (name, n, dp.max())
    # 4. one rank: the fp32-master bf16 oracle, bitwise
    if ws == 1:
        oracle, oracle_losses = fp32_master_bf16_oracle(base, data, BF16_ADAM)
        want = oracle.state_dict()
        for n in names:
            assert torch.equal(mine[-1][n], want[n]), (n, (mine[-1][n] - want[n]).abs().max())
        assert torch.equal(torch.stack(my_losses), torch.stack(oracle_losses))
    return worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.16))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["none", "stem_head"]), frozen=st.sampled_from(["none", "block"]),
       seed=st.integers(0, 2**16))
def test_bf16_matches_fsdp1_and_fsdp2_and_tracks_fp32(pools, ws, stage, width, hidden, blocks,
                                                       batch, tie, frozen, seed):
    """stage 3 <-> FULL_SHARD / reshard_after_forward=True; 1, 2 <-> SHARD_GRAD_OP /
    reshard_after_forward=False; 0 <-> NO_SHARD. Same bf16 policy, 3 Adam steps. What is
    asserted: ``mixed_precision_matches_fsdp``'s four properties."""
    cfg = dict(width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie, frozen=frozen,
               seed=seed)
    event(f"world size {ws}")
    reports = pools(ws).run(mixed_precision_matches_fsdp, cfg, stage)
    assert len({str(r) for r in reports}) == 1  # every rank saw the same full parameters


UNIT_PATHS = {  # the units' module paths in ``Net`` (the root, "", is always one)
    "block": lambda b: [f"blocks.{i}" for i in range(b)],
    "nested": lambda b: [f"blocks.{i}{s}" for i in range(b) for s in ("", ".mlp")],
    "mlp_predicate": lambda b: [f"blocks.{i}.mlp" for i in range(b)],
    "whole": lambda b: [],
}


def expected_flats(cfg: dict) -> list[tuple[bool, list[torch.Size]]]:
    """(requires_grad, parameter shapes) of every flat buffer, from the UNWRAPPED model and the
    design's rule: a parameter belongs to the innermost unit containing every name it has; a unit
    keeps one buffer per requires_grad (one dtype here)."""
    base = make_model(cfg)
    units = [""] + UNIT_PATHS[cfg.get("units", "block")](cfg["blocks"])
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    flats: dict[tuple[str, bool], list[torch.Size]] = {}
    for pid, ns in names.items():
        owner = max((u for u in units if all(u == "" or n.startswith(u + ".") for n in ns)),
                    key=len)
        flats.setdefault((owner, params[pid].requires_grad), []).append(params[pid].shape)
    return [(rg, shapes) for (_, rg), shapes in flats.items()]


def expected_ledger(cfg: dict, stage: int, ws: int, steps: int) -> dict:
    """op -> (calls, elements) over ``steps`` steps from wrapping, by the stage table: stage 0
    one all-reduce per step of every trainable element (these models are far below the 4 MiB
    bucket); 1 one coalesced reduce-scatter per step, 2 one per trainable buffer, both with each
    parameter's rows padded to a multiple of ws (test_zero.padded), and a coalesced gather of
    every buffer (frozen ones too) at each step's forward; 3 two all-gathers of every buffer per step (forward,
    backward) and one reduce-scatter of each trainable one."""
    flats = expected_flats(cfg)
    pad = lambda shapes: padded(shapes, ws)
    trainable = [n for rg, n in flats if rg]
    if stage == 0:
        return {"all_reduce": (steps, steps * sum(map(numel, trainable)))}
    if stage in (1, 2):
        calls = steps if stage == 1 else steps * len(trainable)
        return {"reduce_scatter": (calls, steps * sum(map(pad, trainable))),
                "all_gather": (steps, steps * sum(pad(n) for _, n in flats))}
    return {"all_gather": (2 * steps * len(flats), 2 * steps * sum(pad(n) for _, n in flats)),
            "reduce_scatter": (steps * len(trainable), steps * sum(map(pad, trainable)))}


RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # the design's cost model


def mixed_precision_dtypes_and_bytes(cfg: dict, stage: int, param_dtype: str | None,
                                     reduce_dtype: str | None, steps: int = 3):
    ws = dist.get_world_size()
    pdtype, rdtype = DTYPES.get(param_dtype), DTYPES.get(reduce_dtype)
    compute = pdtype or FP32
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    policy = minishard.MixedPrecision(param_dtype=pdtype, reduce_dtype=rdtype, buffer_dtype=BF16)
    model, opt, _, out_dtypes, led = train_zero(base, cfg, stage, data, adam(),
                                                mixed_precision=policy)
    assert out_dtypes == [compute] * steps
    # the optimizer's world stays fp32: master shards, their grads, Adam's moments
    assert all(p.dtype == FP32 for p in model.parameters())
    for p in model.parameters():
        for v in opt.state[p].values():
            assert not v.is_floating_point() or v.dtype == FP32
    # non-BatchNorm float buffers are kept in buffer_dtype
    assert model.module.scale.dtype == BF16
    # gathers move param_dtype, reductions run in reduce_dtype (default: the compute dtype, as
    # FSDP); calls and elements are the stage table's, bytes the ring model's at that size
    reduce_in = rdtype or compute
    dtype_of = {"all_gather": compute, "all_reduce": reduce_in, "reduce_scatter": reduce_in}
    want = {op: ce for op, ce in expected_ledger(cfg, stage, ws, steps).items() if ce[0]}
    got = {op: (led.count(op), led.numel(op)) for op in sorted({e.op for e in led.entries})}
    assert got == want, (got, want, led.table())
    for op, (_, numel) in want.items():
        assert all(e.dtype == dtype_of[op] for e in led.entries if e.op == op), led.table()
        size = torch.empty((), dtype=dtype_of[op]).element_size()
        assert led.total_bytes(op) == Fraction(RING[op] * (ws - 1) * numel * size, ws), \
            (op, led.table())
    return float(led.total_bytes())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.3))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]),
       param_dtype=st.sampled_from(["bf16", "bf16", None]),
       reduce_dtype=st.sampled_from(["bf16", "fp32", None]), units=st.sampled_from(sorted(UNITS)),
       seed=st.integers(0, 2**16))
def test_bf16_ledger_gathers_half_the_bytes_and_reduces_in_reduce_dtype(
        pools, ws, stage, width, hidden, blocks, batch, tie, frozen, param_dtype, reduce_dtype,
        units, seed):
    """Ledger of a mixed-precision run: gathers in param_dtype, reductions in reduce_dtype, the
    calls and elements of the stage table and the ring model's bytes at those sizes, computed
    from the unwrapped model (never from another engine run); fp32 master shards and Adam
    state."""
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed, buffer=True)
    event(f"world size {ws}")
    totals = pools(ws).run(mixed_precision_dtypes_and_bytes, cfg, stage, param_dtype,
                           reduce_dtype)
    assert len(set(totals)) == 1


# ---------------------------------------------------------------------------- 2. clip_grad_norm_
def clip_matches_torch(cfg: dict, stage: int, norm_type: float, frac: float, steps: int = 2):
    ws, rank = dist.get_world_size(), dist.get_rank()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    oracle, _, oracle_norms, max_norms = oracle_train(base, data, sgd(), clip=(frac, norm_type))
    model = minishard.ZeRO(copy.deepcopy(base), stage=stage, units=UNITS[cfg["units"]])
    opt = sgd()(model.parameters())
    norms = []
    for (x, y), max_norm, want in zip(data, max_norms, oracle_norms):
        loss_fn(model(x[rank, 0]), y[rank, 0]).backward()
        with comm.ledger() as led:
            norm = model.clip_grad_norm_(max_norm, norm_type)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-7)
        # one all-reduce of one number, except stage 0 (identical full grads: none)
        assert [(e.op, e.numel) for e in led.entries] == ([] if stage == 0 else
                                                          [("all_reduce", 1)])
        opt.step()
        opt.zero_grad()
        norms.append(norm.item())
    assert_params_close(model.full_state_dict(), oracle, **FP32_TOL)
    return norms


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.3))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["stem_head", "across"]), frozen=st.sampled_from(["stem", "block"]),
       norm_type=st.sampled_from([2.0, 1.0, float("inf")]),
       frac=st.floats(0.05, 0.9) | st.floats(1.1, 4.0),
       units=st.sampled_from(sorted(UNITS)),
       seed=st.integers(0, 2**16))
def test_clip_grad_norm_matches_torch_on_the_unsharded_model(
        pools, ws, stage, width, hidden, blocks, batch, tie, frozen, norm_type, frac, units, seed):
    """A tied weight and a frozen layer are always present; max_norm is a multiple of the true
    norm: below 1 every step clips, above 1 no step may change the gradients (torch's
    ``min(1, max_norm / norm)``; an engine that always scales moves the weights off the oracle's).
    """
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed)
    event(f"world size {ws}")
    event("clipped" if frac < 1 else "left alone (norm below max_norm)")
    norms = pools(ws).run(clip_matches_torch, cfg, stage, norm_type, frac)
    assert all(n == norms[0] for n in norms)  # every rank returns the same global norm


# ---------------------------------------------------------------------- 3. gradient accumulation
def accumulation_matches_big_batch(cfg: dict, stage: int, micro: int, use_no_sync: bool,
                                   set_to_none: bool, prefetch: bool, steps: int = 2):
    ws, rank = dist.get_world_size(), dist.get_rank()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps, micro)
    oracle, _, _, _ = oracle_train(base, data, sgd())
    model = minishard.ZeRO(copy.deepcopy(base), stage=stage, units=UNITS[cfg["units"]],
                           prefetch=prefetch)
    opt = sgd()(model.parameters())
    grad_flats = sum(rg for rg, _ in expected_flats(cfg))  # one reduction each
    held = {"no_sync": [], "synced": []}
    for x, y in data:
        for j in range(micro):
            inside = use_no_sync and j < micro - 1
            with (model.no_sync() if inside else contextlib.nullcontext()):
                with comm.ledger() as fwd:
                    out = model(x[rank, j])
                loss = loss_fn(out, y[rank, j]) / micro
                with comm.ledger() as bwd:
                    loss.backward()
            if inside:
                ops = {e.op for e in fwd.entries + bwd.entries}
                assert not ops & set(REDUCTIONS), bwd.table()
                if stage < 3:  # full params live: the backward talks to nobody
                    assert bwd.entries == [], bwd.table()
                else:          # stage 3 must still re-gather the params it freed after forward
                    assert ops <= {"all_gather"}, bwd.table()
            else:
                # stages 0-1 coalesce every buffer's reduction into one (small models)
                assert bwd.count("all_reduce" if stage == 0 else "reduce_scatter") == \
                    (min(grad_flats, 1) if stage < 2 else grad_flats)
            held["no_sync" if inside else "synced"].append(model.memory_report()["grads"])
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)  # False: the next reduction adds into zeros
    assert_params_close(model.full_state_dict(), oracle, **FP32_TOL)
    if use_no_sync:
        for inside in held["no_sync"]:
            for after in held["synced"]:
                if stage == 0 or ws == 1:  # full grads either way (ws 1: the shard IS full)
                    assert inside == after or (not set_to_none and inside > after)
                else:
                    assert inside > after  # full grads kept vs shard grads
    else:
        assert len(set(held["synced"])) == 1  # always just the shard grads
    return held


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.3))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       micro=st.integers(2, 4), use_no_sync=st.booleans(), set_to_none=st.booleans(),
       prefetch=st.booleans(), tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]), units=st.sampled_from(sorted(UNITS)),
       seed=st.integers(0, 2**16))
def test_gradient_accumulation_equals_one_big_batch(pools, ws, stage, width, hidden, blocks,
                                                    batch, micro, use_no_sync, set_to_none,
                                                    prefetch, tie, frozen, units, seed):
    """(a) no_sync for micro-1 micro-batches, then one synced backward; (b) every backward
    reduces into the shard grad. Both equal one big batch; no reductions inside no_sync."""
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed)
    event(f"world size {ws}")
    pools(ws).run(accumulation_matches_big_batch, cfg, stage, micro, use_no_sync, set_to_none,
                  prefetch)


# ------------------------------------------------------------------------------------ 4. prefetch
def _unit_bytes(base: Net, ws: int, elem: int) -> tuple[int, int]:
    """(root unit, largest block unit) full bytes, from the model's structure alone: one flat per
    (unit, requires_grad), each parameter's rows padded to a multiple of ws; a weight tied
    across blocks belongs to the root."""
    def flats(params):
        return elem * (padded([p.shape for p in params if p.requires_grad], ws) +
                       padded([p.shape for p in params if not p.requires_grad], ws))

    in_blocks = [set(map(id, b.parameters())) for b in base.blocks]
    shared = {i for i in set.union(*in_blocks) if sum(i in s for s in in_blocks) > 1}
    root = [p for p in base.parameters() if id(p) not in set.union(*in_blocks) or id(p) in shared]
    blocks = [[p for p in b.parameters() if id(p) not in shared] for b in base.blocks]
    return flats(root), max(flats(b) for b in blocks)


def prefetch_changes_timing_not_numbers(cfg: dict, stage: int, bf16: bool, steps: int = 3):
    ws = dist.get_world_size()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    mp = minishard.MixedPrecision(param_dtype=BF16) if bf16 else None
    runs = {}
    for prefetch in (False, True):
        rank = dist.get_rank()
        model = minishard.ZeRO(copy.deepcopy(base), stage=stage, units=UNITS[cfg["units"]],
                               mixed_precision=mp, prefetch=prefetch)
        opt = adam()(model.parameters())
        losses, peaks = [], []
        with comm.ledger() as led:
            for x, y in data:
                loss = loss_fn(model(x[rank, 0]), y[rank, 0])
                loss.backward()
                peaks.append(model.memory_report()["peak_gathered_params"])
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        runs[prefetch] = (model.full_state_dict(), torch.stack(losses), led, peaks)
    (s0, l0, led0, _), (s1, l1, led1, peaks) = runs[False], runs[True]
    assert torch.equal(l0, l1)
    assert_equal_states(s0, s1)
    assert ledger_summary(led0) == ledger_summary(led1), f"{led0.table()}\n{led1.table()}"
    def entries(led):  # the two runs wrap two models: their tags differ in the model's number
        return sorted((e.op, re.sub(r" \(model \d+\)", "", e.tag), e.numel) for e in led.entries)
    assert entries(led0) == entries(led1)
    if stage == 3 and cfg["units"] == "block":
        root, largest = _unit_bytes(base, ws, 2 if bf16 else 4)
        assert max(peaks) <= root + 2 * largest, (peaks, root, largest)
        assert max(peaks) >= root + largest  # the accounting sees the gathers at all
    return runs[True][3], runs[False][3]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.3))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]), bf16=st.booleans(),
       units=st.sampled_from(sorted(UNITS)),
       seed=st.integers(0, 2**16))
def test_prefetch_is_bitwise_identical_same_bytes_bounded_peak(
        pools, ws, stage, width, hidden, blocks, batch, tie, frozen, bf16, units, seed):
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed)
    event(f"world size {ws}")
    pools(ws).run(prefetch_changes_timing_not_numbers, cfg, stage, bf16)


def bucketing_changes_calls_not_numbers(cfg: dict, stage: int, steps: int = 3):
    """Stages 0-2 coalesce reductions (0-1) and the forward's re-gathers (1-2) into
    collectives of about config.BUCKET_BYTES. With a 1-byte cap every buffer travels alone, with a
    huge one everything travels together; both must train like the oracle."""
    ws = dist.get_world_size()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    oracle, *_ = oracle_train(base, data, adam())
    calls = {}
    for cap in (1, 2**40):
        with unittest.mock.patch.object(minishard.zero.config, "BUCKET_BYTES", cap):
            model, _, _, _, led = train_zero(base, cfg, stage, data, adam())
        assert_params_close(model.full_state_dict(), oracle, **FP32_TOL)
        calls[cap] = (led.count("all_reduce" if stage == 0 else "reduce_scatter"),
                      led.count("all_gather"))
    trainable = sum(f.requires_grad for u in model.units for f in u.flats)
    buffers = sum(len(u.flats) for u in model.units)
    gathers = steps if stage in (1, 2) else 0  # every buffer, at each step's forward
    reduce_each = stage == 2  # stage 2 reduces each unit as soon as it is ready, to free it
    assert calls[1] == (steps * trainable, gathers * buffers), calls
    assert calls[2**40] == (steps * (trainable if reduce_each else 1), gathers), calls


@pytest.mark.parametrize("stage", [0, 1, 2])
@settings(max_examples=_examples(0.2))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]),
       units=st.sampled_from(sorted(UNITS)), seed=st.integers(0, 2**16))
def test_coalescing_changes_the_number_of_collectives_not_the_numbers(
        pools, ws, stage, width, hidden, blocks, batch, tie, frozen, units, seed):
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed)
    event(f"world size {ws}")
    pools(ws).run(bucketing_changes_calls_not_numbers, cfg, stage)


def bucket_bytes_changes_calls_not_numbers(cfg: dict, stage: int, prefetch: bool, bf16: bool,
                                           bucket: int, steps: int = 3):
    """``bucket_bytes`` (stages 2-3) moves several units per collective. A coalesced gather
    copies the same shards and a coalesced reduce-scatter adds each element's N values in the
    same rank order, so: the same bits, the same bytes per op, no more collectives (strictly
    fewer with an unbounded bucket and two buffers or more), and gathered parameters bounded
    by a bucket (or the largest unit, if larger) where they were bounded by one unit."""
    ws = dist.get_world_size()
    base = make_model(cfg)
    data = make_data(cfg, ws, steps)
    mp = minishard.MixedPrecision(param_dtype=BF16) if bf16 else None
    runs = {}
    for b in (0, bucket):
        model, _, losses, _, led = train_zero(base, cfg, stage, data, adam(), prefetch=prefetch,
                                              mixed_precision=mp, bucket_bytes=b)
        runs[b] = (model, torch.stack(losses), led)
    (m0, l0, led0), (m1, l1, led1) = runs[0], runs[bucket]
    assert torch.equal(l0, l1)
    assert_equal_states(m0.full_state_dict(), m1.full_state_dict())
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert led1.total_bytes(op) == led0.total_bytes(op), f"{op}\n{led0.table()}\n{led1.table()}"
        assert led1.count(op) <= led0.count(op), f"{op}\n{led0.table()}\n{led1.table()}"
    gathered_units = sum(1 for u in m1.units if u.flats)
    trainable = sum(f.requires_grad for u in m1.units for f in u.flats)
    if bucket >= 2**40 and ws > 1:  # the buckets were used: fewer collectives
        if stage == 3 and gathered_units >= 2:
            assert led1.count("all_gather") < led0.count("all_gather"), \
                f"{led0.table()}\n{led1.table()}"
        if trainable >= 2:
            assert led1.count("reduce_scatter") < led0.count("reduce_scatter"), \
                f"{led0.table()}\n{led1.table()}"
    if stage == 3 and cfg["units"] == "block":
        root, largest = _unit_bytes(base, ws, 2 if bf16 else 4)
        peak = m1.memory_report()["peak_gathered_params"]  # the last step's
        # one unit gathered at a time becomes one bucket (or one unit, if larger) at a time;
        # prefetch adds the next bucket while the last unit of the current one computes
        bound = root + max(largest, bucket) + (largest if prefetch else 0)
        assert peak <= bound, (peak, bound, root, largest)


@pytest.mark.parametrize("stage", [2, 3])
@settings(max_examples=_examples(0.2))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]), bf16=st.booleans(),
       prefetch=st.booleans(), bucket=st.sampled_from([1, 200, 1000, 2**40]),
       units=st.sampled_from(sorted(UNITS)), seed=st.integers(0, 2**16))
@example(ws=2, width=5, hidden=7, blocks=4, batch=2, tie="none", frozen="none", bf16=False,
         prefetch=False, bucket=200, units="block", seed=0)  # buckets of several small blocks
@example(ws=3, width=4, hidden=6, blocks=3, batch=2, tie="stem_head", frozen="stem", bf16=True,
         prefetch=True, bucket=2**40, units="block", seed=1)  # everything in one bucket
def test_bucket_bytes_changes_the_number_of_collectives_not_the_numbers(
        pools, ws, stage, width, hidden, blocks, batch, tie, frozen, bf16, prefetch, bucket,
        units, seed):
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, seed=seed)
    event(f"world size {ws}")
    pools(ws).run(bucket_bytes_changes_calls_not_numbers, cfg, stage, prefetch, bf16, bucket)


# ----------------------------------------------------------------------- 5. activation checkpoint
def checkpointing_matches_oracle(cfg: dict, stage: int, prefetch: bool, steps: int = 2):
    ws, rank = dist.get_world_size(), dist.get_rank()
    base = make_model(cfg)
    plain = make_model({**cfg, "ckpt": "none"})  # the same weights, no checkpointing
    data = make_data(cfg, ws, steps)
    oracle, oracle_losses, _, _ = oracle_train(base, data, sgd())
    model, _, losses, _, led = train_zero(base, cfg, stage, data, sgd(), prefetch=prefetch)
    assert_params_close(model.full_state_dict(), oracle, **FP32_TOL)
    torch.testing.assert_close(_global_loss(losses).float(), torch.stack(oracle_losses),
                               **FP32_TOL)
    # recomputation is the same arithmetic, and it gathers nothing more (stage 3: the unit is
    # still gathered for its backward when autograd recomputes it)
    ref, _, ref_losses, _, ref_led = train_zero(plain, cfg, stage, data, sgd(), prefetch=prefetch)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    assert_equal_states(model.full_state_dict(), ref.full_state_dict())
    assert ledger_summary(led) == ledger_summary(ref_led), f"{led.table()}\n{ref_led.table()}"
    return [l.item() for l in losses]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=_examples(0.3))
@given(ws=st.integers(1, 4), width=st.integers(3, 17),
       hidden=st.integers(3, 17), blocks=st.integers(2, 4), batch=st.integers(2, 4),
       ckpt=st.sampled_from(["inner", "outer"]), early_stop=st.booleans(),
       prefetch=st.booleans(), tie=st.sampled_from(["none", "stem_head", "across"]),
       frozen=st.sampled_from(["none", "stem", "block"]), units=st.sampled_from(sorted(UNITS)),
       seed=st.integers(0, 2**16))
def test_activation_checkpointing_inside_units_matches_oracle(
        pools, ws, stage, width, hidden, blocks, batch, ckpt, early_stop, prefetch, tie, frozen,
        units, seed):
    """inner: Block.forward checkpoints its MLP (the unit's hooks do not see the recompute);
    outer: the root checkpoints each whole Block, so the unit's forward hooks fire again
    inside backward (the post-forward one too without early stop) and must neither free nor
    re-gather."""
    cfg = dict(units=units, width=width, hidden=hidden, blocks=blocks, batch=batch, tie=tie,
               frozen=frozen, ckpt=ckpt, early_stop=early_stop, seed=seed)
    event(f"world size {ws}")
    pools(ws).run(checkpointing_matches_oracle, cfg, stage, prefetch)


# ------------------------------------------- reentrant checkpointing: a gradient in two parts
class ReentrantBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.sub = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))

    def forward(self, x):
        return torch.tanh(checkpoint(self.sub, x, use_reentrant=True))


def two_forwards_one_backward(stage: int, steps: int = 3) -> list[str]:
    """A siamese loss (two forwards, one backward) through units checkpointed the reentrant
    way: each forward's checkpointed part is backpropagated in a backward of its own, so a
    unit's gradient arrives in two parts; both must be reduced, as one process adds them."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    build = lambda: (torch.manual_seed(0), nn.Sequential(  # noqa: E731
        nn.Linear(5, 7), *[ReentrantBlock(7) for _ in range(3)], nn.Linear(7, 3)).double())[1]
    model, ref = minishard.ZeRO(build(), stage=stage, units={ReentrantBlock}), build()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        (x1, y1), (x2, y2) = [(torch.randn(2 * ws, 5, generator=gen, dtype=torch.float64),
                               torch.randn(2 * ws, 3, generator=gen, dtype=torch.float64))
                              for _ in range(2)]
        mine = lambda t: t[2 * rank:2 * rank + 2]  # noqa: E731
        (F.mse_loss(model(mine(x1)), mine(y1)) + 2 * F.mse_loss(model(mine(x2)), mine(y2))
         ).backward()
        (F.mse_loss(ref(x1), y1) + 2 * F.mse_loss(ref(x2), y2)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = model.full_state_dict(), ref.state_dict()
    return [f"rank {rank} {k}: {(got[k] - want[k]).abs().max().item():.3g}" for k in want
            if not torch.allclose(got[k], want[k], rtol=1e-9, atol=1e-11)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gradient_arriving_in_two_parts_is_reduced_whole(pools, stage):
    assert pools(2).run(two_forwards_one_backward, stage) == [[]] * 2
