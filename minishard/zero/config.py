"""Configuration: ``minishard.ZeRO``'s arguments in full, checked before any collective can hang.

The arguments beyond ``module`` and ``stage`` (engine.py's STAGES), each with where to read more:

units                   ``None`` (the whole module is one unit), a module class or a collection
                        of classes (every matching submodule is its own unit), or a predicate
                        ``fn(module) -> bool``. A parameter belongs to the innermost unit that
                        contains every module using it (build.py). Each unit is one collective
                        per gather and per reduction: [Note: units]
process_group / mesh    the ranks to shard over (default: all), or a ``DeviceMesh``: 1-D, the
                        same as its process group; 2-D (replicate, shard), hybrid sharding
                        ([Note: mesh], :func:`resolve_groups`)
mixed_precision         a :class:`MixedPrecision` (default: compute in the parameters' dtype)
prefetch                issue the next unit's all-gather while this one computes (``Gatherer``)
bucket_bytes            stages 2-3: move consecutive units together, up to about this many bytes
                        per collective ([Note: buckets]); 0 (the default): one per unit
param_groups            optimizer groups over the module's parameters before wrapping
                        (``[{"params": [...], "weight_decay": 0.0}, ...]``; [Note: param_groups])
find_unused_parameters  stages 0-2: a unit may get a gradient on SOME ranks only in a step (a
                        data-dependent branch): ``Reducer``, [Note: find_unused]. Without it
                        (default, as DDP), every rank must reach the same units in backward
replicate /             stages 1-3: parameters kept WHOLE on every rank, beside the sharded ones:
persist_below           every parameter a matching module (classes or a predicate, like
                        ``units``) owns directly, and every one of fewer than ``persist_below``
                        elements. Default 0: every parameter sharded. [Note: replicate]
device /                deferred init (deferred_init.py): where meta tensors are materialised
param_init_fn           (default: the current CUDA device if there is one, else the CPU), and
                        ``fn(module)`` initialising a module's OWN meta tensors (FSDP1's
                        argument; default: the module's ``reset_parameters()``)
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map

from minishard.verdicts import check_member, ranks_range

__all__ = ["MixedPrecision", "Groups", "resolve_groups", "check_arguments", "check_same_config",
           "param_group_index", "shard_param_groups", "cast_buffers", "cast_inputs",
           "BUCKET_BYTES"]

# [Note: units] Each unit is one collective per gather and per reduction: on gloo a collective
# costs a fixed amount of CPU per call on top of its bytes, so there units of several MiB train
# faster than many small ones (measured: bench/RESULTS.md, "Where stage 3's time goes").
#
# [Note: buckets] Several flat buffers in ONE collective pay one call's latency instead of
# several, and hold their bytes a little longer. Four policies, each applied where named:
# * stages 0-1 reductions (Reducer._schedule): every full gradient lives to the end of backward
#   anyway, so ready ones leave together in collectives of about BUCKET_BYTES (as DDP's buckets);
# * stages 2-3 reductions (the same place): each unit's at once, freeing full gradients early,
#   at most MAX_REDUCTIONS_IN_FLIGHT unfinished; ``bucket_bytes`` coalesces up to that many;
# * stage 3 gathers (Gatherer.gather): with ``bucket_bytes``, once the order is known, the units
#   that run next join a unit's gather;
# * stages 1-2 re-gathers (Gatherer.refresh_stale): the stale buffers in forward order, in
#   collectives of about BUCKET_BYTES, at most MAX_GATHERS_IN_FLIGHT unfinished.
# Read where it is used, at the time it is used (tests change it).
BUCKET_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, keep buffers in
    ``buffer_dtype``; the shards the optimizer owns stay in the parameters' own dtype (the fp32
    master copy). Parameters are cast BEFORE the all-gather, so gathers move param_dtype bytes.
    BatchNorm layers are never cast, weights nor running statistics (build.py, as FSDP1)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


def cast_inputs(tree, dtype: torch.dtype):
    """Mixed precision: the root unit's floating inputs (positional and keyword) in ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, tree)


def cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Mixed precision's ``buffer_dtype``; BatchNorm running statistics stay fp32."""
    if dtype is None:
        return
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)


# ------------------------------------------------------------------------------ the groups
@dataclasses.dataclass(frozen=True)
class Groups:
    """The process groups one engine talks on (None: the default group, every rank)."""
    shard: object      # the ranks a flat buffer is cut across (stage 0: every rank)
    replicate: object  # the ranks holding the same shard, or None when there are no replicas
    every: object      # every rank of the engine: the config check and the initial broadcast
    mesh: object = None  # the user's DeviceMesh, if one was given (params.mesh_of)


# [Note: mesh] ``mesh=`` as the groups of one engine. A 1-D mesh is the same as its process
# group. 2-D, dims (replicate, shard) as in FSDP2: hybrid sharding. Stages 1-3 cut every flat
# buffer across the shard dim (the ranks of one node) and replicate it across dim 0 (the
# nodes): gathers stay inside the shard group; a gradient is reduce-scattered (avg) there, then
# its shard all-reduced (avg) across the replicas. Stage 0 all-reduces over every rank. Per rank
# per step, stage 3 with R nodes of S ranks: 3Ψ(S-1)/S inside a node and 2(Ψ/S)(R-1)/R across
# nodes, instead of 3Ψ(RS-1)/(RS).
def resolve_groups(mesh, process_group, stage: int) -> Groups:
    """``mesh=`` or ``process_group=`` as the groups of one engine, checked before any collective
    could hang. A 2-D mesh is (replicate, shard), FSDP2's hybrid convention::

        init_device_mesh("cpu", (2, 3))   ranks [[0 1 2]     shard groups: the rows {0,1,2} {3,4,5}
                                                 [3 4 5]]    replicate groups: the columns {0,3} ...
    """
    if mesh is None:
        return Groups(process_group, None, process_group)
    from torch.distributed.device_mesh import DeviceMesh
    if process_group is not None:
        raise ValueError("ZeRO: pass mesh= or process_group=, not both (a mesh carries its groups)")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"ZeRO: mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(mesh).__name__}; for a plain process group pass process_group=")
    if mesh.get_coordinate() is None:
        raise ValueError(f"ZeRO: this rank (global rank {torch.distributed.get_rank()}) is not in "
                         f"the mesh {mesh.mesh.tolist()}; build the engine on the mesh's ranks only")
    if mesh.ndim == 1:
        group = mesh.get_group()
        return Groups(group, None, group, mesh)
    if mesh.ndim != 2 or mesh.size() != torch.distributed.get_world_size():
        raise ValueError(
            f"ZeRO: mesh {mesh.mesh.tolist()} has {mesh.ndim} dims over {mesh.size()} of the "
            f"{torch.distributed.get_world_size()} ranks; minishard takes a 1-D mesh, or a 2-D "
            "(replicate, shard) mesh over every rank of the job, e.g. init_device_mesh(\"cpu\", "
            "(nodes, ranks_per_node), mesh_dim_names=(\"replicate\", \"shard\"))")
    if stage == 0:  # nothing is sharded: one all-reduce over every rank, as DDP
        return Groups(None, None, None)
    replicate = mesh.get_group(0) if mesh.size(0) > 1 else None
    return Groups(mesh.get_group(1), replicate, None, mesh)


# ----------------------------------------------------------------------------- the checks
# [Note: replicate] ``replicate`` / ``persist_below`` (stages 1-3): parameters kept WHOLE on
# every rank, beside the sharded ones (FSDP2's ``replicate`` on some modules, DeepSpeed's
# ``stage3_param_persistence_threshold``). ``replicate``: module classes or a predicate, like
# ``units``; every parameter a matching module owns directly is replicated. ``persist_below=n``:
# so is every parameter of fewer than n elements. A replicated parameter is a ``Replicate()``
# DTensor; it is never gathered nor freed, its gradient is all-reduced (avg) over every rank as
# DDP's, in a bucket of its own (BUCKET_BYTES), and the optimizer holds its whole state on every
# rank. Default 0: every parameter sharded, as FSDP2 (DeepSpeed's default is 1e5). Persisting
# saves collectives only where a unit is made of small parameters: a unit is one gather however
# many parameters it has. What it buys on the GPT at stage 3, measured: bench/RESULTS.md,
# "Replicated parameters".
def check_arguments(engine_type: type, module: nn.Module, stage: int, policy, process_group,
                    mesh, find_unused: bool, bucket_bytes: int, persist_below: int) -> Groups:
    """Every check that needs no collective, in this order; returns the engine's groups.
    ``policy`` is engine.py's row for ``stage`` (None: no such stage)."""
    if policy is None:
        raise ValueError(f"ZeRO: stage must be 0, 1, 2 or 3, got {stage!r}")
    if any(isinstance(m, engine_type) or getattr(m, "_minishard_unit", None)
           for m in module.modules()):
        raise ValueError(
            "ZeRO: this module (or one of its submodules) is already wrapped by minishard.ZeRO, "
            "or a wrap of it failed after some of its parameters became shards. Wrap a module "
            "once; to change the stage, wrap a fresh copy of the original model.")
    if find_unused and policy.reshard_after_forward:
        raise ValueError(
            "ZeRO: find_unused_parameters=True cannot work at stage 3: every unit gathers its "
            "parameters in forward and again in backward, so every rank must run the same units "
            "and send gradients through the same ones. Use stage 2 for data-dependent branches, "
            "or make every rank take the same branch.")
    check_member(process_group, "ZeRO")
    groups = resolve_groups(mesh, process_group, stage)
    if bucket_bytes < 0:
        raise ValueError(f"ZeRO: bucket_bytes must be >= 0, got {bucket_bytes!r}")
    if not isinstance(persist_below, int) or persist_below < 0:
        raise ValueError(f"ZeRO: persist_below must be an int >= 0 (an element count), got "
                         f"{persist_below!r}")
    return groups


_wraps = [0]  # this process's wraps so far: the stamps' model numbers (check_same_config)


def check_same_config(module: nn.Module, stage: int, group) -> int:
    """Ranks that disagree on the stage or the model would deadlock later in mismatched
    collectives; compare a small fingerprint now (MAX of x and of -x gives max and min).
    Returns the model's number, one more than any rank's wraps so far: equal on every rank of
    ``group``, different for every model a rank wraps, so a gather's stamp (flat.py) tells two
    models of one architecture apart (and a dry run wrapping on one rank only shifts nothing)."""
    params = list(module.parameters())
    meta = sum(t.is_meta for t in params + list(module.buffers()))  # deferred init: a walk
    mine = torch.tensor([stage, sum(p.numel() for p in params), len(params), meta, _wraps[0]],
                        dtype=torch.float64)                  # of broadcasts on every rank
    lo, hi = ranks_range(mine, group, tag="ZeRO config check")
    if not torch.equal(hi[:-1], lo[:-1]):
        raise RuntimeError(
            f"ZeRO: ranks disagree on the configuration (stage, parameter count, number of "
            f"parameter tensors, tensors on the meta device): this rank has "
            f"{mine[:-1].long().tolist()}, the ranks range from "
            f"{lo[:-1].long().tolist()} to {hi[:-1].long().tolist()}. Every rank must wrap the "
            "same model with the same stage.")
    _wraps[0] = int(hi[-1]) + 1
    return _wraps[0]


# ------------------------------------------------------------------------ optimizer groups
# [Note: param_groups] ``param_groups``: optimizer groups over the module's parameters before
# wrapping; ``model.param_groups()`` returns them over the user parameters. Simpler: build the
# optimizer over the module, before wrapping or after, as for the unwrapped model.
# Parameters not listed form a last group with no options.
def param_group_index(module: nn.Module, param_groups: list[dict] | None):
    """``param_groups`` over the original parameters -> (group index of a parameter, each
    group's options). Parameters not listed go to one last group with no options."""
    if param_groups is None:
        return (lambda p: 0), [{}]
    mine = {id(p) for p in module.parameters()}
    index: dict[int, int] = {}
    for i, group in enumerate(param_groups):
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else list(params):
            if id(p) not in mine:
                raise ValueError(f"ZeRO: param_groups[{i}] holds a tensor that is not a parameter "
                                 "of the module being wrapped; list the module's own parameters")
            if index.setdefault(id(p), i) != i:
                raise ValueError(f"ZeRO: a parameter is in param_groups[{index[id(p)]}] and "
                                 f"param_groups[{i}]; list each parameter in one group")
    options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups] + [{}]
    rest = len(param_groups)
    return (lambda p: index.get(id(p), rest)), options


def shard_param_groups(units, options: list[dict]) -> list[dict]:
    """``model.param_groups()``: the groups given when wrapping, over the user parameters (each
    flat buffer belongs to exactly one group); empty groups left out."""
    groups = [{**o, "params": []} for o in options]
    for unit in units:
        for flat in unit.flats:
            groups[flat.param_group]["params"].extend(flat.params)
    return [g for g in groups if g["params"]]
