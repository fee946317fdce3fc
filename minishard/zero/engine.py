"""The ZeRO engine: one machine, four stages. Start reading here.

A *unit* is a module whose parameters (minus those of nested units) communicate through flat
buffers (flat.py: one per dtype/requires_grad). The module keeps its own parameters, each holding
this rank's rows of it (FSDP2's cut along dim 0); the user builds an ordinary torch optimizer
over ``model.parameters()``, by name or shape as for the unwrapped model. The four stages differ
only in WHEN full tensors exist and WHEN gradients are reduced; that is the table ``STAGES``
below, and nothing else:

    stage  full params live         full grads live             grads reduced (avg)      optimizer sees
    0      always (DDP)             until the step              all-reduce               full params
    1      always                   until the end of backward   reduce-scatter           its rows
    2      always                   per unit, until reduced     reduce-scatter           its rows
    3      while the unit computes  per unit, until reduced     reduce-scatter           its rows

Between steps the user holds the shards and may write them however they like (an optimizer,
``p.data``, a foreach op): stages 1 and 2 all-gather them back into the full buffers at the next
forward (or ``gathered()``, or a state dict), since no counter sees every write; only the
micro-batches of one step (after a ``no_sync`` backward) reuse them, as FSDP1 does.

The hooks below run in event order; the table above them names the code each event runs.
Features listen from outside: every event is emitted to ``listeners`` (meters.py and the flight
record always, join.py while torch's Join runs). Communication per step, Ψ (padded) parameters,
ring model: stages 0-2 move 2Ψ, stage 3 3Ψ (lesson 04 derives it; hybrid sharding, lesson 10).
Read next: unit.py, schedule.py, flat.py, then comm.py (the collectives).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import weakref

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from minishard import comm
from minishard.checkpoint import full_state
from minishard.join import ZeROJoinHook
from minishard.observe import flight, trace
from minishard.zero import guards
from minishard.zero.build import build_units, replicated_predicate
from minishard.zero.config import (MixedPrecision, cast_buffers, cast_inputs, check_arguments,
                                   check_same_config, param_group_index, resolve_groups,
                                   shard_param_groups)
from minishard.zero.flat import FlatMode
from minishard.zero.meters import Meters, WrapMeter, memory_report, step_transients
from minishard.zero.schedule import Gatherer, Pass, Reducer, clip_grad_norm
from minishard.zero.unit import Unit, UnitState

__all__ = ["ZeRO", "StagePolicy", "STAGES", "Phase", "MixedPrecision", "resolve_groups"]


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    flat_mode: FlatMode       # where full and shard live (flat.py): REPLICATED, VIEW or OWN
    free_grads_early: bool    # wait for a unit's reduction soon, freeing its full gradient (2, 3)
    reshard_after_forward: bool  # release full params between uses (stage 3)


STAGES = {
    0: StagePolicy(FlatMode.REPLICATED, free_grads_early=False, reshard_after_forward=False),
    1: StagePolicy(FlatMode.VIEW, free_grads_early=False, reshard_after_forward=False),
    2: StagePolicy(FlatMode.VIEW, free_grads_early=True, reshard_after_forward=False),
    3: StagePolicy(FlatMode.OWN, free_grads_early=True, reshard_after_forward=True),
}


class Phase(enum.Enum):
    """Where the engine is in a step: the one field its hooks decide by (``self.phase``)."""
    IDLE = "idle"                  # between steps: every unit at rest (SHARDED)
    FORWARD = "forward"            # a forward began; its backward has not (it may never come)
    BACKWARD = "backward"          # autograd runs the backward (a forward now recomputes)
    ACCUMULATING = "accumulating"  # a no_sync backward ended; the step goes on (micro-batches)


def _weak_hook(engine, method, *keys):
    """A hook calling ``method(engine, *keys, *hook_args)`` that does not keep ``engine`` alive."""
    ref = weakref.ref(engine)

    @torch.compiler.disable  # the engine runs eagerly between compiled code (as FSDP2's hooks)
    def hook(*args):
        alive = ref()
        return None if alive is None else method(alive, *keys, *args)
    return hook


def _first_step_check(optimizer, args, kwargs) -> None:
    """Before every step: an optimizer not checked since built or loaded is adopted (guards.py)."""
    if optimizer not in guards.CHECKED:
        guards.adopt(optimizer)


register_optimizer_step_pre_hook(_first_step_check)


class ZeRO(trace.Traced, nn.Module, Joinable):
    """Wrap ``module`` so its parameters, gradients and optimizer state are sharded by ``stage``.

    ``stage``: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters). The module's
    code runs unchanged. Other arguments (each explained in config.py): ``units`` (classes, a
    predicate or None: which submodules gather and reduce as one), ``process_group`` or ``mesh``
    (2-D: hybrid sharding), ``mixed_precision``, ``prefetch``, ``bucket_bytes``, ``param_groups``,
    ``find_unused_parameters`` (stages 0-2), ``device`` and ``param_init_fn`` (deferred init),
    ``replicate`` and ``persist_below`` (parameters kept whole on every rank).

    ``model.named_parameters()`` (``module.`` prefixed, as DDP's): the module's own at stage 0;
    at stages 1-3 DTensors of this rank's rows (params.py), as FSDP2's: build the optimizer by
    name or ``p.dim()``, after wrapping or before (guards.py adopts it); torch's
    ``clip_grad_norm_`` and ``get_state_dict(model.module, opt)`` work on them. A parameter
    skipped inside a unit whose others got gradients gets zeros (one flat gradient per unit, as
    FSDP1): make it a unit of its own.
    ``requires_grad_(False)`` on any parameter or module freezes exactly that.
    """
    __deepcopy__ = guards.refuse_deepcopy  # an EMA copy: full_state_dict() into a plain model

    def __init__(self, module: nn.Module, stage: int = 3, units=None, process_group=None,
                 mixed_precision: MixedPrecision | None = None, prefetch: bool = False,
                 param_groups: list[dict] | None = None, find_unused_parameters: bool = False,
                 mesh=None, device: torch.device | str | None = None, param_init_fn=None,
                 bucket_bytes: int = 0, replicate=None, persist_below: int = 0) -> None:
        super().__init__()
        Joinable.__init__(self)  # uneven inputs: torch's Join (join.py)
        policy = STAGES.get(stage)
        groups = check_arguments(ZeRO, module, stage, policy, process_group, mesh,
                                 find_unused_parameters, bucket_bytes, persist_below)
        self.module, self.stage, self.policy = module, stage, policy
        self.group, self.replicate_group = groups.shard, groups.replicate
        self.every_group = groups.every  # all the engine's ranks: [Note: rank 0] in full_state
        self.mp = mp = mixed_precision or MixedPrecision()
        self.prefetch, self.bucket_bytes, self.find_unused = (prefetch, bucket_bytes,
                                                              find_unused_parameters)
        model_number = check_same_config(module, stage, groups.every)  # in the stamps
        group_of, self._group_options = param_group_index(module, param_groups)
        # The unwrapped module's names, in its own order, before the parameters move into flats:
        # state dicts and the full optimizer export (full_state.py) are keyed by these.
        self.param_names = [name for name, _ in module.named_parameters()]
        self.state_keys = list(module.state_dict().keys())
        self._wrap_meter = WrapMeter()
        self.units = build_units(module, units, groups, flat_mode=policy.flat_mode,
                                 param_dtype=mp.param_dtype, group_of=group_of,
                                 is_replicated=replicated_predicate(replicate, persist_below),
                                 device=device, param_init_fn=param_init_fn,
                                 meter=self._wrap_meter, model=model_number,
                                 reshard_after_forward=policy.reshard_after_forward)
        cast_buffers(module, mp.buffer_dtype)
        guards.guard_parameters(self.units, module, stand_ins=self.policy.reshard_after_forward,
                                groups=[groups.every] if stage else [])
        guards.adopt_live_optimizers()  # an optimizer built before wrapping: ours from now on
        # The event stream: ``listen(event, unit, *payload)`` for each event of the table below
        # ("step", "gather", "forward", "free", "backward_pass", "backward", "grad", "reduce",
        # "backward_done"). Meters and the flight record listen always; Join while it runs.
        self.listeners: list = []
        self._gathers = Gatherer(self.units, self._emit, bucket_bytes=bucket_bytes,
                                 prefetch=prefetch, find_unused=find_unused_parameters)
        self._reducer = Reducer(self.units, free_grads_early=policy.free_grads_early,
                                bucket_bytes=bucket_bytes, reduce_dtype=mp.reduce_dtype,
                                find_unused=find_unused_parameters, every_group=groups.every,
                                emit=self._emit)
        self.phase = Phase.IDLE
        self.require_backward_grad_sync = True  # DDP's flag: False is no_sync() (nanoGPT sets it)
        self._install_hooks()
        self._meters = Meters(self.units, self._reducer)
        self.listeners += [self._meters.heard, comm.FLIGHT.heard]  # flight: where each rank is
        flight.arm()

    def _install_hooks(self) -> None:
        """Every hook, in one place: each unit's forward pre- and post-hooks and event stream, its
        pre-backward hook (each forward puts it on the outputs) and, on each buffer's ``full``
        (frozen too: it may be thawed), the post-backward hook. Weak references to the engine."""
        for i, unit in enumerate(self.units):
            unit.emit = self._emit
            unit.module.register_forward_pre_hook(_weak_hook(self, ZeRO._pre_forward, i),
                                                  with_kwargs=True)
            unit.module.register_forward_hook(_weak_hook(self, ZeRO._post_forward, i))
            for j, flat in enumerate(unit.flats):
                trainable = flat.full.requires_grad
                flat.full.requires_grad_(True)  # a hook needs it; kept through later changes
                flat.full.register_post_accumulate_grad_hook(
                    _weak_hook(self, ZeRO._post_backward, i, j))
                flat.full.requires_grad_(trainable)
        self._pre_backward_hooks = [_weak_hook(self, ZeRO._pre_backward, i)
                                    for i in range(len(self.units))]

    # --------------------------------------------------------------------------------- hooks
    # The life of one stage-3 unit in one step: each event, the code that runs it (unit.py: the
    # unit's verbs; schedule.py: Gatherer, Reducer) and the unit's state after it (unit.py).
    #
    #   pre-forward gather  all_gather shards -> full; the  _pre_forward (the root's   UNSHARDED
    #                       module's parameters are views   also _root_pre_forward):
    #                                                       gather, to_unsharded
    #   prefetch            the next unit's, async          Gatherer.look_ahead
    #   forward             the module's own code, unchanged
    #   post-forward free   free full, stand-ins; at the    _post_forward: reshard,   RESHARDED
    #                       root's end every unit at rest   to_sharded                SHARDED
    #   pre-backward gather all_gather again when the grad  _pre_backward: gather,    UNSHARDED
    #                       reaches the unit's outputs      to_unsharded(fresh=False)
    #   backward            autograd sums the views' gradients into full.grad (one flat gradient)
    #   post-backward       reduce_scatter(avg) full.grad   _post_backward:           RESHARDED
    #                       -> shard.grad; free full        grad_ready, reshard
    #   end of backward     wait for every reduction        _finish_backward          SHARDED
    #   optimizer step      the user's optimizer writes the shards in place (torch.optim)
    #   re-gather           stages 1-2: at the next forward _root_pre_forward
    #
    # The engine's phase (Phase) is FORWARD from a step's first forward, BACKWARD while autograd
    # runs, then IDLE (ACCUMULATING after a no_sync backward). Stages 0-2 never free: every unit
    # shows its views from the root's pre-forward to its end, and again in its backward. A unit
    # that got no gradient keeps ``grad=None``. Frozen buffers get none; at stage 3 an identity on
    # the unit's inputs (unit.py: ``_AfterBackward``) says when their unit's backward is over.
    def _pre_forward(self, i: int, module, args, kwargs):
        unit = self.units[i]
        recomputing = self.phase is Phase.BACKWARD  # activation checkpointing
        if unit.module is self.module and not recomputing:
            args, kwargs = self._root_pre_forward(unit, args, kwargs)
        elif self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD  # a unit called on its own
        self._gathers.gather(unit, Pass.FORWARD)
        if recomputing or unit.state is not UnitState.UNSHARDED:  # stages 0-2: the root's
            unit.to_unsharded()
        self._emit("forward", unit)
        if not recomputing:
            self._gathers.look_ahead(unit, Pass.FORWARD)
        if unit.reshard_after_forward and torch.is_grad_enabled() and not all(
                flat.requires_grad for flat in unit.flats):
            args, kwargs = unit.free_frozen_after_backward(args, kwargs)
        return args, kwargs

    def _root_pre_forward(self, root: Unit, args, kwargs):
        """The root's work before each forward (FSDP2's ``_root_pre_forward``); stages 0-2 show
        every unit's views (a unit may read another's parameter)."""
        self._emit("step", root, args, kwargs)  # Join announces this rank (join.py)
        if self.phase is Phase.FORWARD:  # the last forward's backward never came
            for unit in self.units:
                unit.to_sharded()
        self.phase = Phase.ACCUMULATING if self.phase is Phase.ACCUMULATING else Phase.FORWARD
        for flat in (f for unit in self.units for f in unit.flats):  # the user's, by parameter:
            flat.requires_grad = any(p.requires_grad for p in flat.params)  # frozen one by one
            flat.full.requires_grad_(flat.requires_grad)                    # or a module at once
        if not root.reshard_after_forward:  # stages 0-2
            self._gathers.refresh_stale()
            for unit in self.units:
                unit.to_unsharded()
        if self.mp.param_dtype is not None:
            args, kwargs = cast_inputs((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _post_forward(self, i: int, module, args, output):
        unit = self.units[i]
        if torch.is_grad_enabled():
            outputs = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hooks[i])
        if self.phase is Phase.BACKWARD:  # a recomputation: backward still needs the views
            return
        unit.reshard()  # stage 3: stand-ins, so another unit's read is named
        if unit.module is self.module:  # every unit at rest until its backward (if one comes)
            self._gathers.order_recorded = True
            for other in self.units:
                other.to_sharded(keep_current=torch.is_grad_enabled()
                                 or self.phase is Phase.ACCUMULATING)
            if not torch.is_grad_enabled() and self.phase is Phase.FORWARD:
                self.phase = Phase.IDLE  # no backward can follow

    def _pre_backward(self, i: int, grad) -> None:
        unit = self.units[i]
        self._start_backward()
        self._gathers.gather(unit, Pass.BACKWARD)
        unit.to_unsharded(fresh=False)  # the forward's views: a checkpointed part recomputes
        self._emit("backward", unit)
        self._gathers.look_ahead(unit, Pass.BACKWARD)

    def _post_backward(self, i: int, j: int, full: torch.Tensor) -> None:
        """Flat buffer ``j`` of unit ``i`` has its whole gradient in ``full.grad``."""
        unit = self.units[i]
        self._start_backward()
        self._emit("grad", unit)
        if self.require_backward_grad_sync:
            self._reducer.grad_ready(unit, unit.flats[j])
        unit.reshard(j)

    def _start_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            if self.phase is Phase.ACCUMULATING:  # no_sync's local gradients: what the user
                for unit in self.units:           # cleared is dropped (unit.py's [Note])
                    unit.settle_local_grads()
            self.phase = Phase.BACKWARD
            self._emit("backward_pass")
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """Once, when autograd has finished the backward: every reduction launched and waited
        for (schedule.py), every unit at rest (after no_sync: current for the next micro-batch)."""
        sync = self.require_backward_grad_sync
        self._reducer.finish(sync)
        self._emit("backward_done")
        self.phase = Phase.IDLE if sync else Phase.ACCUMULATING
        for unit in self.units:
            unit.to_sharded(keep_current=not sync)
            if not sync:  # what zero_grad clears must be gone: unit.py's [Note]
                unit.show_local_grads()

    def _emit(self, event: str, unit: Unit | None = None, *payload) -> None:
        for listen in self.listeners:
            listen(event, unit, *payload)

    # -------------------------------------------------------------------------- public API
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def join_hook(self, **kwargs) -> ZeROJoinHook:
        """torch's Join: ``Join([model], optimizer=opt, before_step=fn)`` (join.py)."""
        return ZeROJoinHook(self, kwargs.get("optimizer"), kwargs.get("before_step"))

    join_device = property(lambda self: next((f.full.device for u in self.units
                                              for f in u.flats), torch.device("cpu")))
    join_process_group = property(lambda self: self.every_group)

    def param_groups(self) -> list[dict]:
        """The ``param_groups=`` given when wrapping, over the user parameters."""
        return shard_param_groups(self.units, self._group_options)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no gradient communication: each unit keeps its
        FULL gradient until the first backward outside the block reduces the sum (stage 3
        still all-gathers the parameters it freed, as FSDP does). Meanwhile ``p.grad`` shows the
        local gradient, as DDP's; ``zero_grad`` discards it (unit.py: [Note: local gradients])."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the WHOLE model by its global norm, as torch's does on the
        unsharded model (and on ``model.parameters()``); returns the norm before clipping."""
        return clip_grad_norm(self.units, self.group, self.stage > 0, max_norm, norm_type)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = True):
        """Full parameters visible on every rank inside the block (FSDP's ``summon_full_params``)
        in the master dtype, under ``torch.no_grad()``. Edits are kept with ``writeback`` (stages
        0-2 keep them anyway: full and shards share storage); under mixed precision it shows the
        fp32 masters and writes back only an edited shard, never a rounded one."""
        if self.phase is Phase.FORWARD:  # a forward never backpropagated is over
            for unit in self.units:
                unit.to_sharded()
            self.phase = Phase.IDLE
        with full_state.gathered(self.units, writeback, lambda u: self._emit("gather", u),
                                 lambda u: u.to_sharded()):
            yield self.module

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped module's state dict: original names, full tensors, on every rank; with
        ``rank0_only`` (FSDP's name) only rank 0 keeps it, the others return ``{}`` (gathered
        one flat buffer at a time into one staging buffer: checkpoint/full_state.py)."""
        return full_state.full_state_dict(self.units, self.module, self.state_keys,
                                          self.every_group, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | None,
                             from_rank0: bool = False) -> None:
        """Load a full (unsharded) state dict of the unwrapped module, e.g. ``full_state_dict()``'s;
        with ``from_rank0`` only rank 0's is read (the others may pass None): it checks it, tells
        every rank its verdict, then broadcasts it one flat buffer at a time."""
        full_state.load_full_state_dict(self.units, self.module, self.state_keys,
                                        self.every_group, state_dict, from_rank0)

    def record_events(self):
        """A context manager yielding the list of what the engine does per unit, in order
        ("gather", "forward", "free", "backward", "reduce"), timed (tutorial 05's timeline)."""
        return self._meters.recording()

    peak_gathered_bytes = property(lambda self: self._meters.peak_gathered_bytes,
                                   doc="Stage 3: most full-parameter bytes gathered at once.")
    peak_full_grad_bytes = property(lambda self: self._meters.peak_full_grad_bytes)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None,
                      measured=None) -> dict:
        """Bytes held now by kind, the last step's peaks (meters.py); ``measured`` (a
        ``minishard.Allocations`` that watched a step): its peak beside the formula's."""
        return memory_report(self.units, self._meters, self._wrap_meter, optimizer,
                             step_transients(self), measured)

    step_transients = step_transients  # meters.py: what a step allocates, buffer by buffer
