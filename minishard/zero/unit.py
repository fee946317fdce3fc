"""A unit: one module, the flat buffers of the parameters it owns, and its state.

engine.py says WHEN each unit is gathered, resharded and reduced; this file says WHAT that does to
one unit; flat.py says HOW the bytes move. A unit's state (:class:`UnitState`) is what its module
shows, and so what its memory must hold; four verbs, FSDP2's, are the only way to change it::

              to_unsharded()                      reshard()   (stage 3: full freed)
    SHARDED ──────────────────▶ UNSHARDED ─────────────────▶ RESHARDED
       ▲    (after unshard():       │                             │
       │    full gathered)          │ to_sharded()                │ to_sharded()
       └────────────────────────────┴─────────────────────────────┘

    unshard        every flat buffer that needs it (``FlatBuffer.needs_gather``) all-gathers
                   its shards into ``full`` (the state does not change: the module shows the
                   views only at ``to_unsharded``)
    to_unsharded   every place a parameter appears holds its view of ``full``
    reshard        (stage 3) ``full``'s storage is freed; the places show stand-ins
    to_sharded     every place holds the user parameter again (this rank's shard of it; the
                   whole parameter at stage 0): the unit at rest, as ``named_parameters()``
                   shows it between steps; stage 3 frees ``full``

Each verb is idempotent on the state it sets. A place is the module's own ``_parameters``
entry. A parameter may appear in several places: tied weights (``head.weight is emb.weight``)
and one module object reachable by two paths. It lives ONCE in a flat buffer; each appearance is
a :class:`Place`, and :class:`Param` groups them: ``unit.params()`` is the one way to walk a
unit's parameters and their places (state dicts list every place, as ``module.state_dict()``
does). The hook engine.py puts on each buffer's ``full`` fires when autograd has summed the
views' gradients into ``full.grad``: the engine reduces it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from minishard.zero.params import local
from minishard.zero.flat import FlatBuffer, FlatMode, gather_params

__all__ = ["Place", "Param", "Unit", "UnitState", "is_inside"]


@dataclasses.dataclass
class Place:
    """One module attribute where a flattened parameter appears (a tied one has several)."""
    module: nn.Module
    attr: str
    fqn: str


@dataclasses.dataclass
class Param:
    """One parameter of a unit: its flat buffer, its index there, every place it appears."""
    flat: FlatBuffer
    index: int
    places: list[Place]
    stand_in: torch.Tensor | None = None  # stage 3: shown once a forward is done with it
    local_grad: torch.Tensor | None = None  # after a no_sync backward: what ``.grad`` shows,
    local_ours: bool = False                # whether the engine put it there, and the NaN
    local_nan: torch.Tensor | None = None   # it holds under mixed precision

    @property
    def user(self) -> torch.nn.Parameter:
        """The parameter the user sees: a DTensor of this rank's rows at stages 1-3, the
        module's own (whole) parameter at stage 0."""
        return self.flat.params[self.index]

    @property
    def rows(self) -> torch.Tensor:
        """This rank's rows of it, a plain tensor (the user parameter's local tensor)."""
        return self.flat.locals[self.index]

    @property
    def name(self) -> str:
        """Its first name in the module: the one state dicts and checks report."""
        return self.places[0].fqn

    @property
    def shape(self) -> torch.Size:
        return self.flat.shapes[self.index]


def is_inside(name: str, scope: str) -> bool:
    """Is module path ``name`` the module ``scope`` or inside it? ("" is the root: everything.)"""
    return scope == "" or name == scope or name.startswith(scope + ".")


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


class UnitState(enum.Enum):
    """What a unit's module shows, and so what its memory holds (FSDP2's ``ShardedState``)."""
    SHARDED = "sharded"      # the user parameters; full freed (stage 3), or kept and gathered
                             # again before use once the user may have written the shards
    UNSHARDED = "unsharded"  # views of full, gathered and current: a forward or backward runs
    RESHARDED = "resharded"  # stage 3, done with its forward or backward: full freed, stand-ins
                             # that name the unit (guards.Released) until to_sharded()


def _ignore(*event) -> None:  # a unit's event stream before the engine listens (engine.py)
    return None


class Unit:
    """One module, the flat buffers of the parameters it owns, its state and its verbs."""

    def __init__(self, name: str, module: nn.Module, reshard_after_forward: bool) -> None:
        self.name, self.module = name, module
        self.flats: list[FlatBuffer] = []
        self.reshard_after_forward = reshard_after_forward  # stage 3 (FSDP2's name)
        self.state = UnitState.SHARDED  # build.py leaves every unit at rest
        self.emit = _ignore  # the engine's event stream: "free" when full is freed
        self._params: list[list[Param]] = []        # [flat][param]
        self._shown: list[list[torch.Tensor]] = []  # [flat][param] -> its unsharded view

    def add_flat(self, flat: FlatBuffer, places: list[list[Place]]) -> None:
        """A flat buffer of this unit; ``places[j]``: every place its parameter j appears."""
        self.flats.append(flat)
        self._params.append([Param(flat, j, p) for j, p in enumerate(places)])

    def params(self, flat: FlatBuffer | None = None) -> Iterator[Param]:
        """Every parameter of the unit (or of one of its flat buffers), in buffer order."""
        for f, params in zip(self.flats, self._params):
            if flat is None or f is flat:
                yield from params

    # ------------------------------------------------------------------------- the optimizer
    def shards(self) -> list[nn.Parameter]:
        """What the optimizer steps: the user parameters, in buffer order."""
        return [p for flat in self.flats for p in flat.params]

    def shard_grads(self, owned: bool = False, lead: bool = True) -> list[torch.Tensor]:
        """This rank's rows of every gradient, plain tensors; ``owned``: only those no other
        rank of the shard group holds too. A replicated one (a 0-dim parameter, or a buffer
        of mode REPLICATED in a sharded engine) counts on one rank of the group, the ``lead``."""
        return [local(p.grad) for flat in self.flats for j, p in enumerate(flat.params)
                if p.grad is not None and (lead or not owned or not flat.is_replicated(j))]

    # ----------------------------------------------------------------- unshard / reshard
    def unshard(self, async_op: bool = False, flats: list[FlatBuffer] | None = None) -> bool:
        """All-gather into ``full`` every buffer (of ``flats``) that needs it (``FlatBuffer.
        needs_gather``: the one "gather?" test), so calling it again is free; without
        ``async_op`` a gather already in flight (a prefetch) is landed. True if one started."""
        started = False
        for flat in self.flats if flats is None else flats:
            if flat.needs_gather:
                gather_params([flat], async_op)
                started = True
            elif not async_op:
                flat.wait()
        return started

    def wait(self) -> None:
        """Land every gather still in flight into this unit's buffers."""
        for flat in self.flats:
            flat.wait()

    # ---------------------------------------------------------------- what the places hold
    def to_unsharded(self, fresh: bool = True) -> None:
        """UNSHARDED: every place holds its parameter's view of ``full`` (gathered: unshard()
        first). New views (``fresh``: a forward), or those the last forward made (a
        recomputation in backward then joins its graph; nothing to do if already shown)."""
        if not fresh and self.state is UnitState.UNSHARDED:
            return
        if fresh or not self._shown:
            self._shown = [flat.unsharded_views() for flat in self.flats]
        for flat, views in zip(self.flats, self._shown):
            self.set_places(flat, views)
        self.state = UnitState.UNSHARDED

    def to_sharded(self, keep_current: bool = False) -> None:
        """SHARDED, at rest: stage 3 frees ``full``; the places hold the user parameters, whom
        the user may write however spelled, so ``full`` is stale until gathered (``keep_current``:
        between a step's forward and backward, or its micro-batches under ``no_sync``)."""
        self.reshard()
        for flat in self.flats:
            self.set_places(flat, flat.params)
            if not keep_current:
                flat.current = False  # the next use gathers (flat.py: needs_gather)
        self.state = UnitState.SHARDED

    def set_places(self, flat: FlatBuffer, values: list[torch.Tensor]) -> None:
        """Point every place of ``flat``'s parameter j at ``values[j]`` (the module's own
        ``_parameters`` entry: a view is not an ``nn.Parameter``, so setattr would refuse it)."""
        for param, value in zip(self._params[self.flats.index(flat)], values):
            for place in param.places:
                place.module._parameters[place.attr] = value

    # ------------------------------------------------------- no_sync's local gradients
    # [Note: local gradients] Under no_sync each buffer's FULL gradient accumulates in
    # ``full.grad``, this rank's alone. ``zero_grad`` clears the user parameters' ``.grad``, never
    # ``full.grad``; so that what it clears is gone, as under DDP, each ``.grad`` shows its whole
    # local gradient meanwhile, as DDP's does: a view of its region of ``full.grad`` (at stages
    # 1-3 a DTensor Replicate()d: each rank holds its own), so zeroing or scaling it in place acts
    # on the gradient itself; when the next backward starts, a ``.grad`` set to None or replaced
    # drops that region. Under mixed precision ``full.grad`` has the compute dtype and ``.grad``
    # must have the master's: it shows NaN (one element, nothing else held), which zeroing or
    # setting to None discards the same way, and which poisons a step taken without a reduction.
    def show_local_grads(self) -> None:
        """After a no_sync backward: each trainable parameter without a ``.grad`` shows its local
        gradient, and remembers what it shows."""
        for flat in self.flats:
            grad = flat.full.grad
            for param in self.params(flat):
                p = param.user
                if grad is None or not p.requires_grad:
                    continue
                param.local_ours, param.local_nan = p.grad is None, None  # else the user's:
                if param.local_ours:                                      # DDP adds into it
                    whole = flat.param_in(grad, param.index)
                    if whole.dtype != flat.dtype:
                        param.local_nan = torch.full((), float("nan"), dtype=flat.dtype,
                                                     device=whole.device)
                        whole = param.local_nan.expand(whole.shape)
                    p.grad = flat.spec.whole(whole) if flat.spec is not None else whole
                param.local_grad = p.grad

    def settle_local_grads(self) -> None:
        """A backward starts: drop the region of ``full.grad`` of each parameter whose ``.grad``
        the user cleared since :meth:`show_local_grads` (set to None or replaced; the NaN shown
        under mixed precision zeroed), and the ``.grad`` shown go back to None (the reduction
        delivers the gradient)."""
        for param in self.params():
            shown, p, grad = param.local_grad, param.user, param.flat.full.grad
            if shown is None:
                continue
            zeroed = param.local_nan is not None and not bool(param.local_nan.isnan())
            if grad is not None and (p.grad is not shown or zeroed):
                param.flat.region(grad, param.index).zero_()
            param.local_grad = None
            if param.local_ours and p.grad is shown:
                p.grad = None

    # ----------------------------------------------------------------------------- reshard
    def reshard(self, j: int | None = None, frozen_only: bool = False) -> None:
        """Stage 3: free ``full`` of every buffer (or of buffer ``j``, or the frozen ones) and show
        the stand-ins (guards.Released); RESHARDED once none is gathered. A REPLICATED buffer is
        never freed: its places keep their views. Stages 0-2: nothing."""
        if not self.reshard_after_forward:
            return
        freed = False
        for k, flat in enumerate(self.flats):
            if flat.mode is not FlatMode.OWN or (j is not None and k != j) or (
                    frozen_only and flat.requires_grad):
                continue
            if flat.is_gathered:
                flat.wait()
                flat.full.untyped_storage().resize_(0)
                freed = True
            self.set_places(flat, [p.stand_in if p.stand_in is not None else p.user
                                   for p in self._params[k]])
        if not any(f.is_gathered for f in self.flats if f.mode is FlatMode.OWN):
            self.state = UnitState.RESHARDED
        if freed:
            self.emit("free", self)

    def free_frozen_after_backward(self, args, kwargs):
        """Stage 3, in a forward: frozen buffers get no gradient, so no hook says when this
        unit's backward is over; an identity on its inputs does (autograd runs its backward once
        the unit's has finished): there they are resharded. Returns the inputs to use."""
        leaves, spec = tree_flatten((args, kwargs))
        leaves = _AfterBackward.apply(functools.partial(self.reshard, frozen_only=True), *leaves)
        return tree_unflatten(list(leaves), spec)
