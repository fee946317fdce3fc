"""Full state: the unwrapped model's parameters and optimizer state, whole, by original names.

* ``model.gathered()``: the full parameters visible in the module (:func:`gathered`).
* ``model.full_state_dict()`` / ``load_full_state_dict()``: the state dict of the unwrapped
  module, gathered one flat buffer at a time (every rank joins each gather).
* :func:`full_optimizer_state_dict` / :func:`load_full_optimizer_state_dict` (exported by
  state.py): the state dict a plain ``torch.optim`` optimizer over the UNWRAPPED model would
  have, so ``model.full_state_dict()`` plus it resume training in a single process.

[Note: torch's optimizer layout] A ``torch.optim`` state dict numbers parameters 0, 1, ... in
param-group order: ``{"state": {i: {...}}, "param_groups": [{..., "params": [i, ...]}]}``;
:func:`torch_optimizer_state` builds it, whatever the parameters are (shards or originals).
"""
from __future__ import annotations

import contextlib

import torch

from minishard import comm
from minishard.checkpoint_files import CheckpointError
from minishard.verdicts import rank0_verdict

__all__ = ["gathered", "full_state_dict", "load_full_state_dict", "full_optimizer_state_dict",
           "load_full_optimizer_state_dict", "original_parameter_names", "named_flats",
           "split_state", "group_flat_names", "hyperparameters", "torch_optimizer_state"]


# ------------------------------------------------------------------------ full parameters
@contextlib.contextmanager
def gathered(units, writeback: bool, on_gather, put_back):
    """``model.gathered()``: fp32 masters gathered from the shards where the compute buffer
    holds rounded values (mixed precision), else the gathered full buffers, detached; on exit,
    edits written back (only a master that changed), and ``put_back(unit)`` for each unit."""
    masters: dict[int, torch.Tensor] = {}
    for unit in units:
        for flat in unit.flats:
            if flat.param_dtype != flat.dtype:
                masters[id(flat)] = master = flat.gather_shards(flat.shard, "gathered()")
                unit.show(flat, flat.split(master))
            else:
                unit.gather_flat(flat, False, on_gather)
                unit.show(flat, flat.detached_views())
    try:
        yield
    finally:
        for unit in units:
            for flat in unit.flats:
                if writeback and id(flat) in masters:
                    flat.load_master(masters[id(flat)], only_if_changed=True)
                elif writeback:
                    flat.push_to_shard()
            put_back(unit)


def full_state_dict(units, module, keys: list[str], every, rank0_only: bool) -> dict:
    """``model.full_state_dict()``: every rank joins every gather; only a keeping rank copies.
    [Note: rank 0] "Rank 0" is rank 0 of ``every``, the group of all the engine's ranks (global
    rank 0 for a mesh over the job): one file on one machine, not one per replica."""
    keep = not rank0_only or comm.group_rank(every) == 0
    values: dict[str, torch.Tensor] = {}
    for unit in units:
        for flat in unit.flats:
            master = flat.gather_shards(flat.shard)
            if not keep:
                continue
            for param, piece in zip(unit.params(flat), flat.split(master)):
                for place in param.places:
                    values[place.fqn] = piece.clone()
    if not keep:
        return {}
    for name, buf in module.state_dict().items():
        values.setdefault(name, buf.detach().clone())
    return {k: values[k] for k in keys}


def load_full_state_dict(units, module, keys: list[str], every, state_dict,
                         from_rank0: bool) -> None:
    """``model.load_full_state_dict()``: checked first (by rank 0 alone with ``from_rank0``,
    which then tells every rank its verdict), then loaded one flat buffer at a time, each rank
    keeping its shard; buffers follow, one by one. The caller refreshes the full buffers.
    With ``from_rank0`` the broadcasts span ``every``, replicas included ([Note: rank 0])."""
    rank0 = comm.group_rank(every) == 0
    error = _state_dict_problem(units, keys, state_dict) if rank0 or not from_rank0 else None
    if from_rank0:
        shards = [s for u in units for s in u.shards()]
        device = shards[0].device if shards else None
        error = rank0_verdict(error, every, device, tag="load_full_state_dict")
    if error is not None:
        raise (KeyError if "missing keys" in error else ValueError)(error)
    with torch.no_grad():
        for unit in units:
            for flat in unit.flats:
                if rank0 or not from_rank0:
                    full = torch.cat([state_dict[p.name].reshape(-1).to(flat.dtype)
                                      for p in unit.params(flat)]).to(flat.shard.device)
                else:
                    full = flat.shard.new_empty(flat.numel)
                if from_rank0:
                    comm.broadcast(full, 0, every, tag=f"{flat.name} (from rank 0)")
                flat.load_master(full)
        buffers = module.state_dict()
        for name, buf in buffers.items():
            value = state_dict[name] if rank0 or not from_rank0 else buf.detach().clone()
            if from_rank0:
                value = value.to(buf.device, buf.dtype)
                comm.broadcast(value, 0, every, tag=f"{name} (from rank 0)")
            buffers[name] = value
        module.load_state_dict(buffers, strict=False)


def _state_dict_problem(units, keys: list[str], state_dict) -> str | None:
    """What makes ``state_dict`` unloadable into this model (keys, shapes), or None."""
    expected = set(keys)
    given = set(state_dict or {})
    missing, unexpected = expected - given, given - expected
    if missing or unexpected:
        return (f"load_full_state_dict: missing keys {sorted(missing)}, unexpected keys "
                f"{sorted(unexpected)}. Pass the full state dict of the same model.")
    for unit in units:
        for param in unit.params():
            t = state_dict[param.name]
            if t.shape != param.shape:
                return (f"load_full_state_dict: {param.name} has shape "
                        f"{tuple(t.shape)}, the model expects {tuple(param.shape)}")
    return None


# ------------------------------------------------------------------ the flats, by name
def named_flats(model):
    """``(name, flat, fqns)`` for every flat buffer of the engine, in unit order. ``name`` is the
    flat's tag, unit name + dtype (+ "/frozen"), e.g. ``blocks.0/float32``: stable across runs
    and world sizes. ``fqns[j]`` lists every name parameter j has in the module (tied: several)."""
    seen = set()
    for unit in model.units:
        for flat in unit.flats:
            if flat.name in seen or not flat.name:
                raise CheckpointError(f"two flat buffers share the name {flat.name!r}; "
                                      "checkpoints key flat buffers by name")
            seen.add(flat.name)
            yield flat.name, flat, [[pl.fqn for pl in p.places] for p in unit.params(flat)]


def split_state(state: dict, shard: torch.Tensor) -> tuple[dict, dict]:
    """Split one shard's optimizer state into per-element tensors (shaped like the shard: cut and
    concatenated like the master values) and scalars (``step``, ...: copied as they are)."""
    per_element, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != shard.shape:
                raise CheckpointError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, neither the shard's "
                    f"{tuple(shard.shape)} nor a scalar: minishard cannot cut it into slices")
            per_element[key] = value
        else:
            scalars[key] = value
    return per_element, scalars


def group_flat_names(model, optimizer) -> list[list[str]]:
    """For each param group of ``optimizer``, the names of the flats whose shards it holds."""
    name_of = {id(flat.shard): name for name, flat, _ in named_flats(model)}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in name_of for p in group["params"]):
            raise CheckpointError(
                f"param group {i} of the {type(optimizer).__name__} holds a tensor that is not a "
                "shard of this ZeRO model; build the optimizer over model.parameters()")
        groups.append([name_of[id(p)] for p in group["params"]])
    return groups


def hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def torch_optimizer_state(groups) -> dict:
    """[Note: torch's optimizer layout]: ``groups`` is ``[(hyperparameters, [the state of each
    parameter, or None]), ...]``, in the optimizer's order."""
    out, index = {"state": {}, "param_groups": []}, 0
    for hyper, states in groups:
        ids = []
        for state in states:
            if state is not None:
                out["state"][index] = state
            ids.append(index)
            index += 1
        out["param_groups"].append({**hyper, "params": ids})
    return out


# ------------------------------------------------------------------------ full optimizer state
def original_parameter_names(model) -> list[str]:
    """The unwrapped module's parameter names in ``module.named_parameters()`` order (a tied
    parameter once, under its first name), as the engine recorded them when it wrapped the
    module. Not collective."""
    return list(model.param_names)


def _original_slots(model, param_names: list[str] | None = None) -> list[tuple[str, str, int]]:
    """``(fqn, flat name, index in the flat)`` of every original parameter, in ``param_names``
    order (default: the unwrapped module's own order)."""
    by_alias = {}
    for unit in model.units:
        for param in unit.params():
            for place in param.places:
                by_alias[place.fqn] = (param.name, param.flat.name, param.index)
    names = original_parameter_names(model) if param_names is None else param_names
    unknown = [n for n in names if n not in by_alias]
    distinct = {by_alias[n] for n in names if n in by_alias}
    if unknown or len(distinct) != len(names) or len(distinct) != len(set(by_alias.values())):
        raise ValueError(f"param_names must name each of the model's {len(set(by_alias.values()))} "
                         f"parameters once (a tied one under any of its names); unknown: {unknown}")
    return [by_alias[n] for n in names]


def full_optimizer_state_dict(model, optimizer, param_names: list[str] | None = None) -> dict:
    """The optimizer state dict that ``type(optimizer)`` over the UNWRAPPED model would have, on
    every rank. Collective (one all-gather per state tensor at stages 1-3).

    Format: torch's own. ``state[i]`` belongs to the i-th parameter, numbered in param-group
    order and, within a group, in ``module.parameters()`` order (:func:`original_parameter_names`);
    with the usual single group, i is the index in ``unwrapped.parameters()``. Per-element state
    has the parameter's full shape; scalars (``step``) are copied to each parameter. So::

        m.load_state_dict(model.full_state_dict())
        opt = torch.optim.Adam(m.parameters(), ...)
        opt.load_state_dict(full_optimizer_state_dict(model, zero_opt))  # continues identically
    """
    slots = _original_slots(model, param_names)
    groups = group_flat_names(model, optimizer)
    full = {}  # flat name -> (per-element state, full length; scalars). Same order on all ranks.
    for name, flat, _ in named_flats(model):
        state = optimizer.state.get(flat.shard)
        if state:
            per_element, scalars = split_state(state, flat.shard)
            full[name] = ({k: flat.gather_shards(v, "optimizer state")
                           for k, v in per_element.items()}, scalars)
    flat_of = {name: flat for name, flat, _ in named_flats(model)}

    def state_of(name: str, j: int) -> dict | None:
        if name not in full:
            return None
        flat, (per_element, scalars) = flat_of[name], full[name]
        start, shape = sum(flat.numels[:j]), flat.shapes[j]
        return {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in scalars.items()},
                **{k: v[start:start + flat.numels[j]].view(shape).clone()
                   for k, v in per_element.items()}}
    return torch_optimizer_state(
        (hyperparameters(group), [state_of(name, j) for _, name, j in slots if name in names])
        for group, names in zip(optimizer.param_groups, groups))


def load_full_optimizer_state_dict(model, optimizer, state_dict: dict,
                                   param_names: list[str] | None = None) -> None:
    """The inverse of :func:`full_optimizer_state_dict`: load a plain optimizer's state dict
    (numbered as described there) into the sharded ``optimizer``; each rank keeps its slice.
    Load the parameters with ``model.load_full_state_dict`` too. Not collective.

    The parameters of one flat buffer share one shard, so their scalar state (``step``) must be
    equal; per-element state is the parameter-shaped tensors (any key but ``step``)."""
    slots = _original_slots(model, param_names)
    groups = group_flat_names(model, optimizer)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer "
                         f"{len(groups)}")
    flat_of = {name: flat for name, flat, _ in named_flats(model)}
    sharded = []
    for names, saved in zip(groups, saved_groups):
        mine = [s for s in slots if s[1] in names]
        if len(saved["params"]) != len(mine):
            raise ValueError(f"a param group of state_dict has {len(saved['params'])} parameters; "
                             f"the model's flats {names} hold {len(mine)}")
        per_param = {name: [None] * len(flat_of[name].numels) for name in names}
        for (fqn, name, j), i in zip(mine, saved["params"]):
            per_param[name][j] = state_dict["state"].get(i)
        sharded.append((hyperparameters(saved),
                        [_shard_state(name, flat_of[name], per_param[name]) for name in names]))
    optimizer.load_state_dict(torch_optimizer_state(sharded))


def _shard_state(name: str, flat, states: list) -> dict | None:
    """One shard's optimizer state from its parameters' full states (None: no state)."""
    if not any(s for s in states):
        return None
    if not all(s for s in states) or len({frozenset(s) for s in states}) != 1:
        raise ValueError(f"the parameters of flat {name!r} must all have state with "
                         "the same keys (they share one shard)")
    lo, hi = flat.held_range()
    shard_state = {}
    for key in states[0]:
        values = [s[key] for s in states]
        if key != "step" and all(isinstance(v, torch.Tensor) and v.shape == shape
                                 for v, shape in zip(values, flat.shapes)):
            whole = torch.cat([v.reshape(-1) for v in values])
            shard_state[key] = whole[lo:hi].clone()
        else:
            if any(not _same(v, values[0]) for v in values):
                raise ValueError(f"state {key!r} differs between the parameters of "
                                 f"flat {name!r}; they share one shard and one value")
            first = values[0]
            shard_state[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return shard_state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
