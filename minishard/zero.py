"""The ZeRO engine: one machine, four stages.

A *unit* is a module whose parameters (minus those of nested units) live in flat buffers
(flat.py: one per dtype/requires_grad). The user builds an ordinary torch optimizer over
``model.parameters()``, which are this rank's *shards* of those buffers. The four stages differ
only in WHEN full tensors exist and WHEN gradients are reduced; that is this table, and nothing else:

    stage  full params live         full grads live             grads reduced (avg)           optimizer sees
    0      always (DDP)             until the step              all-reduce                    the full flat
    1      always                   until the end of backward   reduce-scatter                its shard
    2      always                   per unit, until reduced     reduce-scatter                its shard
    3      while the unit computes  per unit, until reduced     reduce-scatter                its shard

    every stage launches a unit's reduction as soon as autograd has finished that unit's
    gradient (overlapping the rest of backward); 0 and 1 await them all at the end of backward,
    2 and 3 await each soon after, which is what frees their full gradients early. (0 and 1
    coalesce ready units into buckets of about _BUCKET_BYTES; with ``bucket_bytes``, 2 and 3
    coalesce too, and stage 3 gathers consecutive units in one collective.)
    after the optimizer step, stages 1 and 2 all-gather the updated shards back into the full
    buffers (lazily: the next forward, ``gathered()`` or state-dict call notices the shard changed;
    the forward coalesces them into gathers of about _BUCKET_BYTES, at most two in flight).

The life of one stage-3 unit in one step (hooks registered by this module)::

    pre-forward hook      all_gather shards -> full; module.weight etc. become views of full
    forward               the module's own code, unchanged
    post-forward hook     free full (storage resized to 0); hook the outputs' gradients
    pre-backward hook     (fires when the gradient reaches the unit's outputs) all_gather again
    backward              autograd sums the views' grads into full.grad (one flat gradient)
    post-backward hook    (full.grad accumulated) reduce_scatter(avg) -> shard.grad; free full
    end of backward       a callback queued by the first pre-backward hook waits for pending
                          reductions; a unit that got no gradient keeps grad None, as in one
                          process (find_unused_parameters: a unit only SOME ranks used is
                          reduced with zeros from the others, in an order every rank shares)

Communication per step, Ψ = number of (padded) parameters, ring model (comm.py):
stage 0: all-reduce Ψ = 2Ψ; stages 1-2: reduce-scatter Ψ + all-gather Ψ = 2Ψ;
stage 3: two all-gathers + one reduce-scatter = 3Ψ (each times (N-1)/N and the element size).
Hybrid sharding (``mesh=``, R replicas of S-rank shard groups) runs all of that inside the shard
group (N = S) and adds one all-reduce of each gradient shard across the replicas: 2(Ψ/S)(R-1)/R.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from minishard import comm
from minishard.flat import FlatBuffer, gather_params, reduce_grads
from minishard.units import (DeferredInit, Unit, WrapMeter, build_units, cast_buffers,
                             check_same_config, default_device, detached_views, has_meta_tensors,
                             is_inside, rank0_verdict, sync_initial_state, unit_predicate)

__all__ = ["ZeRO", "StagePolicy", "STAGES", "MixedPrecision", "resolve_groups"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, keep buffers in
    ``buffer_dtype``; the shards the optimizer owns stay in the parameters' own dtype (the fp32
    master copy). Parameters are cast BEFORE the all-gather, so gathers move param_dtype bytes.
    BatchNorm buffers (running statistics) are never cast: they stay fp32."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    flat_mode: str            # FlatBuffer mode: "none" (full is the param), "view", "own"
    free_grads_early: bool    # wait for a unit's reduction soon, freeing its full gradient (2, 3)
    free_after_forward: bool  # release full params between uses (stage 3)


# Every stage launches a unit's gradient reduction as soon as autograd has finished that unit's
# gradient, so communication overlaps the rest of backward. Stages 0 and 1 wait for all of them
# at the end of backward (their full gradients live until then); stages 2 and 3 keep at most
# _MAX_REDUCTIONS_IN_FLIGHT pending, so a unit's full gradient is freed soon after it is ready.
STAGES = {
    0: StagePolicy("none", free_grads_early=False, free_after_forward=False),
    1: StagePolicy("view", free_grads_early=False, free_after_forward=False),
    2: StagePolicy("view", free_grads_early=True, free_after_forward=False),
    3: StagePolicy("own", free_grads_early=True, free_after_forward=True),
}

_MAX_REDUCTIONS_IN_FLIGHT = 2  # stages 2-3: bounds the full gradients waiting for their reduction
# Stages 0-1 keep every full gradient until the end of backward anyway, so units whose gradients
# are ready are coalesced into one collective of about this many bytes (DDP's buckets do the
# same; a bucket closes once it reaches the size): one per-call latency instead of one per unit.
# Stages 1-2 coalesce the re-gathers after the optimizer step the same way, with at most
# _MAX_GATHERS_IN_FLIGHT of them (and their staging buffers, see flat.gather_params) alive.
_BUCKET_BYTES = 4 * 2**20
_MAX_GATHERS_IN_FLIGHT = 2


# ----------------------------------------------------------------------------- helpers
def _weak_hook(engine, method, *keys):
    """A hook calling ``method(engine, *keys, *hook_args)`` that does not keep ``engine`` alive."""
    ref = weakref.ref(engine)

    def hook(*args):
        alive = ref()
        return None if alive is None else method(alive, *keys, *args)
    return hook


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward calls ``callback``: autograd runs it once the
    gradient has flowed through the whole unit down to its inputs."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return tuple(x.view_as(x) if isinstance(x, torch.Tensor) else x for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _cast_floats(tree, dtype: torch.dtype):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, tree)


class _Released(torch.Tensor):
    """What a stage-3 module attribute holds while its unit is NOT gathered (the full values do
    not exist then). Any use raises an error naming the parameter, instead of torch's opaque
    complaint about a storage of size 0 deep inside some operator."""

    # What only reads metadata (shape, dtype, the empty meta storage: memory tools scanning
    # gc.get_objects() call these) is allowed; anything that needs the values raises.
    _METADATA = {"__get__", "__repr__", "__deepcopy__", "__reduce_ex__", "untyped_storage",
                 "data_ptr", "storage_offset", "dim", "size", "stride", "numel", "nelement",
                 "element_size", "is_contiguous"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        me = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Released))
        raise RuntimeError(
            f"ZeRO stage 3: parameter {me._minishard_name!r} (owned by unit {me._minishard_unit!r}) "
            "was used while its unit is not gathered: at stage 3 its full value exists only while "
            f"{me._minishard_unit!r} runs forward or backward. If another module reads it in its "
            "own forward (a head reusing an embedding's weight), let ONE unit contain both users "
            "(choose units= so that their common parent owns it, or tie the parameter so both "
            "modules hold it); to read values outside forward, use `with model.gathered():`.")


def _released_placeholders(unit: Unit) -> list[list[torch.Tensor]]:
    """One _Released stand-in per parameter of each of ``unit``'s flat buffers."""
    out = []
    for flat, places in zip(unit.flats, unit.bindings):
        out.append([])
        for bindings, shape in zip(places, flat.shapes):
            t = torch.Tensor._make_subclass(  # the parameter's shape, no storage (meta)
                _Released, torch.empty(shape, dtype=flat.param_dtype, device="meta"))
            t._minishard_name, t._minishard_unit = bindings[0].fqn, unit.name
            out[-1].append(t)
    return out


def _param_group_index(module: nn.Module, param_groups: list[dict] | None):
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


def _guard_module_attributes(engine: "ZeRO") -> None:
    """After wrapping, the modules own no parameters (they live in flat shards), so
    ``module.parameters()`` would be EMPTY and the usual ways to freeze or group parameters would
    silently do nothing. On every wrapped module: ``requires_grad_`` freezes through the engine,
    and ``parameters``/``named_parameters`` raise an error that says what to use instead."""
    ref = weakref.ref(engine)
    for path, m in engine.module.named_modules():
        def requires_grad_(requires_grad: bool = True, _m=m, _path=path):
            alive = ref()
            if alive is not None:
                alive._set_requires_grad(_path, requires_grad)
            return _m

        def refuse(*args, _path=path, **kwargs):
            where = f"model.module.{_path}" if _path else "model.module"
            raise RuntimeError(
                f"{where}.parameters(): minishard.ZeRO moved this module's parameters into flat "
                "shards, so it owns none (an empty list here would silently build empty optimizer "
                "groups or freeze nothing). Use model.parameters() for the optimizer, "
                "ZeRO(..., param_groups=[...]) for groups by name, "
                f"{where}.requires_grad_(False) to freeze, and model.gathered() or "
                "model.full_state_dict() to read the values.")
        m.requires_grad_, m.parameters, m.named_parameters = requires_grad_, refuse, refuse


# ---------------------------------------------------------------------- groups from a mesh
@dataclasses.dataclass(frozen=True)
class Groups:
    """The process groups one engine talks on (None: the default group, every rank)."""
    shard: object      # the ranks a flat buffer is cut across (stage 0: every rank)
    replicate: object  # the ranks holding the same shard, or None when there are no replicas
    every: object      # every rank of the engine: the config check and the initial broadcast


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
        return Groups(group, None, group)
    if mesh.ndim != 2 or mesh.size() != torch.distributed.get_world_size():
        raise ValueError(
            f"ZeRO: mesh {mesh.mesh.tolist()} has {mesh.ndim} dims over {mesh.size()} of the "
            f"{torch.distributed.get_world_size()} ranks; minishard takes a 1-D mesh, or a 2-D "
            "(replicate, shard) mesh over every rank of the job, e.g. init_device_mesh(\"cpu\", "
            "(nodes, ranks_per_node), mesh_dim_names=(\"replicate\", \"shard\"))")
    if stage == 0:  # nothing is sharded: one all-reduce over every rank, as DDP
        return Groups(None, None, None)
    replicate = mesh.get_group(0) if mesh.size(0) > 1 else None
    return Groups(mesh.get_group(1), replicate, None)


# ------------------------------------------------------------------- global optimizer guard
_checked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _refuse_orphaned_params(optimizer, args, kwargs) -> None:
    """The classic stale-parameter bug: the optimizer was built over the module's parameters
    BEFORE wrapping, so it updates tensors the model no longer uses. Caught at the first step."""
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_minishard_replaced", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter of the module as it was BEFORE "
                    "minishard.ZeRO wrapped it; ZeRO replaced those parameters by flat shards, so "
                    "this optimizer would update tensors the model no longer uses. Build the "
                    "optimizer AFTER wrapping, over the wrapper: "
                    "opt = torch.optim.AdamW(zero_model.parameters(), ...)")
    ours = any(getattr(p, "_minishard_shard", False) for g in optimizer.param_groups
               for p in g["params"])
    for i, group in enumerate(optimizer.param_groups):
        if ours and not group["params"]:
            raise ValueError(
                f"param group {i} of the {type(optimizer).__name__} is empty, so its options "
                "would apply to nothing. minishard's parameters are flat shards (named "
                "flat_params.N), so groups cannot be picked by the original names after wrapping: "
                "give them when wrapping, ZeRO(module, ..., param_groups=[{'params': [...], "
                "'weight_decay': 0.0}, ...]), and build the optimizer over model.param_groups().")
    _checked_optimizers.add(optimizer)


register_optimizer_step_pre_hook(_refuse_orphaned_params)


# ------------------------------------------------------------------------------------ engine
class ZeRO(nn.Module):
    """Wrap ``module`` so its parameters, gradients and optimizer state are sharded by ``stage``.

    Args:
        module: the model. Its code runs unchanged; its parameters become views into gathered
            flat buffers while it computes.
        stage: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters).
        units: ``None`` (the whole module is one unit), a module class or a collection of classes
            (every matching submodule is its own unit), or a predicate ``fn(module) -> bool``.
            A parameter belongs to the innermost unit that contains every module using it.
            Each unit is one collective per gather and per reduction: on gloo over loopback a
            collective costs about 0.8 ms of CPU per call on top of its bytes, so there units
            of several MiB train faster than many small ones (bench/RESULTS.md, "Where stage
            3's time goes").
        process_group: the ranks to shard over (default: all).
        mesh: instead of ``process_group``, a ``torch.distributed.device_mesh.DeviceMesh``.
            1-D: the same as its process group. 2-D, dims (replicate, shard) as in FSDP2, e.g.
            ``init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate",
            "shard"))``: hybrid sharding. Stages 1-3 cut every flat buffer across the shard dim
            (dim 1: the ranks of one node) and replicate it across dim 0 (the nodes): gathers
            stay inside the shard group; a gradient is reduce-scattered (avg) there, then its
            shard all-reduced (avg) across the replicas. Stage 0 all-reduces over every rank.
            Per rank per step, stage 3 with R nodes of S ranks: 3Ψ(S-1)/S inside a node and
            2(Ψ/S)(R-1)/R across nodes, instead of 3Ψ(RS-1)/(RS) across nodes.
        mixed_precision: a :class:`MixedPrecision` (default: compute in the parameters' dtype).
        prefetch: issue the next unit's all-gather asynchronously while this one computes
            (order recorded on the first forward, reversed for backward; two gathers at most).
        bucket_bytes: (stages 2-3) move consecutive units together: from the second step on,
            stage 3 gathers a unit together with the units after it in forward order (before
            it in backward) up to about this many bytes of parameters, in ONE collective, and
            stages 2-3 reduce the gradients of units that finish one after another in
            collectives of up to about this many bytes. 0 (the default): one collective per
            unit, one unit's full parameters gathered at a time (plus the next with prefetch).
            With buckets: one bucket (or the largest unit, if larger) at a time, plus the next
            bucket with prefetch; up to a bucket of full gradients waiting for their
            reduction; and a staging buffer of a bucket while it moves. Fewer collectives for
            that memory: worth it where each collective has a fixed cost small units do not
            amortise (bench/RESULTS.md: gloo over loopback, ~0.8 ms of CPU per call).
        param_groups: optimizer parameter groups over the ORIGINAL parameters, as you would
            pass them to ``torch.optim`` for the unwrapped model (``[{"params": [...],
            "weight_decay": 0.0}, ...]``). Parameters of different groups get different flat
            buffers; ``model.param_groups()`` returns the same groups over the shards. Parameters
            not listed form a last group with no options of its own.
        find_unused_parameters: (stages 0-2) allow a unit to get a gradient on SOME ranks only
            in a step (a data-dependent branch). Reductions then run in a fixed order, ranks
            without a gradient send zeros, and one all-reduce of a usage bitmap (one byte per
            trainable flat buffer) per backward tells which buffers NO rank used: those keep
            ``grad=None``. Without it (the default, as DDP's), every rank must reach the same
            units in backward; a unit that none reached keeps ``grad=None`` at no cost.
        device: where tensors on the meta device are materialised (default: the current CUDA
            device if there is one, else the CPU).
        param_init_fn: ``fn(module)`` initialising a module's OWN meta tensors (FSDP1's
            argument); default: the module's ``reset_parameters()``.

    Deferred init: ``module`` may be built (wholly or partly) under ``with torch.device("meta"):``.
    Its tensors are materialised one module at a time, initialised on rank 0 and broadcast;
    each rank keeps what its stage keeps, so wrapping never holds more than the shards plus one
    module's full tensors (``memory_report()["peak_wrapping"]``). With the same seed, the values
    equal an eager build's; units.py (step 5) says exactly when, and what differs otherwise.

    Build the optimizer AFTER wrapping, over ``model.parameters()`` (the shards) or
    ``model.param_groups()``.

    A flat buffer's shard is ONE optimizer parameter: when some of a unit's parameters get a
    gradient in a step and others of the same buffer do not (a submodule skipped inside a unit),
    those others get zeros, and momentum, Adam and weight decay move them (FSDP1's flat
    parameters behave the same). Make a module that is sometimes skipped a unit of its own; a
    whole unit that no rank used keeps ``grad=None``.

    Freezing after wrapping: ``model.module.block.requires_grad_(False)`` (original names) or
    ``shard.requires_grad_(False)`` freezes whole flat buffers; freezing only part of one is
    refused (make that part a unit of its own). A frozen buffer gets no gradient, so the
    optimizer leaves it alone.
    """

    def __init__(self, module: nn.Module, stage: int = 3, units=None, process_group=None,
                 mixed_precision: MixedPrecision | None = None, prefetch: bool = False,
                 param_groups: list[dict] | None = None,
                 find_unused_parameters: bool = False, mesh=None,
                 device: torch.device | str | None = None, param_init_fn=None,
                 bucket_bytes: int = 0) -> None:
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"ZeRO: stage must be 0, 1, 2 or 3, got {stage!r}")
        if isinstance(module, ZeRO) or any(isinstance(m, ZeRO) or getattr(m, "_minishard_unit",
                                                                            None)
                                           for m in module.modules()):
            raise ValueError(
                "ZeRO: this module (or one of its submodules) is already wrapped by minishard.ZeRO. "
                "Wrap a module once; to change the stage, wrap a fresh copy of the original model.")
        if find_unused_parameters and STAGES[stage].free_after_forward:
            raise ValueError(
                "ZeRO: find_unused_parameters=True cannot work at stage 3: every unit gathers its "
                "parameters in forward and again in backward, so every rank must run the same units "
                "and send gradients through the same ones. Use stage 2 for data-dependent branches, "
                "or make every rank take the same branch.")
        comm.check_member(process_group, "ZeRO")
        groups = resolve_groups(mesh, process_group, stage)
        self.module = module
        self.stage, self.policy, self.group = stage, STAGES[stage], groups.shard
        self.replicate_group, self.mesh = groups.replicate, mesh
        self.world = comm.group_size(self.group)
        self.mp = mixed_precision or MixedPrecision()
        self.prefetch = prefetch
        if bucket_bytes < 0:
            raise ValueError(f"ZeRO: bucket_bytes must be >= 0, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.find_unused = find_unused_parameters
        check_same_config(module, stage, groups.every)
        group_of, self._group_options = _param_group_index(module, param_groups)
        self._every = groups.every  # every rank of the engine (find_unused's usage bitmap)
        # The unwrapped module's names, in its own order, before the parameters move into flats:
        # state dicts and the full optimizer export (state.py) are keyed by these.
        self.param_names = [name for name, _ in module.named_parameters()]
        self._state_keys = list(module.state_dict().keys())
        deferred = None
        if has_meta_tensors(module):  # materialised inside build_units, broadcast from rank 0
            deferred = DeferredInit(torch.device(device) if device else default_device(),
                                    param_init_fn)
        else:
            sync_initial_state(module, groups.every)
        self._wrap_meter = WrapMeter()
        self.units = build_units(module, unit_predicate(units), self.group,
                                 flat_mode=self.policy.flat_mode, param_dtype=self.mp.param_dtype,
                                 group_of=group_of, replicate_group=self.replicate_group,
                                 deferred=deferred, meter=self._wrap_meter,
                                 init_group=groups.every)
        cast_buffers(module, self.mp.buffer_dtype)
        self.flat_params = nn.ParameterList(
            [flat.shard for unit in self.units for flat in unit.flats])
        for shard in self.flat_params:
            shard._minishard_shard = True  # the optimizer guard recognises our shards
        self._register_hooks()
        _guard_module_attributes(self)
        # per-step bookkeeping
        self._backward_pending = False      # the end-of-backward callback is queued
        self._in_backward = False
        self._reduced: set[int] = set()     # ids of flats already reduced in this backward
        self._ready: list[FlatBuffer] = []   # find_unused: ready, waiting for their turn
        self._used: set[int] = set()         # find_unused: flats this rank had a gradient for
        self._launched = 0                   # find_unused: how far along the fixed order
        self._in_flight: list[tuple[comm.Handle, int]] = []  # reductions and their grad bytes
        self._bucket: list[FlatBuffer] = []  # stages 0-1: ready gradients not yet launched
        self._regather_queue: list[list[FlatBuffer]] = []  # stages 1-2: buckets not yet gathered
        self._regathers: list[comm.Handle] = []             # ... and those in flight
        self._sync_grads = True             # False inside no_sync()
        self._order: list[Unit] = []        # units in the order the first forward ran them
        self._order_recorded = False
        if find_unused_parameters:  # forwards may differ between ranks: a fixed order instead
            self._order, self._order_recorded = list(self.units), True
        self._events: list[dict] | None = None  # see record_events()
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.peak_full_grad_bytes = 0
        self._released = {id(u): _released_placeholders(u) for u in self.units}
        for unit in self.units:  # stage 3 starts sharded; the others keep full params
            if self.policy.free_after_forward:
                self._free(unit)
            else:
                self._gather(unit)  # deferred init filled only the shard of an "own" buffer
                unit.bind_views(detached=True)
        self._note_gathered()

    # --------------------------------------------------------------------------------- hooks
    def _register_hooks(self) -> None:
        """Hooks live on modules and tensors that the engine owns; they reach the engine through
        a weak reference (``_weak_hook``), so no reference cycle keeps a dropped model alive
        until the garbage collector runs (at interpreter exit, too late for torch.distributed)."""
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(_weak_hook(self, ZeRO._pre_forward, i),
                                                  with_kwargs=True)
            unit.module.register_forward_hook(_weak_hook(self, ZeRO._post_forward, i))
        self._hooked: set[int] = set()
        self._sync_requires_grad()

    def _sync_requires_grad(self) -> None:
        """The shard's ``requires_grad`` is the truth (the user may freeze through the original
        names, ``model.requires_grad_()`` or the shards); bring each flat buffer in line, and give
        a buffer its gradient hook the first time it is trainable."""
        for i, unit in enumerate(self.units):
            for j, flat in enumerate(unit.flats):
                if flat.requires_grad != flat.shard.requires_grad:
                    flat.set_requires_grad(flat.shard.requires_grad)
                if flat.requires_grad and id(flat) not in self._hooked:
                    self._hooked.add(id(flat))
                    flat.full.register_post_accumulate_grad_hook(
                        _weak_hook(self, ZeRO._post_backward, i, j))

    def _pre_forward(self, i: int, module, args, kwargs):
        unit = self.units[i]
        is_root = unit.module is self.module
        if is_root and not self._in_backward:
            self.peak_gathered_bytes = self._gathered_bytes
            self._sync_requires_grad()
            if not self.policy.free_after_forward:
                self._refresh_stale()
        if not self._order_recorded and unit not in self._order:
            self._order.append(unit)
        self._gather_from(unit, step=+1)
        unit.bind_views()
        self._log("forward", unit)
        if self._regather_queue and not self._in_backward:
            self._issue_regathers()
        if self.prefetch and not self._in_backward:
            self._prefetch_after(unit, step=+1)
        if is_root and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        if (self.policy.free_after_forward and torch.is_grad_enabled()
                and any(not f.requires_grad for f in unit.flats)):
            # Frozen buffers have no gradient hook to say when the unit's backward is over; an
            # identity on the unit's inputs does: its backward runs once the unit's has finished.
            leaves, spec = tree_flatten((args, kwargs))
            leaves = _AfterBackward.apply(_weak_hook(self, ZeRO._free_frozen, i), *leaves)
            args, kwargs = tree_unflatten(list(leaves), spec)
        return args, kwargs

    def _post_forward(self, i: int, module, args, output):
        unit = self.units[i]
        self._order_recorded |= unit.module is self.module
        if torch.is_grad_enabled():
            outputs = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_weak_hook(self, ZeRO._pre_backward, i))
        # During backward (activation-checkpoint recomputation) the params are still needed.
        if self.policy.free_after_forward and not self._in_backward:
            self._free(unit)

    def _pre_backward(self, i: int, grad) -> None:
        unit = self.units[i]
        self._start_backward()
        self._gather_from(unit, step=-1)
        if self.policy.free_after_forward and unit.views:
            unit.rebind_views()  # a checkpointed part of the unit recomputes from its attributes
        self._log("backward", unit)
        if self.prefetch:
            self._prefetch_after(unit, step=-1)

    def _post_backward(self, i: int, j: int, full: torch.Tensor) -> None:
        unit, flat = self.units[i], self.units[i].flats[j]
        self._start_backward()
        self._note_full_grads()
        if self._sync_grads:
            self._reduce(unit, flat)
        if self.policy.free_after_forward:
            self._free(unit, flat)

    def _free_frozen(self, i: int) -> None:
        unit = self.units[i]
        for flat in unit.flats:
            if not flat.requires_grad:
                self._free(unit, flat)

    def _prefetch_after(self, unit: Unit, step: int) -> None:
        """Start the all-gather of the unit expected to run next (forward order, or its reverse
        in backward). A wrong guess costs memory, never correctness: a unit waits for its own."""
        if unit not in self._order:
            return
        i = self._order.index(unit) + step
        if 0 <= i < len(self._order):
            self._gather_from(self._order[i], step, async_op=True)

    def _refresh_stale(self) -> None:
        """Stages 1-2: the optimizer step changed the shards. Queue every stale full buffer, in
        forward order, into coalesced gathers of about _BUCKET_BYTES (one dtype each), and start
        the first ones now; each unit waits for the gather that carries it before it runs."""
        for handle in self._regathers:  # a forward that skipped units left these: land them
            handle.wait()
        order = self._order + [u for u in self.units if u not in self._order]
        buckets: list[list[FlatBuffer]] = []
        for flat in (f for u in order for f in u.flats if f.mode != "none" and f.is_stale):
            last = buckets[-1] if buckets else None
            if (last is None or last[0].param_dtype != flat.param_dtype
                    or sum(f.full_bytes() for f in last) >= _BUCKET_BYTES):
                buckets.append([])
            buckets[-1].append(flat)
        self._regather_queue, self._regathers = buckets, []
        self._issue_regathers()
        while self.find_unused and (self._regather_queue or self._regathers):
            # Ranks may run different units (that is what find_unused_parameters allows), so
            # nothing may depend on which units run: every re-gather lands now, in order.
            self._regathers.pop(0).wait()
            self._issue_regathers()

    def _issue_regathers(self) -> None:
        """Start queued re-gathers while fewer than _MAX_GATHERS_IN_FLIGHT are unfinished. Runs
        at every unit's pre-forward, the same program points on every rank: same order of
        collectives everywhere. A flat gathered on its own meanwhile is no longer stale: skipped."""
        self._regathers = [h for h in self._regathers if not h.waited]
        while self._regather_queue and len(self._regathers) < _MAX_GATHERS_IN_FLIGHT:
            bucket = [f for f in self._regather_queue.pop(0) if f.is_stale]
            if bucket:
                self._regathers.append(gather_params(bucket))

    def _gather_from(self, unit: Unit, step: int, async_op: bool = False) -> None:
        """Gather ``unit`` for the forward (``step=+1``) or backward (-1) schedule. With
        ``bucket_bytes`` at stage 3, once the order is known, the units that run after it (in
        that direction) and are not gathered join its collective, up to about bucket_bytes in
        all: one collective for several small units. Each still frees its own parameters after
        it has run, so a bucket's memory drains unit by unit."""
        missing = lambda u: [f for f in u.flats if f.needs_gather]
        if not (self.bucket_bytes and self.policy.free_after_forward and self._order_recorded
                and unit in self._order and missing(unit)):
            self._gather(unit, async_op)
            return
        i = self._order.index(unit)
        later = self._order[i + 1:] if step > 0 else self._order[:i][::-1]
        bucket = [(unit, missing(unit))]
        size = sum(f.full_bytes() for f in bucket[0][1])
        for other in later:
            flats = missing(other)
            size += sum(f.full_bytes() for f in flats)
            if size > self.bucket_bytes:
                break
            bucket.append((other, flats))
        flats = [f for _, fs in bucket for f in fs]
        for dtype in dict.fromkeys(f.param_dtype for f in flats):  # one collective per dtype
            gather_params([f for f in flats if f.param_dtype == dtype])
        self._note_gathered()
        for u, fs in bucket:
            if fs:
                self._log("gather", u)
        if not async_op:
            for flat in unit.flats:
                flat.wait()

    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        for flat in unit.flats:
            self._gather_flat(unit, flat, async_op)

    def _gather_flat(self, unit: Unit, flat: FlatBuffer, async_op: bool = False) -> None:
        if flat.needs_gather:
            flat.gather(async_op)
            self._note_gathered()
            self._log("gather", unit)
        elif not async_op:
            flat.wait()  # a prefetched gather: make sure it has landed

    def _free(self, unit: Unit, flat: FlatBuffer | None = None) -> None:
        """Stage 3: release full storage; the module's attributes become _Released stand-ins."""
        for j, (f, places) in enumerate(zip(unit.flats, unit.bindings)):
            if flat is not None and f is not flat:
                continue
            if f.mode == "own" and f.is_gathered:
                f.free()
                self._note_gathered()
                self._log("free", unit)
            if self.policy.free_after_forward:
                Unit.bind(f, places, self._released[id(unit)][j])

    def _start_backward(self) -> None:
        if not self._backward_pending:
            self._backward_pending, self._in_backward = True, True
            self.peak_full_grad_bytes = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _reduce(self, unit: Unit, flat: FlatBuffer) -> None:
        """``flat``'s gradient is complete on this rank: start its reduction (see _launch_ready
        for the order with find_unused_parameters)."""
        if id(flat) in self._reduced:
            return
        self._reduced.add(id(flat))
        self._log("reduce", unit)
        if self.find_unused:
            self._used.add(id(flat))
            self._ready.append(flat)
            self._launch_ready()
        else:
            self._schedule(flat)

    def _launch_order(self) -> list[FlatBuffer]:
        """find_unused_parameters: the one order every rank reduces in (the reverse of the
        units' order, usually the order backward finishes them), so that a rank holding a
        gradient and a rank sending zeros for it meet in the same collective."""
        return [f for u in reversed(self.units) for f in u.flats if f.requires_grad]

    def _launch_ready(self) -> None:
        """Launch, in the fixed order, every ready flat whose predecessors are launched; a flat
        ready early waits for its turn (a rank may never reach one: it sends zeros at the end)."""
        order = self._launch_order()
        launched = self._launched
        while launched < len(order) and order[launched] in self._ready:
            self._ready.remove(order[launched])
            self._schedule(order[launched])
            launched += 1
        self._launched = launched

    def _schedule(self, flat: FlatBuffer) -> None:
        """Queue ``flat``'s reduction in the bucket; launch the bucket once it holds about
        _BUCKET_BYTES (stages 0-1) or ``bucket_bytes`` (stages 2-3: 0 launches every flat at
        once, freeing its full gradient soonest)."""
        cap = self.bucket_bytes if self.policy.free_grads_early else _BUCKET_BYTES
        if self._bucket and self._bucket[0].param_dtype != flat.param_dtype:
            self._flush_bucket()  # one collective moves one dtype
        self._bucket.append(flat)
        if sum(f.full_bytes() for f in self._bucket) >= cap:
            self._flush_bucket()

    def _flush_bucket(self) -> None:
        if self._bucket:
            self._launch(self._bucket)
            self._bucket = []
        while self.policy.free_grads_early and len(self._in_flight) > _MAX_REDUCTIONS_IN_FLIGHT:
            self._in_flight.pop(0)[0].wait()

    def _launch(self, flats: list[FlatBuffer]) -> None:
        nbytes = sum(f.full_bytes() for f in flats)
        self._in_flight.append((reduce_grads(flats, self.mp.reduce_dtype), nbytes))

    def _finish_backward(self) -> None:
        """Runs once, when autograd has finished the whole backward pass.

        A flat buffer whose gradient never became ready in this backward is reduced now if this
        rank holds a gradient for it (it was used only in earlier ``no_sync`` backwards). One that
        no rank used keeps ``grad=None``, as in single-process training: reducing zeros into it
        would make Adam, momentum and weight decay move weights that got no gradient. Without
        find_unused_parameters, "no rank" is "not this rank" (every rank reaches the same units).
        """
        if self._sync_grads:
            for unit in reversed(self.units):
                for flat in unit.flats:
                    if flat.requires_grad and flat.full.grad is not None:
                        self._reduce(unit, flat)
            unused = self._finish_in_order() if self.find_unused else []
        self._flush_bucket()
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight.clear()
        if self._sync_grads:
            for flat, grad_before in unused:  # no rank used it: leave its gradient as it was
                flat.shard.grad = grad_before
        self._reduced.clear()
        if self.policy.free_after_forward:
            for unit in self.units:
                self._free(unit)
        self._backward_pending = self._in_backward = False

    def _finish_in_order(self) -> list[tuple[FlatBuffer, torch.Tensor | None]]:
        """find_unused_parameters: launch the rest of the fixed order (zeros where this rank has
        no gradient), then ONE all-reduce(MAX) of a byte per flat, "this rank used it", so every
        rank knows which flats no rank used. Returns those, with their gradient before this
        backward, to restore once the (all-zero) reductions have landed."""
        order = self._launch_order()
        before = {id(f): f.shard.grad for f in order}
        self._ready += [f for f in order[self._launched:] if f not in self._ready]
        self._launch_ready()
        used = torch.tensor([id(f) in self._used for f in order], dtype=torch.uint8)
        comm.all_reduce(used, "max", self._every, tag="ZeRO used flats")
        unused = [(f, before[id(f)]) for f, u in zip(order, used.tolist()) if not u]
        self._ready, self._used, self._launched = [], set(), 0
        return unused

    # -------------------------------------------------------------------------- public API
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def param_groups(self) -> list[dict]:
        """The ``param_groups=`` given when wrapping, over the shards (each flat buffer belongs to
        exactly one group): ``torch.optim.AdamW(model.param_groups(), lr=...)``."""
        groups = [{**options, "params": []} for options in self._group_options]
        for unit in self.units:
            for flat in unit.flats:
                groups[flat.param_group]["params"].append(flat.shard)
        return [g for g in groups if g["params"]]

    def _set_requires_grad(self, path: str, requires_grad: bool) -> None:
        """``model.module.<path>.requires_grad_(flag)``: set it on every flat buffer holding a
        parameter used under ``path``, refusing (before changing anything) when that would
        freeze only part of a buffer, since a buffer's shard is one optimizer parameter."""
        touched = []
        for unit in self.units:
            for flat, places in zip(unit.flats, unit.bindings):
                inside = [any(is_inside(b.fqn.rpartition(".")[0], path) for b in bindings)
                          for bindings in places]
                if not any(inside) or not flat.dtype.is_floating_point:
                    continue
                if not all(inside):
                    names = [bs[0].fqn for bs, i in zip(places, inside) if not i]
                    raise ValueError(
                        f"{path or 'the model'}.requires_grad_({requires_grad}): unit "
                        f"{unit.name!r} keeps these parameters in the SAME flat buffer, outside "
                        f"{path!r}: {names}. A flat buffer's shard is one optimizer parameter, so "
                        "it is frozen or trained whole. Make the module a unit of its own (units="
                        "...) when wrapping, or freeze the whole unit.")
                touched.append(flat)
        for flat in touched:
            flat.shard.requires_grad_(requires_grad)
        self._sync_requires_grad()

    @contextlib.contextmanager
    def record_events(self):
        """Yield a list that collects, in order, what the engine does per unit: "gather",
        "forward", "free", "backward", "reduce", each with a time stamp and the full-parameter
        bytes gathered at that moment (tutorial 05 prints it as a timeline)."""
        self._events = events = []
        try:
            yield events
        finally:
            self._events = None

    def _log(self, event: str, unit: Unit) -> None:
        if self._events is not None:
            self._events.append({"t": time.perf_counter(), "event": event, "unit": unit.name,
                                 "gathered_bytes": self._gathered_bytes})

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no gradient communication: each unit keeps its
        FULL gradient (more memory) until the first backward outside the block reduces the sum.
        (Stage 3 still all-gathers the parameters it freed, as FSDP does: only the reductions
        are skipped.)
        Without ``no_sync``, every backward reduce-scatters into the shard gradient instead:
        less memory, more communication. Both give the same numbers."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the WHOLE model by its global norm, as
        ``torch.nn.utils.clip_grad_norm_`` does on the unsharded model; returns the total norm
        before clipping.

        Each element counts once: a rank sums |g|^p over its shard gradients only (which hold no
        padding, and a tied weight has one slot), then one all-reduce adds the ranks' sums
        (MAX for the inf-norm). Stage 0 holds identical full gradients on every rank: no collective.
        With replicas (a 2-D mesh) the sum runs over the shard group only: every replica holds
        the same shards, so adding theirs would count each element R times.
        """
        norm_type = float(norm_type)
        grads = [f.shard.grad for u in self.units for f in u.flats if f.shard.grad is not None]
        device = grads[0].device if grads else self.flat_params[0].device
        if norm_type == float("inf"):
            local = max((g.abs().max().double() for g in grads if g.numel()),
                        default=torch.zeros((), dtype=torch.float64, device=device))
            op = "max"
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads),
                        torch.zeros((), dtype=torch.float64, device=device))
            op = "sum"
        total = local.reshape(1).clone()
        if self.policy.flat_mode != "none":
            comm.all_reduce(total, op, self.group, tag="clip_grad_norm_")
        total = total[0] if norm_type == float("inf") else total[0].pow(1.0 / norm_type)
        clip = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(clip.to(g.dtype))
        return total.float()

    @contextlib.contextmanager
    def gathered(self, writeback: bool = True):
        """Full parameters visible on every rank inside the block (like FSDP's
        ``summon_full_params``), in the master dtype. With ``writeback``, edits to them are
        kept. Without it, stage 3 drops them; stages 0-2 keep them all the same (when not under
        mixed precision), because there the full parameters share storage with the shards (as
        FSDP's NO_SHARD does).

        Under mixed precision the compute buffer holds ROUNDED values, so the block shows the
        fp32 master values gathered from the shards instead, and writes back only a shard that
        was edited: entering and leaving the block never rounds the master weights."""
        masters: dict[int, torch.Tensor] = {}
        for unit in self.units:
            for flat, places in zip(unit.flats, unit.bindings):
                if flat.param_dtype != flat.dtype:
                    masters[id(flat)] = master = flat.gather_shards(flat.shard, "gathered()")
                    Unit.bind(flat, places, [piece.view(shape) for piece, shape in zip(
                        torch.split(master, flat.numels), flat.shapes)])
                else:
                    self._gather_flat(unit, flat)
                    Unit.bind(flat, places, detached_views(flat))
        try:
            yield self.module
        finally:
            for unit in self.units:
                for flat in unit.flats:
                    if writeback and id(flat) in masters:
                        flat.load_master(masters[id(flat)], only_if_changed=True)
                    elif writeback:
                        flat.push_to_shard()
                if self.policy.free_after_forward:
                    self._free(unit)
                else:
                    unit.bind_views(detached=True)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped module's state dict: original names, full tensors, on every rank.

        With ``rank0_only`` (FSDP's name), only rank 0 builds it and the others return ``{}``:
        the model is gathered one flat buffer at a time (every rank takes part in each gather
        and drops it at once), and rank 0 alone keeps a copy. So no rank but 0 ever holds more
        than one unit's full tensors, and rank 0 holds the dict it asked for."""
        keep = not rank0_only or comm.group_rank(self.group) == 0
        values: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for flat, places in zip(unit.flats, unit.bindings):
                master = flat.gather_shards(flat.shard)
                if not keep:
                    continue
                for piece, shape, bindings in zip(torch.split(master, flat.numels), flat.shapes,
                                                  places):
                    for b in bindings:
                        values[b.fqn] = piece.view(shape).clone()
        if not keep:
            return {}
        for name, buf in self.module.state_dict().items():
            values.setdefault(name, buf.detach().clone())
        return {k: values[k] for k in self._state_keys}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | None,
                             from_rank0: bool = False) -> None:
        """Load a full (unsharded) state dict of the unwrapped module, e.g. ``full_state_dict()``'s.

        With ``from_rank0``, only rank 0's ``state_dict`` is read (the others may pass None):
        rank 0 checks it and tells every rank its verdict, then broadcasts it one flat buffer
        at a time, each rank keeping its shard; buffers follow, one by one."""
        rank0 = comm.group_rank(self.group) == 0
        error = self._state_dict_problem(state_dict) if rank0 or not from_rank0 else None
        if from_rank0:
            device = self.flat_params[0].device if len(self.flat_params) else None
            error = rank0_verdict(error, self.group, device, tag="load_full_state_dict")
        if error is not None:
            raise (KeyError if "missing keys" in error else ValueError)(error)
        with torch.no_grad():
            for unit in self.units:
                for flat, places in zip(unit.flats, unit.bindings):
                    if rank0 or not from_rank0:
                        full = torch.cat([state_dict[bindings[0].fqn].reshape(-1).to(flat.dtype)
                                          for bindings in places]).to(flat.shard.device)
                    else:
                        full = flat.shard.new_empty(flat.numel)
                    if from_rank0:
                        comm.broadcast(full, 0, self.group, tag=f"{flat.name} (from rank 0)")
                    flat.load_master(full)
            buffers = self.module.state_dict()
            for name, buf in buffers.items():
                value = state_dict[name] if rank0 or not from_rank0 else buf.detach().clone()
                if from_rank0:
                    value = value.to(buf.device, buf.dtype)
                    comm.broadcast(value, 0, self.group, tag=f"{name} (from rank 0)")
                buffers[name] = value
            self.module.load_state_dict(buffers, strict=False)
        self._refresh_after_load()

    def _refresh_after_load(self) -> None:
        """The shards changed under the engine (a load): stages 0-2 re-gather the full
        parameters now, one unit at a time; stage 3 gathers each unit when it next runs."""
        for unit in self.units:
            if not self.policy.free_after_forward:
                self._gather(unit)
                unit.bind_views(detached=True)

    def _state_dict_problem(self, state_dict) -> str | None:
        """What makes ``state_dict`` unloadable into this model (keys, shapes), or None."""
        expected = set(self._state_keys)
        given = set(state_dict or {})
        missing, unexpected = expected - given, given - expected
        if missing or unexpected:
            return (f"load_full_state_dict: missing keys {sorted(missing)}, unexpected keys "
                    f"{sorted(unexpected)}. Pass the full state dict of the same model.")
        for unit in self.units:
            for flat, places in zip(unit.flats, unit.bindings):
                for shape, bindings in zip(flat.shapes, places):
                    t = state_dict[bindings[0].fqn]
                    if t.shape != shape:
                        return (f"load_full_state_dict: {bindings[0].fqn} has shape "
                                f"{tuple(t.shape)}, the model expects {tuple(shape)}")
        return None

    # -------------------------------------------------------------------------------- memory
    def _note_gathered(self) -> None:
        self._gathered_bytes = sum(f.full_bytes() for u in self.units for f in u.flats
                                   if f.mode == "own" and f.is_gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _note_full_grads(self) -> None:
        """Full (unsharded) gradient bytes alive now: accumulated and not yet reduced, or in a
        reduction still in flight. Stage 1 holds them all at the end of backward; 2 and 3 a few."""
        held = sum(f.full.grad.untyped_storage().nbytes() for u in self.units for f in u.flats
                   if f.full.grad is not None)
        held += sum(nbytes for _, nbytes in self._in_flight)
        self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, held)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds right now, by kind (``params``, ``grads``, ``optimizer``: pass the
        optimizer to count its state for our shards), and two peaks of the last step:
        ``peak_gathered_params`` (stage 3: full parameters gathered at once; the others keep
        them all) and ``peak_full_grads`` (unsharded gradients alive at once during backward).
        ``peak_wrapping``: the most parameter and buffer bytes this rank held at once while
        wrapping (the module as given, flat buffers, shards, tensors materialised for an
        initialiser): the whole model or more for an eager build; for a meta build, the
        shards, the buffers and one module's full tensors (units.py, WrapMeter)."""
        params = 0
        grads: dict[int, int] = {}  # by storage: coalesced shard grads share one
        for unit in self.units:
            for f in unit.flats:
                shares_storage = f.mode == "view" or f.shard is f.full
                params += f.full.untyped_storage().nbytes()
                params += 0 if shares_storage else f.shard.untyped_storage().nbytes()
                for g in (f.full.grad, f.shard.grad):
                    if g is not None:
                        grads[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
        opt = 0
        if optimizer is not None:
            mine = {id(p) for p in self.parameters()}
            for p, state in optimizer.state.items():
                if id(p) in mine:
                    opt += sum(v.numel() * v.element_size() for v in state.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": sum(grads.values()), "optimizer": opt,
                "peak_gathered_params": self.peak_gathered_bytes,
                "peak_full_grads": self.peak_full_grad_bytes,
                "peak_wrapping": self._wrap_meter.peak}
