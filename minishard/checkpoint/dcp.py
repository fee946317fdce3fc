"""Checkpoints in torch.distributed.checkpoint's format (DCP): written as FSDP2's state-dict API
lays them out (FSDP2 loads them), read in that layout or torchtitan's, by minishard at any world
size and stage.

    save_checkpoint(path, model, optimizer, format="dcp")   path/.metadata  path/__0_0.distcp ...
    load_checkpoint(path, model, optimizer)                 any such directory, whoever wrote it

**What goes in** is exactly what ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` / ``get_optimizer_state_dict`` give for an FSDP2 model of the same module::

    {"model": {"lin.weight": DTensor, ..., "norm.running_mean": tensor},   original names
     "optim": {"state": {"lin.weight": {"step": tensor, "exp_avg": DTensor, ...}, ...},
               "param_groups": [{"lr": 0.01, ..., "params": ["lin.weight", ...]}, ...]}}

**The rows.** Each DTensor is a parameter (or state shaped like it) cut on dim 0, ``Shard(0)``
over the shard group: rank r holds rows [r*c, r*c + c) ∩ [0, R), c = ceil(R / N), as at stages
1-3 (flat.py) and as FSDP2. Every rank writes only its own rows, and a load asks for this rank's
rows: DCP reads whatever chunks overlap them, the interval arithmetic state.py does by hand
([Note: the rows]). **Settings** (lr, betas, ...) are matched by parameter name, as torch's
``set_optimizer_state_dict`` matches them ([Note: settings]).

**Trust.** Loading a checkpoint never runs code from it (``.metadata`` read with an allow-list,
the hyperparameters ``weights_only``), and a save writes the sha256 of every data file beside it
(``minishard-sha256.pt``), checked first by a load ([Note: trust]).

DTensor appears only here, at the boundary: the engine stays on raw collectives. DCP runs its
own collectives inside ``dcp.save`` / ``dcp.load`` (it gathers and scatters its plans as
objects): the one place where minishard lets collectives bypass comm.py, because they are
torch's checkpoint library's, not ours. Collective, like everything in state.py.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state  # get_optimizer_state_dict's
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from minishard import comm
from minishard.checkpoint.files import DCP_METADATA as METADATA
from minishard.checkpoint.files import (DCP_DIGESTS, CheckpointError, SafeDCPReader, EXTRA,
                                        atomic_save, check_dcp, check_dcp_digests, dcp_data_files,
                                        file_sha256, saved_piece)
from minishard.checkpoint.full_state import (buffer_state, group_param_names, hyperparameters,
                                             named_params, split_state, torch_optimizer_state)
from minishard.verdicts import all_gather_object, raise_together

__all__ = ["is_dcp_checkpoint", "init_optimizer_state", "save_dcp", "read_dcp"]


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


def init_optimizer_state(optimizer) -> None:
    """As get_optimizer_state_dict does: an optimizer that never stepped is given its state (a
    step with zero gradients and lr 0: Adam's ``step`` becomes 1), or FSDP2 could not load the
    checkpoint. On EVERY rank (replicas too, though only the first writes): ranks whose
    optimizers differed would step differently from then on."""
    if optimizer is not None:
        _init_optim_state(optimizer)


# --------------------------------------------------------------------------------- the rows
# [Note: the rows] Each rank's local tensor is rows [r*c, r*c + c) ∩ [0, R), c = ceil(R / N) --
# the rows it holds at stages 1-3 (flat.py), and the rows FSDP2's ``Shard(0)`` holds. So every
# rank writes only its own rows (stage 0 too: it cuts them out of its full parameters) and no
# rank ever holds the whole model. DCP records each chunk's offset in ``.metadata``; a load asks
# for this rank's rows (a DTensor again, or a whole tensor at stage 0) and DCP reads whatever
# chunks overlap them. Scalars (Adam's ``step``, a 0-dim parameter), buffers and
# hyperparameters are the same on every rank: DCP writes them once, from the lowest rank, which
# always holds row 0. As torch's ``get_optimizer_state_dict`` does, an optimizer that never
# stepped is first given its state by a step with zero gradients and lr 0 (Adam's ``step``
# becomes 1): FSDP2 loads nothing less.
def _mesh(model) -> DeviceMesh:
    """The shard group as the 1-D DeviceMesh a DTensor needs (no new process group)."""
    group = model.group if model.group is not None else dist.group.WORLD
    device = next((p.user.device.type for _, p in named_params(model)), "cpu")
    return DeviceMesh.from_group(group, device)


def _as_dtensor(rows: torch.Tensor, shape: torch.Size, mesh: DeviceMesh) -> DTensor:
    """This rank's dim-0 chunk ``rows`` of a tensor of ``shape``, as FSDP2 holds it."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def _saved(param, held: torch.Tensor, mesh: DeviceMesh, world: int, rank: int):
    """What this rank writes of ``held`` (its rows of one parameter, or of state shaped like it):
    its chunk, cut out of whatever it holds; a 0-dim tensor whole (every rank holds it)."""
    if len(param.shape) == 0:  # cannot be cut: replicated (flat.py), every rank saves it
        return held.detach().reshape(()).clone()
    rows = saved_piece(param, held, world, rank)
    # .clone(): a fresh tensor of just these rows, not a view into the flat buffer
    return _as_dtensor(rows.reshape(len(rows), *param.shape[1:]).clone(), param.shape, mesh)


def _target(param, dtype: torch.dtype, mesh: DeviceMesh):
    """An empty tensor for a load to fill with this rank's rows of one parameter (or of state
    shaped like it): a DTensor chunk at stages 1-3, the whole tensor at stage 0."""
    held_lo, held_hi = param.flat.row_ranges[param.index]
    device = param.user.device
    if len(param.shape) == 0 or (held_lo, held_hi) == (0, param.flat.n_rows[param.index]):
        # everything (stage 0, a 0-dim parameter, or one rank holds every row)
        return torch.empty(param.shape, dtype=dtype, device=device)
    rows = torch.empty(held_hi - held_lo, *param.shape[1:], dtype=dtype, device=device)
    return _as_dtensor(rows, param.shape, mesh)


def _per_element(t, param) -> bool:
    """Is a loaded optimizer entry shaped like its parameter (cut into rows), not a scalar?"""
    return isinstance(t, torch.Tensor) and len(param.shape) > 0 and t.dim() > 0


def _held(param, loaded) -> torch.Tensor:
    """A filled :func:`_target` as this rank's rows, shaped like its user parameter."""
    if isinstance(loaded, DTensor):
        return loaded.to_local().reshape(param.rows.shape)
    return param.flat.my_rows(param.index, loaded)  # the whole tensor: keep this rank's rows


# ------------------------------------------------------------------------------------- save
def save_dcp(path: str, model, optimizer, extra_file: dict | None = None) -> None:
    """save_checkpoint(format="dcp") on the ranks of ONE shard group (state.py has made room);
    ``extra_file``: extra.pt's record (rank 0), kept with the digests."""
    mesh, group = _mesh(model), model.group
    world, rank = comm.group_size(group), comm.group_rank(group)
    values, states = {}, {}
    for name, param in named_params(model):
        value = _saved(param, param.rows, mesh, world, rank)
        values.update({place.fqn: value for place in param.places})  # tied: every name, as stock
        state = optimizer.state.get(param.user) if optimizer is not None else None
        if state:
            per_element, scalars = split_state(state, param.user)
            states[name] = {**scalars, **{k: _saved(param, v, mesh, world, rank)
                                          for k, v in per_element.items()}}
    content = {"model": {**values, **buffer_state(model.module)}}
    if optimizer is not None:
        content["optim"] = {"state": states, "param_groups": [
            {**hyperparameters(g), "params": names}
            for g, names in zip(optimizer.param_groups, group_param_names(model, optimizer))]}
    try:  # DCP raises on every rank when any rank fails
        dcp.save(content, checkpoint_id=path, process_group=group,
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"could not save the DCP checkpoint {path}; it has no {METADATA}, "
                              f"so it stays incomplete: {exc}") from exc
    _save_digests(path, group, world, rank, extra_file)


def _save_digests(path: str, group, world: int, rank: int, extra_file: dict | None) -> None:
    """DCP records no checksums: each rank hashes its share of the data files, rank 0 writes
    them all beside the checkpoint (DCP_DIGESTS, which torch's readers ignore), with extra.pt's
    record if any; every rank returns once it is written, or raises with rank 0."""
    files = dcp_data_files(check_dcp(path))
    mine = {name: file_sha256(os.path.join(path, name)) for name in files[rank::world]}
    digests = {k: v for part in all_gather_object(mine, group, tag="dcp: sha256")
               for k, v in part.items()}
    if extra_file is not None:
        digests[EXTRA] = extra_file
    error = None
    if rank == 0:
        try:
            atomic_save(digests, os.path.join(path, DCP_DIGESTS))
        except Exception as exc:  # still join the verdict, or the other ranks would hang
            error = exc
    raise_together(error, [group], "dcp checkpoint: sha256 written", CheckpointError(
        f"rank 0 could not write {DCP_DIGESTS} beside {path}"))


# ------------------------------------------------------------------------------------- load
def read_dcp(path: str, model, optimizer):
    """Read the DCP checkpoint at ``path`` for this rank, changing nothing yet: (values per
    parameter, buffers, the optimizer's torch state dict or None, its param groups as loaded).
    Every check happens before the read, and every rank raises together.

    Three layouts are read, told apart by their keys: ``{"model", "optim"}`` (FSDP2's state
    dicts, and what minishard writes), the same with the optimizer state flattened per
    parameter (``StateDictOptions(flatten_optimizer_state_dict=True)``: settings under
    ``param_groups.<name>.lr``), and torchtitan's (the model's entries at the top level, the
    flattened optimizer under ``optimizer``)."""
    mesh, group = _mesh(model), model.group
    replicas = getattr(model, "replicate_group", None)
    groups = [group] if replicas is None else [group, replicas]
    error, targets, keys = None, {}, None
    try:
        metadata = check_dcp(path)
        check_dcp_digests(path, metadata, (comm.group_rank(group), comm.group_size(group)))
        saved = metadata.state_dict_metadata
        keys = _Keys(saved, model)
        targets = _model_targets(path, saved, keys, model, mesh)
        if optimizer is not None:
            targets.update(_optim_targets(path, saved, keys, model, mesh))
    except Exception as exc:  # still join the verdict below, or the other ranks would hang
        error = exc
    raise_together(error, groups, "dcp checkpoint: checked", CheckpointError(
        f"another rank could not load {path} (its error names the problem); nothing was loaded"))
    try:  # DCP raises on every rank when any rank fails
        dcp.load(targets, storage_reader=SafeDCPReader(path), planner=_SafeLoadPlanner(),
                 process_group=group)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"could not read the DCP checkpoint at {path}: {exc}") from exc
    error = optim_sd = loaded_groups = None
    try:
        if optimizer is not None:
            optim_sd, loaded_groups = _optimizer_state(path, targets, keys, model, optimizer)
    except Exception as exc:
        error = exc
    raise_together(error, groups, "dcp checkpoint: optimizer checked", CheckpointError(
        f"another rank could not load the optimizer state of {path}; nothing was loaded"))
    values = [(param, _held(param, targets[keys.value(param)]))
              for _, param in named_params(model)]
    buffers = {k: targets[keys.model + k] for k in buffer_state(model.module)}
    return values, buffers, optim_sd, loaded_groups


class _Keys:
    """Where a checkpoint keeps things: the model's entries under ``model.`` or at the top level
    (torchtitan), the optimizer's under ``optim.`` or ``optimizer.`` (torchtitan)."""

    def __init__(self, saved: dict, model) -> None:
        self.saved = saved
        first = next(iter(named_params(model)), (None, None))[1]
        self.model = "" if first is not None and any(
            pl.fqn in saved and f"model.{pl.fqn}" not in saved for pl in first.places) else "model."
        self.optim = next((p for p in ("optim.", "optimizer.")
                           if any(k.startswith(p + "param_groups.") for k in saved)), None)

    def value(self, param) -> str:
        """A parameter's entry: the first of its names the checkpoint holds (a tied one may
        hold all), else its first name (reported missing)."""
        return next((self.model + p.fqn for p in param.places if self.model + p.fqn in self.saved),
                    self.model + param.name)


def _model_targets(path: str, saved: dict, keys: _Keys, model, mesh) -> dict:
    """Every parameter's and buffer's entry -> an empty tensor for the load to fill, checked
    against the checkpoint's names and shapes first."""
    mine = {keys.value(p): p for _, p in named_params(model)}
    buffers = {keys.model + k: b for k, b in buffer_state(model.module).items()}
    aliases = {keys.model + pl.fqn for _, p in named_params(model) for pl in p.places}
    others = ("optim.", "optimizer.", "lr_scheduler", "dataloader", "train_state")
    theirs = {k for k in saved if k.startswith(keys.model) and (keys.model or not k.startswith(others))}
    problems = []
    if sorted(theirs - aliases - set(buffers)):
        problems.append(f"entries the model does not have {sorted(theirs - aliases - set(buffers))}")
    if sorted(set(mine) - theirs) + sorted(set(buffers) - theirs):
        problems.append(f"entries missing from the checkpoint "
                        f"{sorted(set(mine) - theirs) + sorted(set(buffers) - theirs)}")
    shapes = {k: tuple(p.shape) for k, p in mine.items()}
    shapes.update({k: tuple(b.shape) for k, b in buffers.items()})
    problems += [f"{k[len(keys.model):]}: checkpoint {tuple(saved[k].size)}, model {shape}"
                 for k, shape in shapes.items() if k in theirs
                 and (isinstance(saved[k], BytesStorageMetadata) or tuple(saved[k].size) != shape)]
    if problems:
        raise CheckpointError(f"DCP checkpoint at {path} was saved from a different model: "
                              + "; ".join(problems) + ". Load it into the model it was saved from.")
    targets = {k: _target(p, p.user.dtype, mesh) for k, p in mine.items()}
    targets.update({k: torch.empty_like(b) for k, b in buffers.items()})
    return targets


def _optim_targets(path: str, saved: dict, keys: _Keys, model, mesh) -> dict:
    """``<optim>.state.<name>.<key>`` and ``<optim>.param_groups.<...>`` -> what to fill: this
    rank's rows of state shaped like the parameter, a whole scalar, or None for a pickled value."""
    if keys.optim is None:
        raise CheckpointError(f"DCP checkpoint at {path} holds no optimizer state (no "
                              "optim.param_groups); call load_checkpoint(path, model)")
    targets = {k: None for k in saved if k.startswith(keys.optim + "param_groups.")}
    state_keys = {k for k in saved if k.startswith(keys.optim + "state.")}
    for _, param in named_params(model):
        prefix = f"{keys.optim}state.{param.name}."
        for k in [k for k in state_keys if k.startswith(prefix) and "." not in k[len(prefix):]]:
            state_keys.discard(k)
            md = saved[k]
            if isinstance(md, BytesStorageMetadata):
                targets[k] = None
            elif tuple(md.size) == ():
                targets[k] = torch.empty((), dtype=md.properties.dtype)
            elif tuple(md.size) == tuple(param.shape):
                targets[k] = _target(param, md.properties.dtype, mesh)
            else:
                raise CheckpointError(f"DCP checkpoint at {path}: optimizer state {k!r} has "
                                      f"shape {tuple(md.size)}, neither the parameter's "
                                      f"{tuple(param.shape)} nor a scalar")
    if state_keys:
        raise CheckpointError(f"DCP checkpoint at {path} holds optimizer state for parameters "
                              f"the model does not have: {sorted(state_keys)[:4]}")
    return targets


# [Note: settings] Settings (lr, betas, a scheduler's ``initial_lr``) are matched by parameter
# name, as torch's ``set_optimizer_state_dict`` matches them: the groups may come in another
# order or be flattened per parameter; the parameters of one group must have been saved with the
# same settings, and a group saved without a setting this optimizer has was saved by another
# kind of optimizer.
def _saved_settings(targets: dict, keys: _Keys) -> dict[str, dict]:
    """Each parameter's saved optimizer settings (lr, betas, ...), by name, from either layout:
    ``param_groups.<i>.<key>`` with ``params`` naming the group's parameters (torch's), or
    ``param_groups.<name>.<key>`` (flattened: each parameter's own)."""
    found = {}
    for key, value in targets.items():
        if key.startswith(keys.optim + "param_groups."):
            head, setting = key[len(keys.optim + "param_groups."):].rsplit(".", 1)
            found.setdefault(head, {})[setting] = value
    if not all(head.isdigit() for head in found):
        return {name: hyperparameters(group) for name, group in found.items()}
    return {name: hyperparameters({k: v for k, v in group.items() if k != "params"})
            for group in found.values() for name in group.get("params", [])}


def _optimizer_state(path: str, targets: dict, keys: _Keys, model, optimizer):
    """The loaded entries as the optimizer's own state dict. Settings are matched by parameter
    name, as torch's set_optimizer_state_dict does: the groups may come in another order, but
    the parameters of one group must have been saved with the same settings."""
    settings, mine = _saved_settings(targets, keys), group_param_names(model, optimizer)
    ours = [name for names in mine for name in names]
    if sorted(settings) != sorted(ours):
        raise CheckpointError(
            f"DCP checkpoint at {path}: its optimizer holds the parameters {sorted(settings)}, "
            f"this one {sorted(ours)}; build the optimizer over the same parameters")
    loaded, by_name = [], {name: param for name, param in named_params(model)}
    for i, (group, names) in enumerate(zip(optimizer.param_groups, mine)):
        kinds = {repr(sorted(settings[n].items())) for n in names}
        if len(kinds) > 1:
            raise CheckpointError(
                f"DCP checkpoint at {path}: param group {i} holds {names}, which were saved with "
                "different settings; group them as the saving optimizer did")
        saved = settings[names[0]] if names else hyperparameters(group)
        missing = sorted(set(hyperparameters(group)) - set(saved))
        if missing:
            raise CheckpointError(
                f"DCP checkpoint at {path}: param group {i} was saved without the settings "
                f"{missing} of a {type(optimizer).__name__}: another kind of optimizer saved it")
        states = []
        for name in names:
            prefix = f"{keys.optim}state.{name}."
            state = {k[len(prefix):]: v for k, v in targets.items() if k.startswith(prefix)}
            states.append({k: _held(by_name[name], v) if _per_element(v, by_name[name]) else v
                           for k, v in state.items()} or None)
        loaded.append((saved, states))
    return torch_optimizer_state(loaded), [{**s, "params": names}
                                          for (s, _), names in zip(loaded, mine)]


# ------------------------------------------------------------------------------ never run code
# [Note: trust] DCP itself unpickles ``.metadata`` and the hyperparameters with plain pickle;
# here ``.metadata`` is read with an allow-list (files.py) and the hyperparameters
# ``weights_only`` (:class:`_SafeLoadPlanner`), so, as with minishard's own files, loading a
# checkpoint never runs code from it. DCP records sizes, not checksums: a save writes the sha256
# of every data file beside it (``minishard-sha256.pt``, each rank hashing a share), and a load
# checks them first, the ranks dividing the reading; a directory without it (FSDP2's,
# torchtitan's) is checked for sizes only.
class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with pickled values (hyperparameters) read ``weights_only``."""

    def load_bytes(self, read_item, value) -> None:
        self.original_state_dict[self.mappings[read_item.dest_index.fqn][0]] = \
            torch.load(value, weights_only=True)
