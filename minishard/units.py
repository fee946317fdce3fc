"""Construction: from a plain ``nn.Module`` to units whose parameters live in flat buffers.

This module runs once, when ``minishard.ZeRO`` wraps a model; the schedule (hooks, reductions,
gathers) lives in zero.py. What happens, in order:

1. **Which modules are units.** ``units=`` is a class, a collection of classes or a predicate;
   the root is always a unit (it owns whatever no other unit owns).
2. **Where every parameter appears.** A parameter may appear under several names: tied weights
   (``head.weight is emb.weight``) and one module object reachable by two paths
   (``b1.shared is b2.shared``). Every appearance is a :class:`Binding`; state dicts list every
   name, as ``module.state_dict()`` does.
3. **Who owns it.** A parameter goes to the innermost unit that contains ALL its appearances,
   so a shared weight is never split across units and never duplicated::

       root ── b1 (unit) ── shared (Linear)        shared.weight is used under b1 and under b2:
            └─ b2 (unit) ── shared (same object)   its owner is the root, gathered while both run

4. **Flat buffers.** A unit's parameters are grouped by (dtype, requires_grad, param group) and
   each group becomes one :class:`~minishard.flat.FlatBuffer`. The module's ``_parameters``
   entries are removed: from now on its attributes are views of the flat buffer, set by the
   engine (:meth:`Unit.bind_views`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from minishard import comm
from minishard.flat import FlatBuffer

__all__ = ["Unit", "Binding", "unit_predicate", "build_units", "check_same_config",
           "sync_initial_state", "cast_buffers"]


@dataclasses.dataclass
class Binding:
    """One place a flattened parameter appears in the module tree (tied params appear twice)."""
    module: nn.Module
    attr: str
    fqn: str


class Unit:
    """One module and the flat buffers of the parameters it owns (see flat.py)."""

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name, self.module = name, module
        self.flats: list[FlatBuffer] = []
        self.bindings: list[list[list[Binding]]] = []  # [flat][param] -> places it appears
        self.views: list[list[torch.Tensor]] = []       # [flat][param] -> its bound view

    def bind_views(self, detached: bool = False) -> None:
        """Point every owning module's attribute at its view of the full buffer."""
        self.views = [flat.views() if not detached else _detached_views(flat)
                      for flat in self.flats]
        self.rebind_views()

    def rebind_views(self) -> None:
        """Bind the views made by the last :meth:`bind_views` again (after stand-ins replaced
        them): the same tensors, so a recomputation in backward joins the forward's graph."""
        for flat, places, views in zip(self.flats, self.bindings, self.views):
            self.bind(flat, places, views)

    @staticmethod
    def bind(flat: FlatBuffer, places: list[list[Binding]], values: list[torch.Tensor]) -> None:
        for value, bindings in zip(values, places):
            for b in bindings:
                setattr(b.module, b.attr, value)


def _detached_views(flat: FlatBuffer) -> list[torch.Tensor]:
    with torch.no_grad():
        return [v.detach() for v in flat.views()]


def unit_predicate(units) -> Callable[[nn.Module], bool]:
    """``units=`` as a predicate: None (only the root), a class or classes, or a predicate."""
    if units is None:
        return lambda m: False
    if callable(units) and not isinstance(units, type):
        return units
    classes = tuple(units) if isinstance(units, Iterable) else (units,)
    return lambda m: isinstance(m, classes)


def _inside(name: str, scope: str) -> bool:
    """Is module path ``name`` the module ``scope`` or inside it? ("" is the root: everything.)"""
    return scope == "" or name == scope or name.startswith(scope + ".")


def build_units(root: nn.Module, is_unit: Callable[[nn.Module], bool], group, *, flat_mode: str,
                param_dtype: torch.dtype | None, group_of: Callable[[nn.Parameter], int]
                ) -> list[Unit]:
    """Find the units of ``root``, give every parameter to its owner, build the flat buffers.

    ``group_of(p)`` is the optimizer param group a parameter belongs to (0 when the user gave
    none): parameters of different groups never share a flat buffer, so each shard belongs to
    exactly one group.
    """
    # Every path to every module (a module reachable by two paths appears twice)...
    paths = list(root.named_modules(remove_duplicate=False))
    # ... but a module is ONE unit, named by its first path; its other paths lead to it too.
    unit_of_module: dict[int, str] = {id(root): ""}
    for name, m in paths:
        if name and id(m) not in unit_of_module and is_unit(m):
            unit_of_module[id(m)] = name
    unit_paths = {name: unit_of_module[id(m)] for name, m in paths if id(m) in unit_of_module}

    def unit_of(module_path: str) -> str:
        """The innermost unit containing the module at this path (its canonical name)."""
        best = ""
        for path, canonical in unit_paths.items():
            if path and _inside(module_path, path) and len(path) > len(best):
                best = path
        return unit_paths[best]

    def scope_of(unit_name: str) -> list[str]:
        return [p for p, c in unit_paths.items() if c == unit_name]

    # Every place each parameter appears (tied weights and shared modules: more than once).
    places: dict[nn.Parameter, list[Binding]] = {}
    for mname, m in paths:
        for attr, p in m._parameters.items():
            if p is not None:
                places.setdefault(p, []).append(Binding(m, attr, f"{mname}.{attr}" if mname
                                                         else attr))

    # Owner: the innermost unit that contains ALL appearances. Walk up from the first one's unit
    # until some path of the candidate contains every other appearance.
    owner: dict[nn.Parameter, str] = {}
    for p, bindings in places.items():
        users = [b.fqn.rsplit(".", 1)[0] if "." in b.fqn else "" for b in bindings]
        common = unit_of(users[0])
        while not all(any(_inside(u, s) for s in scope_of(common)) for u in users):
            above = scope_of(common)[0]
            common = unit_of(above.rsplit(".", 1)[0]) if "." in above else ""
        owner[p] = common

    units = []
    for uname in dict.fromkeys(unit_of_module.values()):  # registration order, root first
        module = root if uname == "" else root.get_submodule(uname)
        unit = Unit(uname or "<root>", module)
        mine = [p for p in places if owner[p] == uname]
        buckets: dict[tuple, list[nn.Parameter]] = {}
        for p in mine:
            buckets.setdefault((p.dtype, p.requires_grad, group_of(p), p.device), []).append(p)
        devices = {key[3] for key in buckets}
        if len(devices) > 1:
            raise ValueError(
                f"ZeRO: unit {unit.name!r} has parameters on several devices "
                f"{sorted(map(str, devices))}; a unit's flat buffer lives on one device. Move the "
                "module to one device (module.to(device)) or make the submodules on other devices "
                "units of their own.")
        for (dtype, rg, pg, _), params in buckets.items():
            tag = (f"{unit.name}/{str(dtype).replace('torch.', '')}{'' if rg else '/frozen'}"
                   f"{f'/group{pg}' if pg else ''}")
            compute = param_dtype if dtype.is_floating_point else None
            flat = FlatBuffer(params, group, mode=flat_mode, param_dtype=compute, name=tag)
            flat.param_group = pg  # which optimizer param group its shard belongs to
            unit.flats.append(flat)
            unit.bindings.append([places[p] for p in params])
        for params_places in unit.bindings:
            for bindings in params_places:
                for b in bindings:
                    b.module._parameters.pop(b.attr, None)
        for p in mine:  # release the original storage; remember it to catch stale optimizers
            p._minishard_replaced = True
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        module._minishard_unit = unit.name
        units.append(unit)
    return units


def check_same_config(module: nn.Module, stage: int, group) -> None:
    """Ranks that disagree on the stage or the model would deadlock later in mismatched
    collectives; compare a small fingerprint now (MAX of x and of -x gives max and min)."""
    params = list(module.parameters())
    mine = torch.tensor([stage, sum(p.numel() for p in params), len(params)], dtype=torch.float64)
    both = torch.cat([mine, -mine])
    comm.all_reduce(both, "max", group, tag="ZeRO config check")
    hi, lo = both[:3], -both[3:]
    if not torch.equal(hi, lo):
        raise RuntimeError(
            f"ZeRO: ranks disagree on the configuration (stage, parameter count, number of "
            f"parameter tensors): this rank has {mine.long().tolist()}, the ranks range from "
            f"{lo.long().tolist()} to {hi.long().tolist()}. Every rank must wrap the same model "
            "with the same stage.")


def sync_initial_state(module: nn.Module, group) -> None:
    """Rank 0's values, broadcast: every rank starts from identical parameters and buffers."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            comm.broadcast(t.data, 0, group, tag=f"init {name}")


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
