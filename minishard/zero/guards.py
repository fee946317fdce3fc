"""Misuse guards: mistakes that would otherwise train silently wrong, turned into errors that
say what to do. Each is set up once, when the engine wraps a model; none costs a step anything.

1. **A state dict of shards** (:func:`guard_parameters`): at stages 1-3 the module's parameters
   are DTensors (params.py), so ``model.module.state_dict()`` holds DTensors, as FSDP2's
   does: no collective (nothing hangs), and a file of them cannot load into a plain model as if
   it were whole (``copy_`` refuses a DTensor). ``load_state_dict`` takes DTensors, or FULL
   plain tensors: each rank keeps its rows of each. A shard knows whose it is: each DTensor a
   state dict hands out (the model's, the optimizer's) carries the rows it holds, and a load
   of another rank's rows raises on every rank (:class:`_Loads`, :func:`_check_rows`).
2. **A parameter used outside its unit's compute** (:func:`guard_parameters`): its gradient would
   reach the user parameter directly, unaveraged (and at stages 1-3 it is only this rank's
   rows), so ranks would drift apart. Autograd accumulating into it raises instead. At stage
   3, during a forward, a unit done with its forward shows :class:`Released` stand-ins of the
   right shape and no storage: any use names the parameter and its unit, instead of computing
   with this rank's rows (or torch's opaque shape error).
3. **An optimizer built before wrapping** (:func:`adopt_live_optimizers`, at the wrap):
   nanoGPT's and DDP's order (build it, maybe load its state, then wrap). At stages 1-3 every
   parameter is replaced by a DTensor (as under FSDP2, where such an optimizer would silently
   train nothing), so before ``ZeRO(...)`` returns every live optimizer holding a replaced
   parameter holds its successor instead, in its place, with its state (state shaped for a
   full parameter keeps this rank's rows): whatever reads ``param_groups`` next (clipping,
   GradScaler, Join, a state dict) sees the model's parameters. A global step pre-hook
   (engine.py's, calling :func:`adopt_optimizer`) checks again at each optimizer's first step,
   and after it loads a state dict: the backstop.
"""
from __future__ import annotations

import gc
import weakref
import zlib

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from minishard.verdicts import all_gather_object

__all__ = ["Released", "guard_parameters", "adopt_optimizer", "adopt", "CHECKED", "adopt_live_optimizers", "whole_state", "refuse_deepcopy"]


class Released(torch.Tensor):
    """What a stage-3 module attribute holds during a forward once its unit is done with it (its
    full value is freed). Any use raises an error naming the parameter."""

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
        me = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Released))
        raise RuntimeError(
            f"ZeRO stage 3: parameter {me._minishard_name!r} (owned by unit {me._minishard_unit!r}) "
            "was used while its unit is not gathered: at stage 3 its full value exists only while "
            f"{me._minishard_unit!r} runs forward or backward. If another module reads it in its "
            "own forward (a head reusing an embedding's weight), let ONE unit contain both users "
            "(choose units= so that their common parent owns it, or tie the parameter so both "
            "modules hold it); to read values outside forward, use `with model.gathered():`.")


def guard_parameters(units, module: torch.nn.Module, stand_ins: bool, groups: list) -> None:
    """Guards 1 and 2 on every module of ``module`` and every user parameter of ``units``
    (``stand_ins``: stage 3's :class:`Released`, kept on each ``Param``); ``groups``: where a
    load's verdict is all-reduced, every rank of the engine (none at stage 0: no shards)."""
    for unit in units:
        for param in unit.params():
            p, flat = param.user, param.flat
            if stand_ins:  # the parameter's shape, no storage (meta)
                param.stand_in = torch.Tensor._make_subclass(
                    Released, torch.empty(param.shape, dtype=flat.param_dtype, device="meta"))
                param.stand_in._minishard_name = param.name
                param.stand_in._minishard_unit = unit.name
            p._minishard_slot = (flat, param.index)  # for the load hook; marks it as ours
            p._minishard_verdict = groups  # where a check of its optimizer state is agreed
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_refuse_direct_use(param.name, unit.name))
    loads = _Loads(groups)
    for m in module.modules():
        m.register_state_dict_post_hook(_copy_my_rows)
        m.register_load_state_dict_pre_hook(loads.start)  # before the module's own check
        m.register_load_state_dict_pre_hook(loads.keep_my_rows)
        m.register_load_state_dict_post_hook(loads.end)


def _copy_my_rows(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` at stages 1-3: each DTensor holds a COPY of this rank's rows, marked with
    which rows they are (``_minishard_rows``: a torch.save keeps it). torch builds a DTensor's
    wrapper with its local tensor's storage offset, and ``torch.save`` then fails on one that
    views the middle of a flat buffer (torch 2.13); a copy starts at 0, so ``if rank == 0:
    torch.save(model.module.state_dict(), f)`` writes DTensors, as under FSDP2."""
    for attr, p in module._parameters.items():
        slot, key = getattr(p, "_minishard_slot", None), prefix + attr
        value = state_dict.get(key)
        if slot is not None and isinstance(value, DTensor) and value is not p:  # not keep_vars
            state_dict[key] = slot[0].as_user(slot[1], value._local_tensor.clone())
            state_dict[key]._minishard_rows = slot[0].row_ranges[slot[1]]


def _check_rows(value, flat, j: int, what: str) -> str | None:
    """Why ``value`` (a DTensor shard from a state dict) is not this rank's rows of parameter j
    of ``flat``, or None: it is, or it carries no mark (made by torch, not handed out here)."""
    rows = getattr(value, "_minishard_rows", None)
    if rows is None or tuple(rows) == tuple(flat.row_ranges[j]):
        return None
    (lo, hi), (mine_lo, mine_hi) = rows, flat.row_ranges[j]
    return (f"{what} holds rows {lo}:{hi} of the parameter, saved by the rank that holds them, "
            f"but this rank holds rows {mine_lo}:{mine_hi}: a state dict of DTensor shards "
            "(model.module.state_dict(), optimizer.state_dict()) is one rank's, and loading it "
            "on another rank would train with that rank's numbers. Let each rank load the file "
            "it saved, or save what every rank can load: model.full_state_dict() and "
            "minishard.full_optimizer_state_dict(model, optimizer) (on every rank; rank 0 may "
            "write them), or minishard.save_checkpoint(path, model, optimizer).")


class _Loads:
    """Guard 1 at ``load_state_dict``: plain full tensors become this rank's rows; a DTensor
    shard of another cut is refused at once (every rank sees that), one of another rank's rows
    (:func:`_check_rows`) is not loaded and, at the end of the load (of the model or of the
    module it was called on), every rank raises together (verdicts.py: that rank alone would
    leave the others waiting in a collective)."""

    def __init__(self, groups: list) -> None:
        self.groups, self.problem, self.outermost, self.held = groups, None, None, {}

    def start(self, module, *args) -> None:
        if self.outermost is None:  # the module load_state_dict was called on
            self.outermost, self.problem, self.held = module, None, {}

    def keep_my_rows(self, module, state_dict, prefix, *args) -> None:
        for attr, p in module._parameters.items():
            slot, key = getattr(p, "_minishard_slot", None), prefix + attr
            if slot is None or key not in state_dict:
                continue
            flat, j = slot
            value = state_dict[key]
            if isinstance(value, DTensor) and _cut(value) != _cut(p):
                raise RuntimeError(
                    f"load_state_dict: {key!r} holds {_cut(value)}, but this model holds it as "
                    f"{_cut(p)}: a state dict of DTensor shards (model.state_dict(), saved by "
                    "each rank) loads only at the world size and stage that saved it. Across "
                    "them, save with minishard.save_checkpoint(path, model, optimizer) and load "
                    "with load_checkpoint (either format reshards), or save full tensors: "
                    "model.full_state_dict() (loadable into any model, wrapped or plain).")
            foreign = isinstance(value, DTensor) and _check_rows(value, flat, j, repr(key))
            if foreign:
                self.problem = self.problem or foreign
                state_dict[key] = p  # loads nothing: the model keeps its own rows
            elif isinstance(value, DTensor) and not flat.is_replicated(j):
                self.held[repr(key)] = _content(value, flat.row_ranges[j])
            elif type(value) is torch.Tensor and value.shape == flat.shapes[j]:
                state_dict[key] = flat.as_user(j, flat.my_rows(j, value).to(p.dtype))

    def end(self, module, incompatible_keys) -> None:
        if module is not self.outermost:
            return
        problem, self.problem, self.outermost = self.problem, None, None
        _agree(problem, self.held, self.groups, "load_state_dict")


def _content(t: torch.Tensor, rows) -> tuple | None:
    """(the rows ``t`` holds, a CRC of its bytes) for the ranks to compare, or None where bytes
    cannot tell whose they are: no rows here, or every element alike."""
    t = t._local_tensor.detach() if isinstance(t, DTensor) else t.detach()
    if t.numel() == 0 or bool((t == t.reshape(-1)[0]).all()):
        return None
    return tuple(rows), zlib.crc32(t.contiguous().cpu().view(torch.uint8).numpy())


def _agree(problem: str | None, held: dict, groups: list, what: str) -> None:
    """Every rank raises together if any rank found a ``problem`` (another rank's mark), or if
    two ranks loaded the same bytes (``held``: {key: _content}) for different rows of one key:
    one was given the other's shard, its mark lost (a ``.detach()`` or ``.clone()`` copy)."""
    seen = [entry for group in groups for entry in all_gather_object(
        (problem, {k: c for k, c in held.items() if c is not None}), group, tag=f"{what}: rows")]
    found = next((p for p, _ in seen if p), None)
    for key, (rows, crc) in [(k, c) for k, c in held.items() if c] if found is None else []:
        alike = sorted({other[key][0] for _, other in seen if other.get(key, (0, -1))[1] == crc})
        if len(alike) > 1:
            found = (f"{key}: ranks holding rows {alike[0][0]}:{alike[0][1]} and {alike[1][0]}:"
                     f"{alike[1][1]} of it hold the same values after this load, so one holds "
                     "the other's (a copy of a state dict of shards, .detach() or .clone(), "
                     "drops the mark that says whose rows a shard holds). Let each rank load "
                     "the file it saved, or save what every rank can load: "
                     "model.full_state_dict() and minishard.full_optimizer_state_dict(model, "
                     "optimizer), or minishard.save_checkpoint(path, model, optimizer).")
    if problem or found:
        raise RuntimeError(f"{what}: {problem or found}" if problem or not groups else
                           f"{what}: a rank was given a state dict of shards another rank saved "
                           f"(its error names the parameter); nothing of it is used. {found}")


def _cut(t: torch.Tensor) -> str:
    """How a tensor is cut over the ranks, in words (equal words: the same cut; which rows a
    rank holds of it is :func:`_check_rows`' question)."""
    if not isinstance(t, DTensor):
        return f"a whole tensor of shape {tuple(t.shape)} (stage 0)"
    return (f"a DTensor of shape {tuple(t.shape)} cut over ranks "
            f"{t.device_mesh.mesh.tolist()} ({', '.join(map(str, t.placements))})")


def _refuse_direct_use(name: str, unit: str):
    def hook(p: torch.Tensor) -> None:
        p.grad = None
        raise RuntimeError(
            f"parameter {name!r} (unit {unit!r}) got a gradient directly: it was used outside "
            "the module's forward (a loss term over model.parameters(), such as an L2 penalty; "
            "a tensor kept from before a forward; at stage 3, read outside the forward of "
            f"{unit!r}), so its gradient would not go through the engine's reduction, and at "
            "stages 1-3 it is only this rank's rows. Compute such a term inside the module's "
            "forward (its gradient is then reduced with the rest), use the optimizer's "
            "weight_decay for an L2 penalty, or let one unit contain every module that uses it.")
    return hook


# ------------------------------------------------------------------- global optimizer hook
CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # adopted, not loaded since


def adopt_optimizer(optimizer) -> None:
    """Guard 3 for one optimizer, unless it is checked already: before a step (the backstop
    engine.py hooks into every optimizer's step) and before its state is exported."""
    if optimizer not in CHECKED:
        adopt(optimizer)


def adopt_live_optimizers() -> None:
    """Guard 3 at the wrap: each live optimizer holding a parameter the engine replaced is
    adopted now. Found by one scan of the heap for what refers to an optimizer class (an instance
    refers to its class): ``gc.get_objects()`` would list every object (MiBs of pointers, resident
    while wrapping), and climbing from a ``params`` list to its optimizer takes more scans.
    Optimizers built after wrapping hold no replaced parameter: untouched."""
    classes, todo = set(), [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo += [c for c in cls.__subclasses__() if c not in classes]
    for obj in gc.get_referrers(*classes):
        if isinstance(obj, torch.optim.Optimizer) and any(
                hasattr(p, "_minishard_successor") for g in obj.param_groups for p in g["params"]):
            adopt(obj)


def adopt(optimizer) -> None:
    """Each parameter the engine replaced gives way to its successor (the user parameter the
    model uses), with its state; state shaped for a whole parameter keeps this rank's rows;
    state of another rank's rows (a shard's state dict loaded on the wrong rank) raises, on
    every rank of the engines whose parameters it holds."""
    problem, groups, held, groups_seen = None, {}, {}, []
    for group in optimizer.param_groups:
        groups_seen.append(group)
        for i, p in enumerate(group["params"]):
            successor = getattr(p, "_minishard_successor", None)
            if successor is not None:
                if successor() is None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds a parameter of a module that "
                        "minishard.ZeRO wrapped, and that engine is gone: build the optimizer "
                        "over the parameters of the model you train.")
                group["params"][i] = successor()
                if p in optimizer.state:
                    optimizer.state[successor()] = optimizer.state.pop(p)
            p = group["params"][i]
            if optimizer.state.get(p):  # state to check: agreed where it lives
                groups.update(dict.fromkeys(getattr(p, "_minishard_verdict", ())))
            problem = _keep_state_rows(optimizer.state.get(p), p,
                                       f"group {len(groups_seen)} parameter {i}", held) or problem
    if not getattr(optimizer, "_minishard_hooked", False):
        optimizer._minishard_hooked = True  # a state dict loaded later is checked again
        optimizer.register_load_state_dict_post_hook(CHECKED.discard)
        optimizer.register_state_dict_post_hook(_mark_state_rows)
    _agree(problem, held, list(groups), f"{type(optimizer).__name__}.load_state_dict")
    CHECKED.add(optimizer)


def _mark_state_rows(optimizer, state_dict: dict) -> None:
    """``optimizer.state_dict()``: each DTensor state of a shard carries the rows it holds, as
    the model's state dict does (:func:`_copy_my_rows`), so a load on another rank is refused."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in state_dict["state"].items():
        flat, j = getattr(params[index], "_minishard_slot", (None, None))
        for value in state.values() if flat is not None else ():
            if isinstance(value, DTensor):
                value._minishard_rows = flat.row_ranges[j]


def whole_state(key: str, value, shape: torch.Size) -> bool:
    """Is ``value`` per-element optimizer state of a WHOLE parameter of ``shape`` (Adam's
    moments, momentum; not the step count, even of a 0-dim parameter)?"""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


def _keep_state_rows(state: dict | None, p: torch.Tensor, where: str, held: dict) -> str | None:
    """Per-element state of a whole parameter, plain tensors, becomes this rank's rows of it,
    as the parameter itself (stages 1-3). Returns why a DTensor state is not this rank's rows
    (:func:`_check_rows`), or None; each one's bytes go into ``held`` (:func:`_agree`)."""
    flat, j = getattr(p, "_minishard_slot", (None, None))
    if not state or flat is None or flat.spec is None:  # not ours, or stage 0: full already
        return None
    for key, value in state.items():
        if type(value) is torch.Tensor and whole_state(key, value, flat.shapes[j]):
            state[key] = flat.as_user(j, flat.my_rows(j, value).clone())
        elif isinstance(value, DTensor) and _check_rows(value, flat, j, f"state {key!r}"):
            return _check_rows(value, flat, j, f"state {key!r} of a parameter of shape "
                                               f"{tuple(flat.shapes[j])} ({flat.name})")
        elif isinstance(value, DTensor) and key != "step" and not flat.is_replicated(j):
            held[f"{where}'s {key!r}"] = _content(value, flat.row_ranges[j])
    return None


def refuse_deepcopy(engine, memo=None):
    """``copy.deepcopy(model)`` (the EMA idiom): the copy's flat buffers, parameter views, hooks
    and process groups would be the original's or dangle, so it is refused with the way that
    works."""
    raise TypeError(
        "copy.deepcopy of a minishard.ZeRO model is not supported: its parameters are views of "
        "flat buffers bound to this engine's hooks and process groups. For an EMA or any plain "
        "copy, build the model again and load the full weights into it: "
        "sd = model.full_state_dict() (on every rank: it gathers), then "
        "ema = build(); ema.load_state_dict(sd).")
