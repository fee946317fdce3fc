"""Each ZeRO stage against the stock PyTorch implementation of the same idea.

    stage 0  <->  torch.nn.parallel.DistributedDataParallel
    stage 1  <->  DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    stage 2  <->  FSDP1 SHARD_GRAD_OP, FSDP2 fully_shard(reshard_after_forward=False)
    stage 3  <->  FSDP1 FULL_SHARD,    FSDP2 fully_shard()

Both sides get the same model (same seed), the same optimizer and the same per-rank batches (each
rank its own rows), for 3 steps. Units are mirrored: units={Block} <-> FSDP1
ModuleWrapPolicy({Block}) / FSDP2 fully_shard on each Block then the root; "nested" (Blocks and
each Block's ``sq``) <-> the same predicate as an FSDP1 lambda policy / fully_shard on each sq,
each Block, then the root.
After every step the engine's full tensors are compared with the stock side's GATHERED full tensors
(DDP/ZeroRedundancyOptimizer: the module's parameters, identical on every rank; FSDP1: the
FULL_STATE_DICT state dict; FSDP2: ``DTensor.full_tensor()``), never with local shards.

Tolerance: atol 1e-6, rtol 1e-5. Both sides compute the same per-rank gradients; only the order of
the reduction's additions and divisions differs (e.g. DDP divides before summing).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from hypothesis import assume, given, settings, strategies as st
from torch import nn

from minishard import ZeRO
from test_zero import (OPTIMIZERS, Block, batch, build, loss_fn, make_opt, mismatches, rows_of,
                       specs, unit_arg)

TIGHT = dict(atol=1e-6, rtol=1e-5)
_MESH = {}


def _is_unit(units):
    pred = unit_arg(units)
    if pred is None:
        return lambda m: False
    if isinstance(pred, set):
        return lambda m: isinstance(m, tuple(pred))
    return pred


def _ddp(net, opt_name, units):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net)
    return model, make_opt(opt_name, model.parameters()), \
        lambda: {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _zero_redundancy(net, opt_name, units):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    return model, opt, \
        lambda: {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _fsdp1(strategy_name, net, opt_name, units):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
    policy = None
    if units == "blocks":
        policy = ModuleWrapPolicy({Block})
    elif units == "nested":
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_unit(units))
    model = FSDP(net, sharding_strategy=getattr(ShardingStrategy, strategy_name),
                 auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    opt = make_opt(opt_name, model.parameters())

    def full():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, opt, full


def _fsdp2(reshard, net, opt_name, units):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    n = dist.get_world_size()
    if n not in _MESH:
        _MESH[n] = init_device_mesh("cpu", (n,))
    is_unit = _is_unit(units)
    # innermost first, as FSDP2 requires (post-order: children before parents)
    for m in reversed(list(net.modules())):
        if m is not net and is_unit(m):
            fully_shard(m, mesh=_MESH[n], reshard_after_forward=reshard)
    fully_shard(net, mesh=_MESH[n], reshard_after_forward=reshard)
    opt = make_opt(opt_name, net.parameters())

    def full():  # parameters (DTensors, gathered) AND buffers (plain tensors, replicated)
        out = {k: p.full_tensor().detach().clone() for k, p in net.named_parameters()}
        out.update({k: b.detach().clone() for k, b in net.named_buffers()})
        return out
    return net, opt, full


STOCK = {
    "ddp": _ddp,
    "zero_redundancy": _zero_redundancy,
    "fsdp1_shard_grad_op": functools.partial(_fsdp1, "SHARD_GRAD_OP"),
    "fsdp1_full_shard": functools.partial(_fsdp1, "FULL_SHARD"),
    "fsdp2_no_reshard": functools.partial(_fsdp2, False),
    "fsdp2": functools.partial(_fsdp2, True),
}


def vs_stock(spec, stage, units, stock, opt_name, per_rank, steps=3):
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    opt = make_opt(opt_name, model.parameters())
    other, other_opt, other_full = STOCK[stock](build(spec), opt_name, units)
    bad = []
    for step in range(steps):
        xg, yg = batch(spec, step, n * per_rank)
        x, y = rows_of(xg, per_rank), rows_of(yg, per_rank)
        for m, o in ((model, opt), (other, other_opt)):
            loss_fn(m(x), y).backward()
            o.step()
            o.zero_grad()
        ref = with_aliases(other_full(), spec)
        got = model.full_state_dict()
        # every key of the plain module's state dict, on both sides: none skipped
        bad += mismatches(got, ref, f"{stock} step {step}", **TIGHT)
    return bad


def with_aliases(state: dict, spec: dict) -> dict:
    """A stock side's full tensors under every name the plain module's ``state_dict()`` has: a
    side that lists a tied weight once (FSDP's named_parameters) gets its other names filled from
    the SAME tensor; nothing else is added, so a missing buffer or parameter stays missing."""
    plain = build(spec)
    first: dict[int, str] = {}
    out = dict(state)
    for name, p in plain.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if name not in out and canonical in out:
            out[name] = out[canonical]
    return out


def _check(pools, world, spec, stage, units, stock, opt_name, per_rank):
    results = pools(world).run(vs_stock, spec, stage, units, stock, opt_name, per_rank)
    assert results == [[]] * world, results


common = dict(world=st.sampled_from((2, 3, 4)), opt_name=st.sampled_from(["sgd", "adam", "adamw"]),
              per_rank=st.integers(2, 4))


@settings(max_examples=10)
@given(spec=specs(), units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage0_matches_ddp(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 0, units, "ddp", opt_name, per_rank)


@settings(max_examples=10)
@given(spec=specs(), units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage1_matches_zero_redundancy_optimizer(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 1, units, "zero_redundancy", opt_name, per_rank)


# FSDP cannot share a parameter between two of its units, so ties stay inside the root here
fsdp_specs = specs(ties=(None, "embed"))


@settings(max_examples=8)
@given(spec=fsdp_specs, units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage2_matches_fsdp1_shard_grad_op(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 2, units, "fsdp1_shard_grad_op", opt_name, per_rank)


@settings(max_examples=8)
@given(spec=fsdp_specs, units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage2_matches_fsdp2_without_reshard(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 2, units, "fsdp2_no_reshard", opt_name, per_rank)


@settings(max_examples=8)
@given(spec=fsdp_specs, units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage3_matches_fsdp1_full_shard(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 3, units, "fsdp1_full_shard", opt_name, per_rank)


@settings(max_examples=8)
@given(spec=fsdp_specs, units=st.sampled_from([None, "blocks", "nested"]), **common)
def test_stage3_matches_fsdp2(pools, spec, world, units, opt_name, per_rank):
    _check(pools, world, spec, 3, units, "fsdp2", opt_name, per_rank)
