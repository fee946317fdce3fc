"""Checkpoints in torch.distributed.checkpoint's format (DCP): the directories FSDP2 and
torchtitan write, written and read by minishard at any world size and stage.

    save_checkpoint(path, model, optimizer, format="dcp")   path/.metadata  path/__0_0.distcp ...
    load_checkpoint(path, model, optimizer)                 any such directory, whoever wrote it

**What goes in** is exactly what ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` / ``get_optimizer_state_dict`` give for an FSDP2 model of the same module::

    {"model": {"lin.weight": DTensor, ..., "norm.running_mean": tensor},   original names
     "optim": {"state": {"lin.weight": {"step": tensor, "exp_avg": DTensor, ...}, ...},
               "param_groups": [{"lr": 0.01, ..., "params": ["lin.weight", ...]}, ...]}}

**The rows.** Each DTensor is a parameter (or state shaped like it) cut on dim 0, ``Shard(0)``
over the shard group: rank r's local tensor is rows [r*c, r*c + c) ∩ [0, R), c = ceil(R / N) --
the rows it holds at stages 1-3 (flat.py), and the rows FSDP2's ``Shard(0)`` holds. So every
rank writes only its own rows (stage 0 too: it cuts them out of its full parameters) and no
rank ever holds the whole model. DCP records each chunk's offset in ``.metadata``; a load asks
for this rank's rows (a DTensor again, or a whole tensor at stage 0) and DCP reads whatever
chunks overlap them: the interval arithmetic state.py does by hand for its own files.
Scalars (Adam's ``step``, a 0-dim parameter), buffers and hyperparameters are the same on every
rank: DCP writes them once, from the lowest rank, which always holds row 0.

**Trust.** DCP itself unpickles ``.metadata`` and the hyperparameters with plain pickle; here
both are read with an allow-list (:class:`_SafeReader`, :class:`_SafeLoadPlanner`), so, as
with minishard's own files, loading a checkpoint never runs code from it.

DTensor appears only here, at the boundary: the engine stays on raw collectives. DCP runs its
own collectives inside ``dcp.save`` / ``dcp.load`` (it gathers and scatters its plans as
objects): the one place where minishard lets collectives bypass comm.py, because they are
torch's checkpoint library's, not ours. Collective, like everything in state.py.
"""
from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from minishard import comm
from minishard.checkpoint_files import CheckpointError, saved_rows
from minishard.full_state import (buffer_state, group_param_names, hyperparameters, named_params,
                                  split_state, torch_optimizer_state)
from minishard.verdicts import raise_together

__all__ = ["METADATA", "is_dcp_checkpoint", "save_dcp", "read_dcp"]

METADATA = ".metadata"  # DCP writes it last, once every rank's data file is in place


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


# --------------------------------------------------------------------------------- the rows
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
    its chunk, cut out of whatever it holds; a 0-dim tensor whole, from the rank holding it."""
    flat, j = param.flat, param.index
    lo, hi = saved_rows(flat.n_rows[j], world, rank)
    held_lo, held_hi = flat.row_ranges[j]
    rows = held.detach().reshape(held_hi - held_lo, flat.row_numels[j])[lo - held_lo:hi - held_lo]
    if len(param.shape) == 0:  # cannot be cut; rank 0 holds it, and dedup keeps rank 0's copy
        return rows.reshape(()).clone() if hi > lo else torch.zeros((), dtype=held.dtype)
    # .clone(): a fresh tensor of just these rows, not a view into the flat buffer
    return _as_dtensor(rows.reshape(hi - lo, *param.shape[1:]).clone(), param.shape, mesh)


def _target(param, like: torch.Tensor, mesh: DeviceMesh):
    """An empty tensor for a load to fill with this rank's rows of one parameter (or of state
    shaped like it): a DTensor chunk at stages 1-3, the whole tensor at stage 0."""
    held_lo, held_hi = param.flat.row_ranges[param.index]
    if len(param.shape) == 0 or (held_lo, held_hi) == (0, param.flat.n_rows[param.index]):
        # everything (stage 0, a 0-dim parameter, or one rank holds every row)
        return torch.empty(param.shape, dtype=like.dtype, device=like.device)
    rows = torch.empty(held_hi - held_lo, *param.shape[1:], dtype=like.dtype, device=like.device)
    return _as_dtensor(rows, param.shape, mesh)


def _per_element(t, param) -> bool:
    """Is a loaded optimizer entry shaped like its parameter (cut into rows), not a scalar?"""
    return isinstance(t, torch.Tensor) and len(param.shape) > 0 and t.dim() > 0


def _held(param, loaded) -> torch.Tensor:
    """A filled :func:`_target` as this rank's rows, shaped like its user parameter."""
    if isinstance(loaded, DTensor):
        return loaded.to_local().reshape(param.user.shape)
    flat, j = param.flat, param.index
    held_lo, held_hi = flat.row_ranges[j]
    return loaded.reshape(flat.n_rows[j], flat.row_numels[j])[held_lo:held_hi].reshape(
        param.user.shape)


# ------------------------------------------------------------------------------------- save
def save_dcp(path: str, model, optimizer, overwrite: bool) -> None:
    """save_checkpoint(format="dcp") on the ranks of ONE shard group."""
    if is_dcp_checkpoint(path) and not overwrite:
        raise FileExistsError(f"{path} already holds a DCP checkpoint; save each step into a "
                              "fresh directory (checkpoint_path(root, step)), or pass "
                              "overwrite=True")
    mesh, group = _mesh(model), model.group
    world, rank = comm.group_size(group), comm.group_rank(group)
    values, states = {}, {}
    for name, param in named_params(model):
        value = _saved(param, param.user, mesh, world, rank)
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
    dcp.save(content, checkpoint_id=path, process_group=group,
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))


# ------------------------------------------------------------------------------------- load
def read_dcp(path: str, model, optimizer):
    """Read the DCP checkpoint at ``path`` for this rank, changing nothing yet: (values per
    parameter, buffers, the optimizer's torch state dict or None, the saved param groups).
    Every check happens before the read, and every rank raises together."""
    mesh, group = _mesh(model), model.group
    replicas = getattr(model, "replicate_group", None)
    groups = [group] if replicas is None else [group, replicas]
    error, targets = None, {}
    try:
        saved = _SafeReader(path).read_metadata().state_dict_metadata
        targets = _model_targets(path, saved, model, mesh)
        if optimizer is not None:
            targets.update(_optim_targets(path, saved, model, mesh))
    except Exception as exc:  # still join the verdict below, or the other ranks would hang
        error = exc
    raise_together(error, groups, "dcp checkpoint: checked", CheckpointError(
        f"another rank could not load {path} (its error names the problem); nothing was loaded"))
    try:  # DCP raises on every rank when any rank fails
        dcp.load(targets, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(),
                 process_group=group)
    except Exception as exc:
        raise CheckpointError(f"could not read the DCP checkpoint at {path}: {exc}") from exc
    error = optim_sd = saved_groups = None
    try:
        if optimizer is not None:
            optim_sd, saved_groups = _optimizer_state(path, targets, model, optimizer)
    except Exception as exc:
        error = exc
    raise_together(error, groups, "dcp checkpoint: optimizer checked", CheckpointError(
        f"another rank could not load the optimizer state of {path}; nothing was loaded"))
    values = [(param.user, _held(param, targets[f"model.{_saved_name(param, saved)}"]))
              for _, param in named_params(model)]
    buffers = {k: targets[f"model.{k}"] for k in buffer_state(model.module)}
    return values, buffers, optim_sd, saved_groups


def _saved_name(param, saved) -> str:
    """The first of a parameter's names that the checkpoint holds (a tied one may hold all)."""
    return next((p.fqn for p in param.places if f"model.{p.fqn}" in saved), param.name)


def _model_targets(path: str, saved: dict, model, mesh) -> dict:
    """``model.<name>`` -> an empty tensor for every parameter and buffer, checked against the
    checkpoint's names and shapes first."""
    mine = {f"model.{_saved_name(p, saved)}": (p, p.user) for _, p in named_params(model)}
    buffers = {f"model.{k}": b for k, b in buffer_state(model.module).items()}
    aliases = {f"model.{pl.fqn}" for _, p in named_params(model) for pl in p.places}
    theirs = {k for k in saved if k.startswith("model.")}
    problems = []
    if sorted(theirs - aliases - set(buffers)):
        problems.append(f"entries the model does not have {sorted(theirs - aliases - set(buffers))}")
    if sorted(set(mine) - theirs) + sorted(set(buffers) - theirs):
        problems.append(f"entries missing from the checkpoint "
                        f"{sorted(set(mine) - theirs) + sorted(set(buffers) - theirs)}")
    shapes = {k: tuple(p.shape) for k, (p, _) in mine.items()}
    shapes.update({k: tuple(b.shape) for k, b in buffers.items()})
    problems += [f"{k[6:]}: checkpoint {tuple(saved[k].size)}, model {shape}"
                 for k, shape in shapes.items() if k in theirs
                 and (isinstance(saved[k], BytesStorageMetadata) or tuple(saved[k].size) != shape)]
    if problems:
        raise CheckpointError(f"DCP checkpoint at {path} was saved from a different model: "
                              + "; ".join(problems) + ". Load it into the model it was saved from.")
    targets = {k: _target(p, user, mesh) for k, (p, user) in mine.items()}
    targets.update({k: torch.empty_like(b) for k, b in buffers.items()})
    return targets


def _optim_targets(path: str, saved: dict, model, mesh) -> dict:
    """``optim.state.<name>.<key>`` and ``optim.param_groups.<i>.<key>`` -> what to fill: this
    rank's rows of state shaped like the parameter, a whole scalar, or None for a pickled value."""
    keys = [k for k in saved if k.startswith("optim.")]
    if not any(k.startswith("optim.param_groups.") for k in keys):
        raise CheckpointError(f"DCP checkpoint at {path} holds no optimizer state (no "
                              "optim.param_groups); call load_checkpoint(path, model)")
    targets = {k: None for k in keys if k.startswith("optim.param_groups.")}
    state_keys = {k for k in keys if k.startswith("optim.state.")}
    for _, param in named_params(model):
        prefix = f"optim.state.{param.name}."
        for k in [k for k in state_keys if k.startswith(prefix) and "." not in k[len(prefix):]]:
            state_keys.discard(k)
            md = saved[k]
            if isinstance(md, BytesStorageMetadata):
                targets[k] = None
            elif tuple(md.size) == ():
                targets[k] = torch.empty((), dtype=md.properties.dtype)
            elif tuple(md.size) == tuple(param.shape):
                targets[k] = _target(param, torch.empty(0, dtype=md.properties.dtype,
                                                        device=param.user.device), mesh)
            else:
                raise CheckpointError(f"DCP checkpoint at {path}: optimizer state {k[12:]!r} has "
                                      f"shape {tuple(md.size)}, neither the parameter's "
                                      f"{tuple(param.shape)} nor a scalar")
    if state_keys:
        raise CheckpointError(f"DCP checkpoint at {path} holds optimizer state for parameters "
                              f"the model does not have: {sorted(state_keys)[:4]}")
    return targets


def _optimizer_state(path: str, targets: dict, model, optimizer):
    """The loaded entries as the optimizer's own state dict, after checking its param groups."""
    saved_groups = {}
    for key, value in targets.items():
        if key.startswith("optim.param_groups."):
            index, name = key[len("optim.param_groups."):].split(".", 1)
            saved_groups.setdefault(int(index), {})[name] = value
    saved_groups = [saved_groups[i] for i in sorted(saved_groups)]
    mine = group_param_names(model, optimizer)
    if [sorted(g.get("params", [])) for g in saved_groups] != [sorted(g) for g in mine]:
        raise CheckpointError(
            f"DCP checkpoint at {path}: its param groups hold "
            f"{[g.get('params') for g in saved_groups]}, the optimizer's hold {mine}; build the "
            "optimizer with the same param groups")
    for i, (g, s) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if set(hyperparameters(g)) != set(s) - {"params"}:
            raise CheckpointError(
                f"DCP checkpoint at {path}: param group {i} has the settings {sorted(s)}, the "
                f"{type(optimizer).__name__}'s {sorted(hyperparameters(g))}: it was saved by "
                "another kind of optimizer")
    by_name = {name: param for name, param in named_params(model)}
    states = []
    for names in mine:
        states.append([])
        for name in names:
            param, prefix = by_name[name], f"optim.state.{name}."
            state = {k[len(prefix):]: v for k, v in targets.items() if k.startswith(prefix)}
            states[-1].append({k: _held(param, v) if _per_element(targets[prefix + k], param)
                               else v for k, v in state.items()} or None)
    return torch_optimizer_state(({k: v for k, v in s.items() if k != "params"}, st)
                                 for s, st in zip(saved_groups, states)), saved_groups


# ------------------------------------------------------------------------------ never run code
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # None: any class of that module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _Restricted(pickle.Unpickler):
    """pickle with an allow-list: DCP's metadata classes, torch sizes and dtypes, paths."""

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get(module, set())
        if (allowed is None and isinstance(getattr(__import__(module, fromlist=[name]), name,
                                                   None), type)) or (allowed and name in allowed):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load {module}.{name} from a DCP checkpoint: only "
                              "DCP's metadata, tensors and plain values may be in it, and loading "
                              "a checkpoint never runs code from it")


class _SafeReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read through the allow-list instead of plain pickle."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, METADATA), "rb") as fh:
            metadata = _Restricted(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with pickled values (hyperparameters) read ``weights_only``."""

    def load_bytes(self, read_item, value) -> None:
        self.original_state_dict[self.mappings[read_item.dest_index.fqn][0]] = \
            torch.load(value, weights_only=True)
