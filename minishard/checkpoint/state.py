"""Checkpoints of a ZeRO model: one file per rank, written atomically, loadable at any world size.

A checkpoint is a directory. Save each step into a fresh one (``checkpoint_path(root, step)``)::

    ckpt/step-000002/
        rank0-of-2.pt   rank 0's rows of every parameter: values + optimizer state
        rank1-of-2.pt   rank 1's rows
        extra.pt        (with ``extra=``) every rank's own state: the step, RNG states...
        meta.pt         written LAST, by rank 0, once every rank's file is in place

**The rows.** Every parameter is cut the same way, whatever the stage: with N ranks and R rows
(dim 0), rank r saves rows [r*c, r*c + c) ∩ [0, R), c = ceil(R / N), the rows it holds at stages
1-3 (flat.py), and its optimizer state alike ([Note: the rows]). Loading at M ranks is then
interval arithmetic on rows::

    a parameter of 10 rows    saved by 4 ranks (c=3):  [0:3) [3:6) [6:9) [9:10)
                              loaded by 3 ranks (c=4): [0:4)   [4:8)   [8:10)
    new rank 1 needs rows [4:8): it opens the files of saved ranks 1 and 2 only, and
    concatenates old1[1:3] (= rows 4-5) and old2[0:2] (= rows 6-7)

**Atomic** (files.py): every file goes to a temporary name, then ``os.replace`` puts it in place,
and ``meta.pt``, last, records each rank file's byte size and sha256, so a checkpoint directory
is COMPLETE iff meta.pt exists and lists files whose sizes (and sha256) match: a crash mid-save
leaves one without it, which :func:`latest_checkpoint` skips. Files are read back
``weights_only``: loading a checkpoint never runs code from it ([Note: atomic]).

Every function here is collective (call it on every rank, in the same order) unless its docstring
says otherwise. Hybrid sharding, the full export and the training loop's own state (``extra=``):
[Note: what else a checkpoint holds].
"""
from __future__ import annotations

import os
import struct

import torch

from minishard import comm
from minishard.checkpoint import directory, files as checkpoint_files
from minishard.checkpoint.files import (FORMAT_VERSION, META, CheckpointError, atomic_save,
                                        check_checkpoint, checkpoint_path, latest_checkpoint,
                                        saved_piece, saved_rows, shard_file_name)
from minishard.checkpoint.dcp import (init_optimizer_state, is_dcp_checkpoint, read_dcp, save_dcp)
from minishard.checkpoint.full_state import (buffer_state, full_optimizer_state_dict,
                                             group_param_names, hyperparameters,
                                             load_full_optimizer_state_dict, load_rows_into,
                                             named_params, original_parameter_names, split_state,
                                             torch_optimizer_state)
from minishard.verdicts import raise_together

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "check_checkpoint",
           "checkpoint_path", "CheckpointError", "full_optimizer_state_dict",
           "load_full_optimizer_state_dict", "original_parameter_names", "FORMAT_VERSION"]


# ------------------------------------------------------------------------------------- save
# [Note: atomic] Every file is written to a temporary name in the same directory, flushed to
# disk and ``os.replace``-d into place, so a file is either absent or whole (files.py). A crash
# at any moment of a save leaves a directory without meta.pt (incomplete, skipped by
# :func:`latest_checkpoint`, refused by :func:`load_checkpoint`), and the previous step's
# directory untouched. Every file is read back with ``torch.load(..., weights_only=True)``:
# loading a checkpoint never runs code from it.
#
# [Note: what else a checkpoint holds]
# * Hybrid sharding (a 2-D mesh): the replicas hold identical shards, so only the first replica
#   writes, one file per rank of its shard group: the files of S ranks, loadable at any world
#   size.
# * Full export (full_state.py): :func:`full_optimizer_state_dict` turns the sharded optimizer
#   state into the state dict a plain ``torch.optim`` optimizer over the UNWRAPPED model would
#   have, so ``model.full_state_dict()`` plus it resume training in a single process.
# * The training loop's own state (the step, the best loss, every rank's RNG state, an LR
#   scheduler's ``state_dict()``) travels as ``save_checkpoint(..., extra={...})``: extra.pt,
#   every rank's by rank, written before the marker, returned by :func:`load_checkpoint` to each
#   rank.
def save_checkpoint(path: str | os.PathLike, model, optimizer=None, *, extra=None,
                    overwrite: bool = False, format: str = "minishard") -> None:
    """Save ``model`` (a ``minishard.ZeRO``) and its ``optimizer`` into the directory ``path``.

    ``extra``: this rank's own state to keep with them, as nanoGPT's checkpoint dict keeps
    ``iter_num`` and ``best_val_loss`` and torchtitan's its train state: a dict of numbers,
    strings, tensors (``torch.get_rng_state()``) and containers of them, which may differ
    between ranks. :func:`load_checkpoint` returns it to the same rank, in either format.

    ``format="minishard"``: the rank files and meta.pt described above. ``format="dcp"``: a
    torch.distributed.checkpoint directory holding ``{"model": ..., "optim": ...}`` exactly as
    FSDP2's ``get_model_state_dict`` / ``get_optimizer_state_dict`` give them, which FSDP2 loads
    (dcp.py). :func:`load_checkpoint` reads either, and torchtitan's layout too.

    Collective. Every rank writes its own file; then they tell rank 0 the size and sha256 of
    what they wrote (an all-gather, which is also the barrier: it cannot finish before every
    file is in place); then rank 0 writes meta.pt; a last all-reduce makes every rank return
    only once the checkpoint is complete. ``path`` must not hold a checkpoint already, unless
    ``overwrite``: then the new one is written beside it (``path.saving``) and swapped in once
    complete, so a crash at any moment leaves the previous or the new one loadable from ``path``
    (nanoGPT's habit: one checkpoint, rewritten at every evaluation).

    Hybrid sharding (a 2-D mesh): the replicas hold identical shards, so only the first one
    (replicate rank 0) writes, one file per rank of its shard group; the others wait for it
    and raise if it failed. The files are those of S ranks: load them at any world size.
    """
    if format not in ("minishard", "dcp"):
        raise ValueError(f"save_checkpoint: format must be 'minishard' or 'dcp', got {format!r}")
    path = checkpoint_files.path_first("save_checkpoint", path, model)
    if format == "dcp":
        init_optimizer_state(optimizer)
    extras = directory.gather_extras(extra, model.every_group)

    def write() -> None:
        into = directory.make_room(path, model.group, overwrite)
        record = directory.write_extras(into, extras, model.group)  # before the marker: see there
        if format == "dcp":
            save_dcp(into, model, optimizer, record)
        else:
            _save_shards(into, model, optimizer, record)
        if into != path:
            directory.swap_in(into, path, model.group)

    replicas = getattr(model, "replicate_group", None)
    if replicas is None:
        return write()
    error = None
    if comm.group_rank(replicas) == 0:
        try:
            write()
        except Exception as exc:  # still join the all-reduce below, or the replicas would hang
            error = exc
    raise_together(error, [replicas], "checkpoint: first replica done", CheckpointError(
        f"the first replica could not save {path} (its error names the problem); the "
        "checkpoint is incomplete"))


def _save_shards(path: str, model, optimizer, extra_file: dict | None) -> None:
    """save_checkpoint on the ranks of ONE shard group (all of them, without replicas)."""
    group = model.group
    rank, world = comm.group_rank(group), comm.group_size(group)
    meta_file = os.path.join(path, META)
    groups = group_param_names(model, optimizer) if optimizer is not None else None

    # 1. this rank's file: its rows of every parameter, values and optimizer state.
    mine = {"format": FORMAT_VERSION, "rank": rank, "world_size": world,
            "params": _rank_rows(model, optimizer, world, rank)}
    error = None
    try:
        size, digest = atomic_save(mine, os.path.join(path, shard_file_name(rank, world)))
        report = torch.tensor([size, *struct.unpack("<4q", digest)], dtype=torch.int64)
    except Exception as exc:  # still join the all-gather below, or the other ranks would hang
        error, report = exc, torch.full((5,), -1, dtype=torch.int64)

    # 2. barrier + every file's size and sha256 to everyone (rank 0 needs them).
    table = torch.empty(world * 5, dtype=torch.int64)
    comm.all_gather(table, report, group, tag="checkpoint: files written")
    table = table.view(world, 5).tolist()
    failed = [r for r in range(world) if table[r][0] < 0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"ranks {failed} could not write their files into {path}; it has no "
                              f"{META}, so it stays incomplete (their errors say why)")

    # 3. meta.pt, last.
    if rank == 0:
        try:  # building meta.pt may raise too: the other ranks wait below for rank 0's word
            atomic_save({**_meta(model, optimizer, world, table, groups),
                         "extra_file": extra_file}, meta_file)
        except Exception as exc:
            error = exc
    raise_together(error, [group], "checkpoint: meta written", CheckpointError(
        f"rank 0 could not write {meta_file}; {path} stays incomplete"))


def _held(param) -> tuple[int, int, torch.Tensor]:
    """The rows [lo, hi) this rank's user parameter holds, and them as (rows, row numel)."""
    flat, j = param.flat, param.index
    lo, hi = flat.row_ranges[j]
    return lo, hi, param.rows.detach().reshape(hi - lo, flat.row_numels[j])


# [Note: the rows] The cut is exactly the rows a parameter holds at stages 1-3 (flat.py). Stage
# 0 holds whole parameters on every rank; rank r still saves only its rows, so the files never
# depend on the stage. Optimizer state shaped like the parameter (Adam's ``exp_avg``, SGD's
# ``momentum_buffer``) is cut with the same rows; scalar state (``step``) is copied.
def _rank_rows(model, optimizer, world: int, rank: int) -> dict:
    """What ``rank`` of ``world`` saves of every parameter: its rows of the values and of the
    optimizer state shaped like the parameter, and the scalar state."""
    out = {}
    for name, param in named_params(model):
        lo, hi = saved_rows(param.flat.n_rows[param.index], world, rank)
        # .clone(): torch.save of a view would write its whole underlying storage
        entry = {"rows": [lo, hi], "value": saved_piece(param, param.rows, world, rank).clone()}
        state = optimizer.state.get(param.user) if optimizer is not None else None
        if state:
            per_element, scalars = split_state(state, param.user)
            entry["state"] = {k: saved_piece(param, v, world, rank).clone()
                              for k, v in per_element.items()}
            entry["scalars"] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                for k, v in scalars.items()}
        out[name] = entry
    return out


def _meta(model, optimizer, world: int, table: list, groups) -> dict:
    """meta.pt: the files (size, sha256: ``table``), the parameters, buffers, optimizer."""
    return {
        "format": FORMAT_VERSION,
        "world_size": world,
        "stage": model.stage,
        "files": [{"name": shard_file_name(r, world), "bytes": row[0],
                   "sha256": struct.pack("<4q", *row[1:]).hex()}
                  for r, row in enumerate(table)],
        "params": [{"name": name, "shape": list(param.shape),
                    "dtype": str(param.flat.dtype).replace("torch.", ""),
                    "fqns": [pl.fqn for pl in param.places],
                    "n_rows": param.flat.n_rows[param.index],
                    "rows": [list(saved_rows(param.flat.n_rows[param.index], world, r))
                             for r in range(world)]}
                   for name, param in named_params(model)],
        # buffers are identical on all ranks: ZeRO broadcast them at wrap time; the model's
        # own code keeps them so
        "buffers": {k: v.detach().clone() for k, v in buffer_state(model.module).items()},
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "param_groups": [{**hyperparameters(g), "names": names}
                             for g, names in zip(optimizer.param_groups, groups)]},
    }


# ------------------------------------------------------------------------------------- load
def _check_same_model(path: str, meta: dict, model) -> None:
    """Refuse a checkpoint of another model, naming the first differences."""
    saved = {fqn: tuple(p["shape"]) for p in meta["params"] for fqn in p["fqns"]}
    mine = {pl.fqn: tuple(param.shape) for _, param in named_params(model)
            for pl in param.places}
    problems = []
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    wrong = [f"{k}: checkpoint {saved[k]}, model {mine[k]}"
             for k in mine if k in saved and saved[k] != mine[k]]
    if missing:
        problems.append(f"parameters missing from the checkpoint {missing}")
    if unexpected:
        problems.append(f"parameters the model does not have {unexpected}")
    if wrong:
        problems.append(f"shapes differ: {'; '.join(wrong)}")
    buffers = buffer_state(model.module)
    saved_buffers = meta["buffers"]
    if set(buffers) != set(saved_buffers):
        problems.append(f"buffers differ: checkpoint {sorted(saved_buffers)}, model {sorted(buffers)}")
    else:
        problems += [f"buffer {k}: checkpoint {tuple(saved_buffers[k].shape)}, model "
                     f"{tuple(b.shape)}" for k, b in buffers.items()
                     if saved_buffers[k].shape != b.shape]
    if problems:
        raise CheckpointError(f"checkpoint at {path} was saved from a different model: "
                              + "; ".join(problems) + ". Load it into the model it was saved from.")
    names = [p["name"] for p in meta["params"]]
    if sorted(names) != sorted(name for name, _ in named_params(model)):
        raise CheckpointError(
            f"checkpoint at {path} names its tied parameters differently ({names}); load it "
            "into the model it was saved from, or go through model.full_state_dict().")


def _check_same_optimizer(path: str, meta: dict, model, optimizer) -> list[dict]:
    """The checkpoint's param groups, checked against ``optimizer``'s."""
    saved = meta["optimizer"]
    if saved is None:
        raise CheckpointError(f"checkpoint at {path} holds no optimizer state (it was saved "
                              "without an optimizer); call load_checkpoint(path, model)")
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint at {path} holds {saved['class']} state, but the "
                              f"optimizer is a {type(optimizer).__name__}")
    groups = group_param_names(model, optimizer)
    saved_groups = [g["names"] for g in saved["param_groups"]]
    if groups != saved_groups:
        raise CheckpointError(f"checkpoint at {path}: the optimizer's param groups hold "
                              f"{groups}, the saved ones held {saved_groups}; build the optimizer "
                              "with the same param groups")
    return saved["param_groups"]


def load_checkpoint(path: str | os.PathLike, model, optimizer=None) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (a ``minishard.ZeRO``) and ``optimizer``
    (built over ``model.parameters()``, as for training). Returns the checkpoint's metadata,
    with ``"extra"``: what this rank (its rank among all the engine's ranks) passed as
    ``save_checkpoint(extra=...)`` (None if nothing, or if the saving run had fewer ranks), and
    ``"extras"``: every saving rank's, by rank (None if none was saved).

    Collective. The world size and the stage may differ from the saving run's: each rank works
    out which rows of each parameter it holds now, opens only the saved ranks' files that overlap
    them, and concatenates the overlapping rows of the values and of the optimizer state (see
    the module docstring). Every check happens before anything changes: if
    any rank cannot load, all ranks raise and the model and optimizer are left as they were.

    A torch.distributed.checkpoint directory (``.metadata`` in it: saved by FSDP2, torchtitan or
    ``format="dcp"``) is read the same way, by DCP (dcp.py); the metadata returned is
    then ``{"format": "dcp", "param_groups": [the saved groups]}``.
    """
    path = checkpoint_files.committed(checkpoint_files.path_first("load_checkpoint", path, model))
    group = model.group
    if is_dcp_checkpoint(path):
        masters, buffers, optim_sd, saved_groups = read_dcp(path, model, optimizer)
        extras = directory.read_extras(path, checkpoint_files.dcp_extra_record(path), model.every_group,
                              together=True)
        _apply(model, optimizer, masters, buffers, optim_sd)
        return {"format": "dcp", "param_groups": saved_groups, **extras}
    error = extras = None
    try:
        meta = check_checkpoint(path, checksums=False)  # sha256 is checked as each file is read
        extras = directory.read_extras(path, meta.get("extra_file"), model.every_group, together=False)
        _check_same_model(path, meta, model)
        saved_groups = (_check_same_optimizer(path, meta, model, optimizer)
                        if optimizer is not None else None)
        reader = _ShardFiles(path, meta)
        masters, states = [], {}
        for name, param in named_params(model):
            values, state = _assemble(name, param, meta, reader)
            masters.append((param, values))
            if state is not None:
                states[id(param.user)] = state
        optim_sd = None if not optimizer else torch_optimizer_state(
            ({k: v for k, v in saved.items() if k != "names"},
             [states.get(id(p)) for p in group["params"]])
            for group, saved in zip(optimizer.param_groups, saved_groups))
    except Exception as exc:  # still join the all-reduce below, or the other ranks would hang
        error = exc
    replicas = getattr(model, "replicate_group", None)  # max over shards, then replicas
    raise_together(error, [group] if replicas is None else [group, replicas],
                   "checkpoint: files read", CheckpointError(
                       f"another rank could not load {path} (its error names the problem); "
                       "nothing was loaded"))

    _apply(model, optimizer, masters, meta["buffers"], optim_sd)
    return {**meta, **extras}


def _apply(model, optimizer, masters: list, buffers: dict, optim_sd: dict | None) -> None:
    """Everything checked: now change the model. Each written shard is marked stale: the
    next forward re-gathers its full parameters (flat.py: needs_gather)."""
    with torch.no_grad():
        for param, values in masters:
            param.rows.copy_(values.to(param.rows.dtype).reshape(param.rows.shape))
            param.flat.mark_stale()
        for name, buf in buffer_state(model.module).items():  # keys checked by the reader
            buf.copy_(buffers[name])
    if optimizer is not None:
        load_rows_into(optimizer, optim_sd)


class _ShardFiles:
    """The saved ranks' files, each read (and checked against meta.pt) when first needed."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta, self.loaded = path, meta, {}

    def __getitem__(self, r: int) -> dict:
        if r not in self.loaded:
            info, world = self.meta["files"][r], self.meta["world_size"]
            content = checkpoint_files.read_checked(os.path.join(self.path, info["name"]), expect=info)
            if (content.get("rank"), content.get("world_size")) != (r, world):
                raise CheckpointError(
                    f"{info['name']} in {self.path} says it is rank {content.get('rank')} of "
                    f"{content.get('world_size')}; {META} expects rank {r} of {world}. The "
                    "checkpoint is inconsistent; load an earlier one.")
            self.loaded[r] = content
        return self.loaded[r]


def _assemble(name: str, param, meta: dict, files: _ShardFiles):
    """This rank's rows [lo, hi) of one parameter, cut out of the saved ranks' files that overlap
    them: (values, optimizer state shaped like the user parameter, or None)."""
    lo, hi, held = _held(param)
    shape = param.rows.shape
    rows = next(p["rows"] for p in meta["params"] if p["name"] == name)
    sources = [r for r, (a, b) in enumerate(rows) if a < hi and lo < b]
    # An empty shard (more ranks than rows) has no rows to read but still needs the scalar
    # state (Adam's step): take it from saved rank 0, cutting an empty piece.
    sources = sources or [0]
    pieces, state_pieces, scalars, with_state = [], {}, {}, []
    for r in sources:
        a, b = rows[r]
        cut = slice(max(lo, a) - a, min(hi, b) - a)  # [lo, hi) ∩ [a, b), relative to a
        entry = files[r]["params"][name]
        pieces.append(entry["value"][cut])
        if "state" in entry:
            with_state.append(r)
            scalars = entry["scalars"]
            for key, t in entry["state"].items():
                state_pieces.setdefault(key, []).append(t[cut])
    values = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one source: no copy
    if values.shape != held.shape:
        raise CheckpointError(f"parameter {name!r}: assembled {tuple(values.shape)} for rows "
                              f"[{lo}, {hi}) from {files.path}; the checkpoint is inconsistent")
    if not with_state:
        return values, None
    if with_state != sources:
        raise CheckpointError(f"parameter {name!r}: saved ranks {sources} hold this rank's rows, "
                              f"but only {with_state} saved optimizer state; the checkpoint is "
                              "inconsistent")
    return values, {**scalars, **{k: (v[0] if len(v) == 1 else torch.cat(v)).reshape(shape)
                                  for k, v in state_pieces.items()}}
