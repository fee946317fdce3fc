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
import math

import torch

from minishard import comm
from minishard.checkpoint.files import CheckpointError
from minishard.zero.params import local
from minishard.zero.flat import FlatMode
from minishard.zero.guards import adopt_optimizer, whole_state
from minishard.verdicts import rank0_verdict

__all__ = ["gathered", "full_state_dict", "load_full_state_dict", "full_optimizer_state_dict",
           "load_full_optimizer_state_dict", "original_parameter_names", "named_params",
           "split_state", "group_param_names", "hyperparameters", "torch_optimizer_state",
           "buffer_state"]


# ------------------------------------------------------------------- gathering full tensors
class Staging:
    """ONE buffer of bytes that a phase going flat buffer by flat buffer (an export, a load)
    lands every collective in: sized by its largest request, each request a view of it. So the
    phase's staging is one allocation, whatever the number of units, and a finished collective
    that gloo's threads still reference (comm.FINISHED_KEPT_BY_BACKEND) keeps nothing else
    alive."""

    def __init__(self, units, numel) -> None:
        """Room for ``numel(flat)`` elements of the largest of the units' flat buffers."""
        flats = [f for u in units for f in u.flats]
        nbytes = max((numel(f) * f.dtype.itemsize for f in flats), default=0)
        self._bytes = torch.empty(nbytes, dtype=torch.uint8,
                                  device=flats[0].full.device if flats else None)

    def get(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._bytes.numel():  # a request larger than planned: grow once
            self._bytes = self._bytes.new_empty(nbytes)
        return self._bytes[:nbytes].view(dtype).view(shape)


def gather_full(flat, pieces: list[torch.Tensor], what: str = "state dict", keep: bool = True,
                staging: Staging | None = None) -> list[torch.Tensor] | None:
    """Every rank's ``pieces`` of ``flat``'s parameters (one each, shaped like this rank's shard
    of it: the values, or an optimizer state such as Adam's ``exp_avg``) joined into the full
    tensors, no padding: what state dicts need, whatever the stage or mixed precision.

    The gather lands in N x k staging rows (this rank's row filled in place; a view of
    ``staging`` when given), then each full tensor is copied out. A rank that only takes part
    (``keep=False``: ``rank0_only`` on the others) copies nothing out and returns None."""
    pieces = [local(t) for t in pieces]
    if flat.mode is FlatMode.REPLICATED:  # every rank already holds all of it
        return [t.detach().reshape(s).clone() for t, s in zip(pieces, flat.shapes)] \
            if keep else None
    shape, dtype = (flat.chunks, flat.shard_numel), pieces[0].dtype
    rows = staging.get(shape, dtype) if staging else pieces[0].new_empty(shape)
    for o, t in zip(flat.offsets, pieces):  # padding is sent, never read
        rows[flat.rank, o:o + t.numel()] = t.detach().reshape(-1)
    comm.all_gather(rows, rows[flat.rank], flat.group, tag=f"{flat.name} ({what})")
    if not keep:
        return None
    return [_unpad(rows[:, o:o + w], n).view(s) for o, w, n, s in
            zip(flat.offsets, flat.widths, flat.numels, flat.shapes)]


def _unpad(columns: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of ``columns`` (N x w, one parameter's chunk from each rank,
    padding at the end) read row by row, in a new tensor of exactly ``n``: the whole chunks in
    one copy, the last one's real part in another."""
    w = columns.shape[1]
    whole, rest = divmod(n, w) if w else (0, 0)
    out = columns.new_empty(n)
    out[:whole * w].view(whole, w).copy_(columns[:whole])
    if rest:
        out[whole * w:].copy_(columns[whole, :rest])
    return out


# ------------------------------------------------------------------------ full parameters
@contextlib.contextmanager
def gathered(units, writeback: bool, on_gather, put_back):
    """``model.gathered()``: fp32 masters gathered from the shards where the compute buffer
    holds rounded values (mixed precision), else the gathered full buffers, detached; each
    shown as an ``nn.Parameter`` (``named_parameters()`` gives the full tensors, with the user
    parameter's ``requires_grad``). The block runs under ``torch.no_grad()``, as edits to
    weights do. On exit, edits written back (only a master that changed), and ``put_back(unit)``
    for each unit. A forward inside the block is refused (as FSDP1's ``summon_full_params``
    refuses one): the units' hooks would gather and free again under the block's parameters."""
    refusals = [unit.module.register_forward_pre_hook(_no_forward_inside, prepend=True)
                for unit in units]
    masters: dict[int, list[torch.Tensor]] = {}
    for unit in units:
        for flat in unit.flats:
            if flat.param_dtype != flat.dtype:
                values = masters[id(flat)] = gather_full(flat, flat.params, "gathered()")
            else:
                if unit.unshard(flats=[flat]):
                    on_gather(unit)
                values = flat.unsharded_views(detached=True)
            unit.set_places(flat, [torch.nn.Parameter(v, requires_grad=p.requires_grad)
                                   for v, p in zip(values, flat.params)])
    try:
        with torch.no_grad():
            yield
    finally:
        for handle in refusals:
            handle.remove()
        for unit in units:
            for flat in unit.flats:
                if writeback and id(flat) in masters:
                    load_rows(flat, masters[id(flat)], only_if_changed=True)
                elif writeback:
                    _write_back(flat)
            put_back(unit)


def _no_forward_inside(module, args):
    raise RuntimeError(
        "minishard: a forward of the wrapped model inside `with model.gathered():` is not "
        "supported (its units would gather and free their parameters again under the block's). "
        "Run the forward outside the block; inside it, read or edit the parameters "
        "(FSDP1's summon_full_params refuses a forward too).")


def load_rows(flat, values: list[torch.Tensor], only_if_changed: bool = False) -> None:
    """Set ``flat``'s shards from the full ``values`` (one per parameter; each rank keeps its
    rows), so the next use gathers. ``only_if_changed``: leave an equal shard unwritten."""
    with torch.no_grad():
        for j, (rows, value) in enumerate(zip(flat.locals, values)):
            mine = flat.my_rows(j, local(value)).to(flat.dtype)
            if not (only_if_changed and torch.equal(mine, rows)):
                rows.copy_(mine)
                flat.mark_stale()


def _write_back(flat) -> None:
    """Copy this rank's rows of ``full`` (edited in a ``gathered()`` block) into the shards,
    which are views of full unless they own their storage."""
    with torch.no_grad():
        if flat.shard is not None:
            for j, rows in enumerate(flat.locals):
                rows.copy_(flat.my_rows(j, flat.param_in(flat.full.data, j)))


def buffer_state(module) -> dict[str, torch.Tensor]:
    """The module's state dict without its parameters: its persistent buffers, by name, in
    ``state_dict()`` order (read directly: ``state_dict()`` itself refuses shards, guards.py)."""
    out = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def full_state_dict(units, module, keys: list[str], every, rank0_only: bool) -> dict:
    """``model.full_state_dict()``: every rank joins every gather; only a keeping rank copies.
    [Note: rank 0] "Rank 0" is rank 0 of ``every``, the group of all the engine's ranks (global
    rank 0 for a mesh over the job): one file on one machine, not one per replica."""
    keep = not rank0_only or comm.group_rank(every) == 0
    values: dict[str, torch.Tensor] = {}
    staging = Staging(units, lambda f: f.chunks * f.shard_numel)
    for unit in units:
        for flat in unit.flats:
            full = gather_full(flat, flat.params, keep=keep, staging=staging)
            for param, value in zip(unit.params(flat), full or ()):
                for place in param.places:  # a tied parameter: one tensor, as state_dict()
                    values[place.fqn] = value
    if not keep:
        return {}
    for name, buf in buffer_state(module).items():
        values.setdefault(name, buf.detach().clone())
    return {k: values[k] for k in keys}


def load_full_state_dict(units, module, keys: list[str], every, state_dict,
                         from_rank0: bool) -> None:
    """``model.load_full_state_dict()``: checked first (by rank 0 alone with ``from_rank0``,
    which then tells every rank its verdict), then loaded one flat buffer at a time, each rank
    keeping its rows; buffers follow, one by one. The caller refreshes the full buffers.
    With ``from_rank0`` the broadcasts span ``every``, replicas included ([Note: rank 0])."""
    rank0 = comm.group_rank(every) == 0
    error = _state_dict_problem(units, keys, state_dict) if rank0 or not from_rank0 else None
    if from_rank0:
        shards = [s for u in units for s in u.shards()]
        device = shards[0].device if shards else None
        error = rank0_verdict(error, every, device, tag="load_full_state_dict")
    if error is not None:
        raise (KeyError if "missing keys" in error else ValueError)(error)
    staging = Staging(units, lambda f: f.numel)
    with torch.no_grad():
        for unit in units:
            for flat in unit.flats:
                _load_flat(unit, flat, state_dict, every, rank0 or not from_rank0, from_rank0,
                           staging)
        for name, buf in buffer_state(module).items():
            value = state_dict[name] if rank0 or not from_rank0 else buf.detach().clone()
            value = value.to(buf.device, buf.dtype)
            if from_rank0:
                comm.broadcast(value, 0, every, tag=f"{name} (from rank 0)")
            buf.copy_(value)


def _load_flat(unit, flat, state_dict, every, has_values: bool, from_rank0: bool,
               staging: Staging) -> None:
    """One flat buffer of ``load_full_state_dict``: its parameters joined into the staging
    buffer (or received into it from rank 0), each rank keeping its rows."""
    full = staging.get((flat.numel,), flat.dtype)
    if has_values:
        torch.cat([state_dict[p.name].reshape(-1).to(full.device, flat.dtype)
                   for p in unit.params(flat)], out=full)
    if from_rank0:
        comm.broadcast(full, 0, every, tag=f"{flat.name} (from rank 0)")
    load_rows(flat, [v.view(s) for v, s in zip(torch.split(full, flat.numels), flat.shapes)])


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


# ------------------------------------------------------------------ the parameters, by name
def named_params(model):
    """``(name, param)`` (unit.py's Param: its flat buffer, index, places) of every parameter
    of the engine, in unit order, under its first name: stable across runs and world sizes."""
    for unit in model.units:
        for param in unit.params():
            yield param.name, param


def split_state(state: dict, shard: torch.Tensor) -> tuple[dict, dict]:
    """Split one parameter's optimizer state into per-element tensors (shaped like its shard:
    cut and gathered like the values) and scalars (``step``, ...: copied as they are)."""
    per_element, scalars = {}, {}
    shard = local(shard)
    for key, value in state.items():
        value = local(value)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != shard.shape:
                raise CheckpointError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, neither the shard's "
                    f"{tuple(shard.shape)} nor a scalar: minishard cannot cut it into rows")
            per_element[key] = value
        else:
            scalars[key] = value
    return per_element, scalars


def group_param_names(model, optimizer) -> list[list[str]]:
    """For each param group of ``optimizer``, the names of the parameters it holds (one built
    before wrapping and not adopted at the wrap is adopted first: zero/guards.py)."""
    adopt_optimizer(optimizer)
    name_of = {id(param.user): name for name, param in named_params(model)}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in name_of for p in group["params"]):
            raise CheckpointError(
                f"param group {i} of the {type(optimizer).__name__} holds a tensor that is not a "
                "parameter of this ZeRO model; build the optimizer over model.parameters()")
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


def _numbering(model, optimizer, param_names: list[str] | None) -> list[list]:
    """For each param group, its parameters (unit.py's Param) in the order a plain optimizer
    numbers them: the group's own order (torch's numbering: DDP's ``opt.state_dict()`` of the
    same construction), or ``param_names`` order when given."""
    by_alias = {place.fqn: param for _, param in named_params(model) for place in param.places}
    group_param_names(model, optimizer)  # every optimizer parameter is one of ours
    if param_names is None:
        by_user = {id(param.user): param for param in by_alias.values()}
        return [[by_user[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    unknown = [n for n in param_names if n not in by_alias]
    distinct = {id(by_alias[n]) for n in param_names if n in by_alias}
    total = len({id(p) for p in by_alias.values()})
    if unknown or len(distinct) != len(param_names) or len(distinct) != total:
        raise ValueError(f"param_names must name each of the model's {total} parameters once (a "
                         f"tied one under any of its names); unknown: {unknown}")
    order = [by_alias[n] for n in param_names]
    return [[p for p in order if any(p.user is q for q in g["params"])]
            for g in optimizer.param_groups]


def full_optimizer_state_dict(model, optimizer, param_names: list[str] | None = None) -> dict:
    """The optimizer state dict that ``type(optimizer)`` over the UNWRAPPED model would have, on
    every rank. Collective (one all-gather per flat buffer and state key at stages 1-3).

    Format: torch's own. ``state[i]`` belongs to the i-th parameter in the optimizer's own order
    (group by group, each group's ``params`` in order): equal to the ``opt.state_dict()`` that
    DDP or one process gives for an optimizer built the same way, whatever the group layout.
    Per-element state has the parameter's full shape. So::

        m.load_state_dict(model.full_state_dict())
        opt = torch.optim.Adam(m.parameters(), ...)
        opt.load_state_dict(full_optimizer_state_dict(model, zero_opt))  # continues identically
    """
    groups = _numbering(model, optimizer, param_names)
    full: dict[int, dict] = {}  # id(Param) -> its full state. Same collectives on all ranks.
    staging = Staging(model.units, lambda f: f.chunks * f.shard_numel)
    for unit in model.units:
        for flat in unit.flats:
            states = [optimizer.state.get(p, {}) for p in flat.params]
            keys = sorted({k for s, p in zip(states, flat.params)
                           for k in split_state(s, p)[0]})
            gathered_keys = {k: gather_full(
                flat, [s.get(k, rows.new_zeros(rows.shape)) for s, rows in zip(states,
                                                                              flat.locals)],
                "optimizer state", staging=staging) for k in keys}
            for param, state in zip(unit.params(flat), states):
                if state:
                    per_element, scalars = split_state(state, param.user)
                    full[id(param)] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                          for k, v in scalars.items()},
                                       **{k: gathered_keys[k][param.index] for k in per_element}}
    return torch_optimizer_state(
        ({k: v for k, v in group.items() if k != "params"}, [full.get(id(p)) for p in params])
        for group, params in zip(optimizer.param_groups, groups))


def load_full_optimizer_state_dict(model, optimizer, state_dict: dict,
                                   param_names: list[str] | None = None) -> None:
    """The inverse of :func:`full_optimizer_state_dict`: load a plain optimizer's state dict
    (numbered as described there) into the sharded ``optimizer``; each rank keeps its rows of
    each per-element state. Load the parameters with ``model.load_full_state_dict`` too. Not
    collective."""
    groups = _numbering(model, optimizer, param_names)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer "
                         f"{len(groups)}")
    sharded = []
    for params, saved in zip(groups, saved_groups):
        if len(saved["params"]) != len(params):
            raise ValueError(f"a param group of state_dict has {len(saved['params'])} "
                             f"parameters; the optimizer's has {len(params)}")
        by_param = {id(p): state_dict["state"].get(i) for p, i in zip(params, saved["params"])}
        sharded.append(({k: v for k, v in saved.items() if k != "params"},
                        [_my_rows_of_state(param, by_param[id(param)])
                         for param in _in_optimizer_order(params, optimizer, saved)]))
    load_rows_into(optimizer, torch_optimizer_state(sharded))


def _in_optimizer_order(params: list, optimizer, saved) -> list:
    """``params`` (a group, numbered as a plain optimizer does) in the group's own order."""
    index = {id(p.user): p for p in params}
    group = next(g for g in optimizer.param_groups
                 if {id(q) for q in g["params"]} == set(index))
    return [index[id(q)] for q in group["params"]]


def _my_rows_of_state(param, state: dict | None) -> dict | None:
    """This rank's rows of one parameter's full optimizer state (None: no state)."""
    if not state:
        return None
    flat, j = param.flat, param.index
    return {k: flat.my_rows(j, v).clone() if whole_state(k, v, flat.shapes[j]) else
            (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def load_rows_into(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict`` of a state dict holding this rank's rows (plain tensors),
    then each per-element state of a DTensor parameter made a DTensor like it (as torch's
    optimizers create it: ``zeros_like(p)``; ``step`` stays plain)."""
    optimizer.load_state_dict(state_dict)
    for p, state in optimizer.state.items():
        flat, j = getattr(p, "_minishard_slot", (None, None))
        if flat is None or flat.spec is None:
            continue
        for k, v in state.items():
            if k != "step" and type(v) is torch.Tensor and v.shape == flat.locals[j].shape:
                state[k] = flat.as_user(j, v)

