"""Construction: from a plain ``nn.Module`` to units whose parameters live in flat buffers.

This runs once, when ``minishard.ZeRO`` wraps a model. What happens, in order:

1. **Which modules are units.** ``units=`` is a class, a collection of classes or a predicate;
   the root is always a unit (it owns whatever no other unit owns).
2. **Where every parameter appears.** A parameter may appear under several names: tied weights
   (``head.weight is emb.weight``) and one module object reachable by two paths
   (``b1.shared is b2.shared``). Every appearance is a :class:`~minishard.zero.unit.Place`.
3. **Who owns it.** A parameter goes to the innermost unit that contains ALL its appearances,
   so a shared weight is never split across units and never duplicated::

       root ── b1 (unit) ── shared (Linear)        shared.weight is used under b1 and under b2:
            └─ b2 (unit) ── shared (same object)   its owner is the root, gathered while both run

4. **Flat buffers.** A unit's parameters are grouped by (dtype, requires_grad, param group) and
   each group becomes one :class:`~minishard.zero.flat.FlatBuffer`. At stages 1-3 each parameter
   becomes a DTensor of this rank's rows (params.py; flat.py, ``adopt``); stage 0 keeps the
   module's own ``nn.Parameter`` objects. Names, shapes and ``requires_grad`` stay the user's.
5. **Values.** An eager model's values are broadcast from rank 0 first; a model with tensors on
   the meta device is materialised into the flat buffers one module at a time
   (deferred_init.py).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch import nn

from minishard import comm
from minishard.zero.params import Spec, mesh_of
from minishard.zero.deferred_init import DeferredInit, default_device, has_meta_tensors, materialize
from minishard.zero.flat import FlatBuffer, FlatMode
from minishard.zero.meters import WrapMeter, storage_bytes
from minishard.zero.unit import Place, Unit, is_inside

__all__ = ["unit_predicate", "replicated_predicate", "build_units", "sync_initial_state",
           "owned_params", "flat_groups", "flat_mode_of"]


def unit_predicate(units) -> Callable[[nn.Module], bool]:
    """``units=`` as a predicate: None (only the root), a class or classes, or a predicate."""
    if units is None:
        return lambda m: False
    if callable(units) and not isinstance(units, type):
        return units
    classes = tuple(units) if isinstance(units, Iterable) else (units,)
    return lambda m: isinstance(m, classes)


def replicated_predicate(replicate, persist_below: int) -> Callable[[nn.Parameter, list], bool]:
    """``replicate=`` (like ``units=``: classes or a predicate on a module) and ``persist_below=``
    as one question: is parameter ``p``, appearing at ``places``, kept whole on every rank? Yes
    when the modules owning it directly match, or when it has fewer than persist_below
    elements. A tied parameter whose modules disagree is refused: which would it be?"""
    matches = unit_predicate(replicate)

    def is_replicated(p: nn.Parameter, places) -> bool:
        if p.numel() < persist_below:
            return True
        answers = {bool(matches(place.module)) for place in places}
        if len(answers) > 1:
            raise ValueError(
                f"ZeRO: parameter {places[0].fqn!r} is tied across modules that replicate= "
                f"does and does not match ({', '.join(pl.fqn for pl in places)}); a parameter "
                "is kept whole or sharded, not both. Make replicate= match all of its modules "
                "or none.")
        return answers.pop()
    return is_replicated


def sync_initial_state(module: nn.Module, group) -> None:
    """Rank 0's values, broadcast: every rank starts from identical parameters and buffers."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            comm.broadcast(t.data, 0, group, tag=f"init {name}")


def build_units(root: nn.Module, units, groups, *, flat_mode: FlatMode,
                param_dtype: torch.dtype | None, group_of: Callable[[nn.Parameter], int],
                is_replicated=None, device=None, param_init_fn=None,
                meter: WrapMeter | None = None, model: int = 0,
                reshard_after_forward: bool = False) -> list[Unit]:
    """Find the units of ``root`` (``units=`` as ZeRO takes it), give every parameter to its
    owner, build the flat buffers on ``groups`` (config.Groups) and fill them.

    ``group_of(p)`` is the optimizer param group a parameter belongs to (0 when the user gave
    none): parameters of different groups never share a flat buffer, so each shard belongs to
    exactly one group. ``is_replicated(p, places)`` (:func:`replicated_predicate`): is a parameter
    kept whole on every rank? Tensors on the meta device are materialised on ``device`` by
    ``param_init_fn`` (deferred_init.py). ``model``: the number the buffers' stamps carry.
    Every unit comes back at rest (unit.py: SHARDED; stage 3, ``reshard_after_forward``, has
    freed its full buffers)."""
    deferred = None
    if has_meta_tensors(root):  # materialised below, broadcast from rank 0
        deferred = DeferredInit(torch.device(device) if device else default_device(),
                                param_init_fn)
    else:
        sync_initial_state(root, groups.every)
    meter = meter or WrapMeter()
    meter.hold(storage_bytes(list(root.parameters()) + list(root.buffers())))
    owned, places = owned_params(root, units)
    built = []
    for uname, mine in owned:  # registration order, root first
        unit = Unit(uname or "<root>", root if uname == "" else root.get_submodule(uname),
                    reshard_after_forward)
        _add_flats(unit, mine, places, groups, flat_mode, param_dtype, group_of, is_replicated,
                   deferred, meter, model)
        built.append(unit)
        if deferred is None:  # eager: free this unit's original tensors before the next unit
            _adopt(unit, meter)
    if deferred is not None:
        materialize(root, built, groups.every, deferred, meter)  # every rank: replicas agree
        for unit in built:
            _adopt(unit, meter)
    return built


def owned_params(root: nn.Module, units) -> tuple[list[tuple[str, list]], dict]:
    """([(unit name, the parameters it owns)] in registration order, root "" first; every
    place each parameter appears). Steps 1-3 of the module docstring; observe/predict.py too."""
    # Every path to every module (a module reachable by two paths appears twice).
    paths = list(root.named_modules(remove_duplicate=False))
    names, unit_paths = _find_units(root, paths, unit_predicate(units))
    places = _places(paths)
    owner = _owners(places, unit_paths)
    return [(uname, [p for p in places if owner[p] == uname]) for uname in names], places


def _find_units(root, paths, is_unit) -> tuple[list[str], dict[str, str]]:
    """(the units' names in registration order, root "" first; {module path: the name of the
    unit at that path}). A module is ONE unit, named by its first path; its other paths lead
    to it too."""
    unit_of_module: dict[int, str] = {id(root): ""}
    for name, m in paths:
        if name and id(m) not in unit_of_module and is_unit(m):
            unit_of_module[id(m)] = name
    unit_paths = {name: unit_of_module[id(m)] for name, m in paths if id(m) in unit_of_module}
    return list(dict.fromkeys(unit_of_module.values())), unit_paths


def _places(paths) -> dict[nn.Parameter, list[Place]]:
    """Every place each parameter appears (tied weights and shared modules: more than once)."""
    places: dict[nn.Parameter, list[Place]] = {}
    for mname, m in paths:
        for attr, p in m._parameters.items():
            if p is not None:
                places.setdefault(p, []).append(Place(m, attr, f"{mname}.{attr}" if mname
                                                      else attr))
    return places


def _owners(places, unit_paths: dict[str, str]) -> dict[nn.Parameter, str]:
    """Owner: the innermost unit that contains ALL appearances. Walk up from the first one's
    unit until some path of the candidate contains every other appearance."""
    def unit_of(module_path: str) -> str:
        """The innermost unit containing the module at this path (its canonical name)."""
        best = ""
        for path, canonical in unit_paths.items():
            if path and is_inside(module_path, path) and len(path) > len(best):
                best = path
        return unit_paths[best]

    def scope_of(unit_name: str) -> list[str]:
        return [p for p, c in unit_paths.items() if c == unit_name]

    owner: dict[nn.Parameter, str] = {}
    for p, where in places.items():
        users = [pl.fqn.rsplit(".", 1)[0] if "." in pl.fqn else "" for pl in where]
        common = unit_of(users[0])
        while not all(any(is_inside(u, s) for s in scope_of(common)) for u in users):
            above = scope_of(common)[0]
            common = unit_of(above.rsplit(".", 1)[0]) if "." in above else ""
        owner[p] = common
    return owner


def _add_flats(unit: Unit, params, places, groups, flat_mode: FlatMode, param_dtype, group_of,
               is_replicated, deferred: DeferredInit | None, meter: WrapMeter,
               model: int) -> None:
    """One flat buffer per (dtype, requires_grad, param group, device, compute dtype, kept
    whole) of ``unit``'s parameters. Mixed precision computes floating parameters in
    ``param_dtype``, except a BatchNorm's, kept in their own dtype as FSDP1 keeps them: torch's
    batch norm takes a half input with fp32 weights and fp32 running statistics, not half
    weights with fp32 statistics. A buffer kept whole (replicated) at stages 1-3 is stage 0's:
    mode REPLICATED over every rank of the engine, its user parameters ``Replicate()`` DTensors."""
    buckets = flat_groups(params, places, flat_mode, param_dtype, group_of, is_replicated,
                          deferred.device if deferred else None)
    devices = {key[3] for key in buckets}
    if len(devices) > 1:
        raise ValueError(
            f"ZeRO: unit {unit.name!r} has parameters on several devices "
            f"{sorted(map(str, devices))}; a unit's flat buffer lives on one device. Move the "
            "module to one device (module.to(device)) or make the submodules on other devices "
            "units of their own.")
    for (dtype, rg, pg, device, compute, replicated), ps in buckets.items():
        tag = (f"{unit.name}/{str(dtype).replace('torch.', '')}{'' if rg else '/frozen'}"
               f"{f'/group{pg}' if pg else ''}"
               f"{'/batchnorm' if dtype.is_floating_point and compute != param_dtype else ''}"
               f"{'/replicated' if replicated else ''}")
        layout = [p.to("meta") for p in ps] if deferred else ps  # values later
        flat = FlatBuffer(layout, groups.every if replicated else groups.shard,
                          mode=flat_mode_of(flat_mode, dtype, compute, replicated),
                          param_dtype=compute, name=tag, model=model,
                          replicate_group=None if replicated else groups.replicate,
                          device=deferred and deferred.device,
                          spec=None if flat_mode is FlatMode.REPLICATED else Spec(
                              mesh_of(groups, device.type), replicated=replicated))
        flat.param_group = pg  # which optimizer param group its shard belongs to
        unit.add_flat(flat, [places[p] for p in ps])
        meter.hold(flat.held_bytes())
        if deferred and not flat.is_gathered:  # flat.py allocated full and freed it at once
            meter.hold(flat.full_bytes)
            meter.drop(flat.full_bytes)


def flat_groups(params, places, flat_mode: FlatMode, param_dtype, group_of, is_replicated,
                device=None) -> dict[tuple, list[nn.Parameter]]:
    """``params`` by the flat buffer each goes to: (dtype, requires_grad, param group, device,
    compute dtype, kept whole) -> parameters, in order (``_add_flats``' rules)."""
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for p in params:  # deferred init puts every parameter on one device, real ones too
        batch_norm = any(isinstance(place.module, nn.modules.batchnorm._BatchNorm)
                         for place in places[p])
        compute = None if batch_norm or not p.dtype.is_floating_point else param_dtype
        replicated = (flat_mode is not FlatMode.REPLICATED and is_replicated is not None
                      and is_replicated(p, places[p]))
        buckets.setdefault((p.dtype, p.requires_grad, group_of(p), device or p.device, compute,
                            replicated), []).append(p)
    return buckets


def flat_mode_of(flat_mode: FlatMode, dtype, compute, replicated: bool) -> FlatMode:
    """The mode of a flat buffer of ``dtype`` computed in ``compute`` (None: its own)."""
    cast = compute is not None and compute != dtype  # mixed precision: see FlatMode
    return (FlatMode.REPLICATED if replicated else flat_mode).under_cast(cast)


def _adopt(unit: Unit, meter: WrapMeter) -> None:
    """The values are in the flat buffers: each original parameter now holds this rank's rows
    (its previous storage is freed), and every place holds it: the unit at rest (stage 3 frees
    its full buffers). One that cannot be kept (stages 1-3: a DTensor; a meta tensor, another
    device) is replaced: an optimizer built over it holds its successor (guards.py). The
    module is marked wrapped here, when its parameters change: a wrap that fails before (a
    deferred initialiser that raises) leaves the model as it was, to wrap again."""
    unit.module._minishard_unit = unit.name
    for flat in unit.flats:
        params = list(unit.params(flat))
        originals = [p.places[0].module._parameters[p.places[0].attr] for p in params]
        meter.drop(storage_bytes(originals))
        for original, new in zip(originals, flat.adopt(originals)):
            if new is not original:  # an optimizer built over it holds ``new`` (guards.py)
                original._minishard_successor = weakref.ref(new)
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
    held = sum(flat.held_bytes() for flat in unit.flats)
    unit.to_sharded()
    meter.drop(held - sum(flat.held_bytes() for flat in unit.flats))
