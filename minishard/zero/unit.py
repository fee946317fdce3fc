"""A unit: one module, the flat buffers of the parameters it owns, and the work done on them.

engine.py says WHEN each unit is gathered, resharded and reduced; this file says WHAT that does to
one unit; flat.py says HOW the bytes move. A unit's work, by event:

    unshard        every flat buffer that needs it (``FlatBuffer.needs_gather``) all-gathers
                   its shards into ``full``
    to_unsharded   every place a parameter appears now holds its view of ``full``
    to_sharded     every place holds the user parameter again: this rank's shard of it (the
                   whole parameter at stage 0), what ``named_parameters()`` gives between steps
    reshard        (stage 3) ``full``'s storage is freed, and the places show stand-ins until
                   ``to_sharded``
    gradients      the hook engine.py puts on each trainable buffer's ``full`` fires when autograd
                   has summed the views' gradients into ``full.grad``: the engine reduces it

A place is the module's own ``_parameters`` entry: it holds the user parameter at rest and a
view of ``full`` (a plain tensor, as FSDP1 shows its original parameters) while the unit computes.

A parameter may appear in several places: tied weights (``head.weight is emb.weight``) and one
module object reachable by two paths. It lives ONCE in a flat buffer; each appearance is a
:class:`Place`, and :class:`Param` groups them: ``unit.params()`` is the one way to walk a unit's
parameters and their places (state dicts list every place, as ``module.state_dict()`` does).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn

from minishard.zero.params import local
from minishard.zero.flat import FlatBuffer, FlatMode, gather_params

__all__ = ["Place", "Param", "Unit", "is_inside"]


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
    local_grad: torch.Tensor | None = None  # after a no_sync backward: what ``.grad`` shows
    local_nonzero: bool = False             # ... whether it showed anything but zeros
    local_ours: bool = False                # ... whether the engine put it there

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


class Unit:
    """One module, the flat buffers of the parameters it owns, and the work done on them."""

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name, self.module = name, module
        self.flats: list[FlatBuffer] = []
        self.reshard_after_forward = False  # stage 3 (FSDP2's name): free full after each use
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
        """Every place holds its parameter's view of ``full``: new views (``fresh``, a forward),
        or those the last forward made (a recomputation in backward then joins its graph)."""
        if fresh:
            self._shown = [flat.unsharded_views() for flat in self.flats]
        for flat, views in zip(self.flats, self._shown):
            self.set_places(flat, views)

    def to_sharded(self, keep_current: bool = False) -> None:
        """Every place holds its user parameter again (between steps): from now on the user
        may write the shards, however spelled, so ``full`` is stale until the next gather.
        ``keep_current``: between the micro-batches of one step (after a ``no_sync``
        backward), whose gradients are all taken at the same parameters, as FSDP1 keeps them."""
        for flat in self.flats:
            self.set_places(flat, flat.params)
            if not keep_current:
                flat.mark_stale()

    def set_places(self, flat: FlatBuffer, values: list[torch.Tensor]) -> None:
        """Point every place of ``flat``'s parameter j at ``values[j]`` (the module's own
        ``_parameters`` entry: a view is not an ``nn.Parameter``, so setattr would refuse it)."""
        for param, value in zip(self._params[self.flats.index(flat)], values):
            for place in param.places:
                place.module._parameters[place.attr] = value

    # ------------------------------------------------------- no_sync's local gradients
    # [Note: local gradients] Under no_sync each buffer's FULL gradient accumulates in
    # ``full.grad``, this rank's alone. ``zero_grad`` clears the user parameters' ``.grad``, never
    # ``full.grad``; so that what it clears is gone, as under DDP, each ``.grad`` shows this
    # rank's rows of the local gradient meanwhile (stage 0: all of it, a view, exactly DDP's), and
    # when the next backward starts a ``.grad`` set to None or replaced drops its parameter's part
    # of ``full.grad``; one zeroed in place too (``zero_grad(set_to_none=False)``): a rank whose
    # rows of it are empty or zero cannot see that, so the ranks agree first (engine.py).
    def show_local_grads(self) -> None:
        """After a no_sync backward: each trainable parameter without a ``.grad`` shows its rows
        of ``full.grad`` (a view; a copy in the master dtype under mixed precision, whose full
        gradient is in another), and each remembers what it shows."""
        for flat in self.flats:
            grad = flat.full.grad
            for param in self.params(flat):
                p = param.user
                if grad is None or not p.requires_grad:
                    continue
                param.local_ours = p.grad is None  # else the user's, kept (as DDP adds to it)
                if param.local_ours:
                    rows = flat.grad_rows(grad, param.index)
                    p.grad = flat.as_user(param.index, rows.to(flat.dtype))
                param.local_grad = p.grad
                param.local_nonzero = bool(local(p.grad).any())

    def zeroed_in_place(self) -> list[bool]:
        """For each parameter (``params()`` order): were its shown rows, not all zero when shown,
        zeroed since? (What stage 0 shows without a cast IS the gradient: nothing to do.)"""
        out = []
        for param in self.params():
            shown, flat = param.local_grad, param.flat
            is_the_gradient = flat.chunks == 1 and flat.dtype == flat.param_dtype
            out.append(shown is not None and not is_the_gradient and param.local_nonzero
                       and param.user.grad is shown and not bool(local(shown).any()))
        return out

    def settle_local_grads(self, zeroed: list[bool]) -> None:
        """A backward starts: drop from ``full.grad`` each part whose ``.grad`` the user cleared
        since :meth:`show_local_grads` (set to None, replaced, or ``zeroed`` on some rank), and
        the ``.grad`` shown go back to None (the reduction delivers the gradient)."""
        for param, zero in zip(self.params(), zeroed):
            shown, p, grad = param.local_grad, param.user, param.flat.full.grad
            if shown is None:
                continue
            if grad is not None and (p.grad is not shown or zero):
                param.flat.region(grad, param.index).zero_()
            param.local_grad = None
            if param.local_ours and p.grad is shown:
                p.grad = None

    # ----------------------------------------------------------------------------- reshard
    def reshard(self, j: int | None = None, frozen_only: bool = False) -> bool:
        """Stage 3: free ``full``'s storage of every buffer (or of buffer ``j``, or of the frozen
        ones: they have no gradient hook to say their backward is done) and show the stand-ins
        (guards.Released) until :meth:`to_sharded`; True if any was freed. Stages 0-2: a no-op."""
        freed = False
        if not self.reshard_after_forward:
            return freed
        for k, flat in enumerate(self.flats):
            if (j is not None and k != j) or (frozen_only and flat.requires_grad) \
                    or flat.mode is FlatMode.REPLICATED:  # never freed: the places keep their views
                continue
            if flat.mode is FlatMode.OWN and flat.is_gathered:
                flat.free()
                freed = True
            self.set_places(flat, [p.stand_in if p.stand_in is not None else p.user
                                   for p in self._params[k]])
        return freed
