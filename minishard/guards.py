"""Misuse guards: mistakes that would otherwise train silently wrong, turned into errors that
say what to do. Each is set up once, when the engine wraps a model; none costs a step anything.

1. **A stage-3 parameter used while its unit is released** (:class:`Released`): its places hold
   stand-ins of the right shape and no storage, and any use names the parameter and its unit,
   instead of torch's opaque complaint about a storage of size 0 deep inside some operator.
2. **The module's own parameter API after wrapping** (:func:`guard_module_attributes`): the
   modules own no parameters any more, so ``module.parameters()`` would be EMPTY, and groups or
   freezing built from it would silently do nothing. It raises instead; ``requires_grad_``
   freezes through the engine (:func:`set_requires_grad`: whole flat buffers only).
3. **An optimizer built before wrapping** (:func:`refuse_orphaned_params`, a global optimizer
   step pre-hook): it would update tensors the model no longer uses. Also refused: an empty
   param group over minishard's shards (groups picked by name after wrapping).
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from minishard.unit import Unit, is_inside

__all__ = ["Released", "give_stand_ins", "guard_module_attributes", "set_requires_grad",
           "mark_shards", "refuse_orphaned_params", "refuse_deepcopy"]


class Released(torch.Tensor):
    """What a stage-3 module attribute holds while its unit is NOT gathered (the full values do
    not exist then). Any use raises an error naming the parameter."""

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


def give_stand_ins(unit: Unit) -> None:
    """One :class:`Released` stand-in per parameter of ``unit`` (shown by ``unit.release``)."""
    for param in unit.params():
        t = torch.Tensor._make_subclass(  # the parameter's shape, no storage (meta)
            Released, torch.empty(param.shape, dtype=param.flat.param_dtype, device="meta"))
        t._minishard_name, t._minishard_unit = param.name, unit.name
        param.stand_in = t


def guard_module_attributes(module: torch.nn.Module, set_requires_grad_under) -> None:
    """On every module of ``module``: ``requires_grad_`` calls ``set_requires_grad_under(path,
    flag)`` (the engine, through a weak reference), and ``parameters``/``named_parameters``
    raise an error that says what to use instead."""
    for path, m in module.named_modules():
        def requires_grad_(requires_grad: bool = True, _m=m, _path=path):
            set_requires_grad_under(_path, requires_grad)
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


def set_requires_grad(units: list[Unit], path: str, requires_grad: bool) -> None:
    """``model.module.<path>.requires_grad_(flag)``: set it on the shard of every flat buffer
    holding a parameter used under ``path``, refusing (before changing anything) when that would
    freeze only part of a buffer, since a buffer's shard is one optimizer parameter."""
    touched = []
    for unit in units:
        for flat in unit.flats:
            params = list(unit.params(flat))
            inside = [any(is_inside(place.fqn.rpartition(".")[0], path) for place in p.places)
                      for p in params]
            if not any(inside) or not flat.dtype.is_floating_point:
                continue
            if not all(inside):
                names = [p.name for p, i in zip(params, inside) if not i]
                raise ValueError(
                    f"{path or 'the model'}.requires_grad_({requires_grad}): unit "
                    f"{unit.name!r} keeps these parameters in the SAME flat buffer, outside "
                    f"{path!r}: {names}. A flat buffer's shard is one optimizer parameter, so "
                    "it is frozen or trained whole. Make the module a unit of its own (units="
                    "...) when wrapping, or freeze the whole unit.")
            touched.append(flat)
    for flat in touched:
        flat.shard.requires_grad_(requires_grad)


# ------------------------------------------------------------------- global optimizer guard
_checked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def mark_shards(shards) -> None:
    """Let the optimizer guard recognise minishard's shards."""
    for shard in shards:
        shard._minishard_shard = True


def refuse_orphaned_params(optimizer, args, kwargs) -> None:
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


register_optimizer_step_pre_hook(refuse_orphaned_params)


def refuse_deepcopy(engine, memo=None):
    """``copy.deepcopy(model)`` (the EMA idiom): the copy's flat buffers, parameter views, hooks
    and process groups would be the original's or dangle, so it is refused with the way that
    works."""
    raise TypeError(
        "copy.deepcopy of a minishard.ZeRO model is not supported: its parameters are shards of "
        "flat buffers bound to this engine's hooks and process groups. For an EMA or any plain "
        "copy, build the model again and load the full weights into it: "
        "sd = model.full_state_dict() (on every rank: it gathers), then "
        "ema = build(); ema.load_state_dict(sd).")
