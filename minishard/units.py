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
5. **Deferred init** (a module built under ``with torch.device("meta"):``, wholly or partly).
   The flat buffers are laid out first, holding only what the stage keeps (stage 3: this
   rank's shards; 0-2: the full buffers), as zeros. Then :func:`materialize` walks
   ``root.modules()`` in order, ONE MODULE AT A TIME::

       for each module m with tensors on the meta device:
           allocate m's own tensors on ``device``          (parameters and buffers, not its children's)
           rank 0: fill them with NaN, run param_init_fn(m) or m.reset_parameters()
           rank 0: anything still NaN / untouched?  -> the verdict, broadcast: every rank raises
           broadcast each tensor from rank 0; each rank copies the part it keeps into its
           shard (flat.write_param), keeps the buffers, frees the rest

   So no rank holds more than what its stage keeps + one module's full tensors (+ the buffers,
   which every rank keeps): at stage 3, the shards + at most the largest unit's full tensors,
   when each module's tensors belong to its unit. (Laying out a stage-3 buffer allocates its
   full tensor and frees it at once, untouched: also within that bound.) ``WrapMeter`` counts
   it all; tests/test_deferred_init.py checks the count exactly.

   **Why module by module, in modules() order.** Building under ``torch.device("meta")``
   consumes no random numbers, and ``modules()`` visits submodules in registration order, so
   calling each one's initialiser in that order, on the CPU generator, with the same seed,
   draws the SAME numbers as the eager ``torch.manual_seed(s); build()`` -- whatever the units
   are. (Materialising unit by unit would not: the root unit's embedding and head sit on
   either side of the blocks in the drawing order.) Guarantee, tested: equal to the eager build,
   bit for bit, on ``device="cpu"``, when every module creates its own tensors with its
   ``reset_parameters()`` (as torch's layers do) and registers its submodules in the order it
   builds them. What differs otherwise, plainly:

   * a module whose ``__init__`` draws random numbers outside ``reset_parameters()``, or creates
     its own tensors AFTER building its children (``modules()`` visits a parent first), or
     registers children in another order than it builds them: other numbers (same distribution);
   * a tied parameter takes the value of its FIRST user in ``modules()`` order (an eager
     ``head.weight = emb.weight`` keeps the embedding's, as here); later users' initialisers
     still run, on a scratch copy, so the numbers drawn after them stay aligned;
   * a model mixing real and meta modules: real modules keep their values (rank 0's) and their
     initialisers do not run, so the meta modules after them draw other numbers than an eager
     build would;
   * another ``device`` draws from that device's generator (CUDA's), not the CPU's;
   * only rank 0 runs the initialisers: afterwards rank 0's generator is where an eager build
     leaves it, the other ranks' are untouched.

   A meta tensor that no initialiser wrote (a RoPE ``inv_freq`` computed in ``__init__`` is lost
   on the meta device, and ``reset_parameters`` may not recompute it) is an error naming the
   module and the tensor, on every rank, at wrap time: never uninitialised memory.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from minishard import comm
from minishard.flat import FlatBuffer

__all__ = ["Unit", "Binding", "unit_predicate", "build_units", "check_same_config",
           "sync_initial_state", "cast_buffers", "DeferredInit", "WrapMeter", "materialize",
           "has_meta_tensors", "default_device", "rank0_verdict", "detached_views", "is_inside"]


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
        self.views = [flat.views() if not detached else detached_views(flat)
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


def detached_views(flat: FlatBuffer) -> list[torch.Tensor]:
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


def is_inside(name: str, scope: str) -> bool:
    """Is module path ``name`` the module ``scope`` or inside it? ("" is the root: everything.)"""
    return scope == "" or name == scope or name.startswith(scope + ".")


class WrapMeter:
    """Bytes of parameter and buffer storage this rank holds while wrapping (the module's own
    tensors, flat buffers, shards, tensors materialised for an initialiser), and the most at
    once: ``memory_report()["peak_wrapping"]``. Counted where the wrap allocates and frees."""

    def __init__(self, start: int = 0) -> None:
        self.now = self.peak = start

    def hold(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, nbytes: int) -> None:
        self.now -= nbytes


@dataclasses.dataclass(frozen=True)
class DeferredInit:
    """Where meta tensors are materialised, and how they are initialised (see materialize)."""
    device: torch.device
    param_init_fn: Callable[[nn.Module], None] | None = None

    def __post_init__(self) -> None:
        if self.device.type == "meta":
            raise ValueError("ZeRO: device='meta' would leave the model without values; pass "
                             "the device to materialise on (device='cpu' or a CUDA device)")


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _nbytes(tensors) -> int:
    """Bytes of the distinct real storages behind ``tensors`` (meta ones hold nothing)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None and not t.is_meta}
    return sum(storages.values())


def build_units(root: nn.Module, is_unit: Callable[[nn.Module], bool], group, *, flat_mode: str,
                param_dtype: torch.dtype | None, group_of: Callable[[nn.Parameter], int],
                replicate_group=None, deferred: DeferredInit | None = None,
                meter: WrapMeter | None = None, init_group=None) -> list[Unit]:
    """Find the units of ``root``, give every parameter to its owner, build the flat buffers.

    ``group_of(p)`` is the optimizer param group a parameter belongs to (0 when the user gave
    none): parameters of different groups never share a flat buffer, so each shard belongs to
    exactly one group. With ``deferred``, tensors on the meta device are materialised into them
    (:func:`materialize`, step 5 of the module docstring).
    """
    meter = meter or WrapMeter()
    meter.hold(_nbytes(list(root.parameters()) + list(root.buffers())))
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
            if path and is_inside(module_path, path) and len(path) > len(best):
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
        while not all(any(is_inside(u, s) for s in scope_of(common)) for u in users):
            above = scope_of(common)[0]
            common = unit_of(above.rsplit(".", 1)[0]) if "." in above else ""
        owner[p] = common

    units = []
    for uname in dict.fromkeys(unit_of_module.values()):  # registration order, root first
        module = root if uname == "" else root.get_submodule(uname)
        unit = Unit(uname or "<root>", module)
        mine = [p for p in places if owner[p] == uname]
        buckets: dict[tuple, list[nn.Parameter]] = {}
        for p in mine:  # deferred init puts every parameter on one device, real ones too
            device = deferred.device if deferred else p.device
            buckets.setdefault((p.dtype, p.requires_grad, group_of(p), device), []).append(p)
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
            layout = [p.to("meta") for p in params] if deferred else params  # values later
            flat = FlatBuffer(layout, group, mode=flat_mode, param_dtype=compute, name=tag,
                              replicate_group=replicate_group, device=deferred and deferred.device)
            flat.param_group = pg  # which optimizer param group its shard belongs to
            unit.flats.append(flat)
            unit.bindings.append([places[p] for p in params])
            flat = unit.flats[-1]
            meter.hold(flat.held_bytes())
            if deferred and not flat.is_gathered:  # flat.py allocated full and freed it at once
                meter.hold(flat.full_bytes())
                meter.drop(flat.full_bytes())
        module._minishard_unit = unit.name
        units.append(unit)
        if deferred is None:  # eager: free this unit's original tensors before the next unit
            _release_originals(unit, meter)
    if deferred is not None:
        materialize(root, units, init_group, deferred, meter)  # every rank: replicas agree
        for unit in units:
            _release_originals(unit, meter)
    return units


def _release_originals(unit: Unit, meter: WrapMeter) -> None:
    """The module's parameters are now in the flat buffers: take them out of the module, free
    their storage, and mark them (to catch an optimizer built before wrapping)."""
    for flat, params_places in zip(unit.flats, unit.bindings):
        for bindings in params_places:
            p = bindings[0].module._parameters[bindings[0].attr]
            for b in bindings:
                b.module._parameters.pop(b.attr, None)
            meter.drop(_nbytes([p]))
            p._minishard_replaced = True
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


# --------------------------------------------------------------------- deferred (meta) init
def materialize(root: nn.Module, units: list[Unit], group, deferred: DeferredInit,
                meter: WrapMeter) -> None:
    """Give every meta tensor of ``root`` its values, one module at a time in ``modules()``
    order (the module docstring, step 5, says why that order): parameters go into the flat
    buffers (each rank keeps its part), buffers stay in their modules. Real tensors of a mixed
    model are broadcast from rank 0 the same way. Collective: every rank walks the same
    modules and issues the same broadcasts."""
    slots = {(id(b.module), b.attr): (flat, j) for unit in units
             for flat, places in zip(unit.flats, unit.bindings)
             for j, bindings in enumerate(places) for b in bindings}
    written: set[tuple[int, int]] = set()      # (id(flat), j): parameter values in place
    buffers: dict[int, torch.Tensor] = {}      # id(original buffer) -> the one it became
    for name, module in root.named_modules():
        _materialize_module(name, module, slots, written, buffers, group, deferred, meter)


def _materialize_module(name, module, slots, written, buffers, group, deferred, meter) -> None:
    """One module's own tensors: materialise, initialise on rank 0, check, broadcast, keep.

    A *target* is a meta tensor not materialised yet: the initialiser must write it. The
    module's other tensors (real ones, a tied parameter an earlier module already wrote, a
    shared buffer) are shown to the initialiser as scratch copies, so it cannot change them."""
    own = [(kind, attr, t) for kind, table in (("parameter", module._parameters),
                                               ("buffer", module._buffers))
           for attr, t in table.items() if t is not None]
    def is_done(kind: str, attr: str, t: torch.Tensor) -> bool:
        if kind == "buffer":
            return id(t) in buffers
        flat, j = slots[id(module), attr]
        return (id(flat), j) in written

    done = {attr for kind, attr, t in own if is_done(kind, attr, t)}
    targets = {attr: _empty_like(t, deferred.device) for kind, attr, t in own
               if t.is_meta and attr not in done}
    meter.hold(_nbytes(targets.values()))
    if any(t.is_meta for _, _, t in own):  # a tied user too: its initialiser draws numbers
        error = None
        if comm.group_rank(group) == 0:
            targets, error = _initialise(name, module, own, targets, deferred, meter)
        error = rank0_verdict(error, group, deferred.device, tag=f"init {name or '<root>'}")
        if error is not None:
            raise RuntimeError(error)
    for kind, attr, t in own:
        if attr in done:
            if kind == "buffer":
                module._buffers[attr] = buffers[id(t)]
            continue
        value = targets.get(attr, t)
        comm.broadcast(value.data, 0, group, tag=f"init {name + '.' if name else ''}{attr}")
        if kind == "parameter":
            flat, j = slots[id(module), attr]
            flat.write_param(j, value)
            written.add((id(flat), j))
            meter.drop(_nbytes([value]) if attr in targets else 0)
        else:
            module._buffers[attr] = buffers[id(t)] = value


def _empty_like(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else out


def _initialise(name, module, own, targets, deferred, meter):
    """Rank 0: run the module's initialiser on ``targets`` (NaN-filled; the module's other
    tensors swapped for scratch copies), put the module back as it was, and say what was not
    written. Returns (the values, by attribute; an error message or None)."""
    tables = {"parameter": module._parameters, "buffer": module._buffers}
    saved = {(kind, attr): t for kind, attr, t in own}
    scratch = {attr: _empty_like(t, deferred.device) for kind, attr, t in own if attr not in targets}
    meter.hold(_nbytes(scratch.values()))
    with torch.no_grad():
        for t in targets.values():
            _fill_sentinel(t)
    before = {attr: (t._version, t.data_ptr()) for attr, t in targets.items()}
    for kind, attr, _ in own:
        tables[kind][attr] = targets.get(attr, scratch.get(attr))
    init = deferred.param_init_fn or _reset_parameters
    error = None
    try:
        with torch.no_grad():
            init(module)
    except Exception as exc:  # tell the other ranks, rather than leave them waiting
        who = "param_init_fn" if deferred.param_init_fn else "reset_parameters()"
        error = (f"ZeRO deferred init: {who} of module {name or '<root>'!r} "
                 f"({type(module).__name__}) raised {type(exc).__name__}: {exc}")
    values = {attr: tables[kind][attr] for kind, attr, _ in own if attr in targets}
    for (kind, attr), t in saved.items():  # the module as it was (parameters leave it later)
        tables[kind][attr] = t
    meter.drop(_nbytes(scratch.values()))
    if error is None:
        error = _unwritten(name, module, own, targets, values, before, deferred)
    return values, error


def _reset_parameters(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _fill_sentinel(t: torch.Tensor) -> None:
    """Floating tensors get NaN: an element still NaN after the initialiser was not written."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))


def _was_written(value: torch.Tensor | None, installed: torch.Tensor, before) -> bool:
    """Did the initialiser write ``installed`` (or replace it by a real tensor)? Floating
    tensors: no NaN left. Others: replaced, or their version counter or storage moved."""
    if value is None or value.is_meta:
        return False
    if value.is_floating_point() or value.is_complex():  # in chunks: no tensor-sized mask
        return not any(bool(torch.isnan(c).any()) for c in value.detach().reshape(-1).split(2**16))
    return value is not installed or (value._version, value.data_ptr()) != before


def _unwritten(name, module, own, targets, values, before, deferred) -> str | None:
    """The error naming every target the initialiser left unwritten (or replaced by a tensor
    of another shape or dtype), or None."""
    prefix = f"{name}." if name else ""
    declared = {attr: (kind, t) for kind, attr, t in own}
    bad = []
    for attr, value in values.items():
        kind, t = declared[attr]
        if not _was_written(value, targets[attr], before[attr]):
            bad.append(f"{kind} {prefix}{attr}")
        elif (value.shape, value.dtype, value.device) != (t.shape, t.dtype, targets[attr].device):
            bad.append(f"{kind} {prefix}{attr} (set to a {tuple(value.shape)} {value.dtype} "
                       f"tensor on {value.device}; declared {tuple(t.shape)} {t.dtype} on "
                       f"{targets[attr].device})")
    if not bad:
        return None
    cls = type(module).__name__
    how = ("param_init_fn(module) did not (fully) write it" if deferred.param_init_fn else
           f"{cls}.reset_parameters() did not (fully) write it"
           if hasattr(module, "reset_parameters") else
           f"no initialiser wrote it ({cls} has no reset_parameters())")
    return (f"ZeRO deferred init: {', '.join(bad)} of module {name or '<root>'!r} ({cls}) is "
            f"on the meta device and {how}; refusing to train on uninitialised memory. Tensors computed in __init__ "
            "(a RoPE inv_freq, a causal mask) are lost on the meta device: recompute them in "
            "the module's reset_parameters(), pass ZeRO(..., param_init_fn=fn) where fn(module) "
            "writes the module's own tensors, or build that module on a real device.")


def rank0_verdict(error: str | None, group, device=None, tag: str = "verdict") -> str | None:
    """Rank 0's decision, on every rank: None (go on) or the error every rank must raise. Two
    broadcasts (the message's length, then its text if any), so every rank raises the same
    error at the same point, before any later collective could hang."""
    data = (error or "").encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.broadcast(length, 0, group, tag=f"{tag} (verdict)")
    if length.item() == 0:
        return None
    text = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            if comm.group_rank(group) == 0 else
            torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    comm.broadcast(text, 0, group, tag=f"{tag} (verdict text)")
    return bytes(text.cpu().tolist()).decode(errors="replace")


def check_same_config(module: nn.Module, stage: int, group) -> None:
    """Ranks that disagree on the stage or the model would deadlock later in mismatched
    collectives; compare a small fingerprint now (MAX of x and of -x gives max and min)."""
    params = list(module.parameters())
    meta = sum(t.is_meta for t in params + list(module.buffers()))  # deferred init: a walk
    mine = torch.tensor([stage, sum(p.numel() for p in params), len(params), meta],
                        dtype=torch.float64)                  # of broadcasts on every rank
    both = torch.cat([mine, -mine])
    comm.all_reduce(both, "max", group, tag="ZeRO config check")
    hi, lo = both[:4], -both[4:]
    if not torch.equal(hi, lo):
        raise RuntimeError(
            f"ZeRO: ranks disagree on the configuration (stage, parameter count, number of "
            f"parameter tensors, tensors on the meta device): this rank has "
            f"{mine.long().tolist()}, the ranks range from "
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
