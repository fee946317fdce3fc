"""Checkpoints of a ZeRO model: one file per rank, written atomically, loadable at any world size.

A checkpoint is a directory. Save each step into a fresh one (``checkpoint_path(root, step)``)::

    ckpt/step-000002/
        rank0-of-2.pt   rank 0's slice of every flat buffer: master values + optimizer state
        rank1-of-2.pt   rank 1's slice
        meta.pt         written LAST, by rank 0, once every rank's file is in place

**The slices.** Every flat buffer (flat.py) is cut the same way, whatever the stage: with N ranks
and k = ceil(numel / N), rank r saves the unpadded range [r*k, r*k + k) ∩ [0, numel) -- exactly
the elements its shard Parameter holds at stages 1-3. (Stage 0 keeps the whole flat on every
rank; rank r still saves only its range, so the files never depend on the stage.) Optimizer state
shaped like the shard (Adam's ``exp_avg``, SGD's ``momentum_buffer``) is cut with the same ranges;
scalar state (``step``) is copied. Loading at M ranks is then interval arithmetic::

    a flat of 14 elements     [a a a a a a b b b c c c c c]
    saved by 4 ranks (k=4)    [0:4)   [4:8)   [8:12)  [12:14)
    loaded by 3 ranks (k=5)   [0:5)      [5:10)       [10:14)
    new rank 1 needs [5:10): it opens the files of old ranks 1 and 2 only, and
    concatenates old1[1:4] (= [5:8)) and old2[0:2] (= [8:10))

**Hybrid sharding** (a 2-D mesh): the replicas hold identical shards, so only the first replica
writes, one file per rank of its shard group: the files of S ranks, loadable at any world size.

**Atomic.** Every file is written to a temporary name in the same directory, flushed to disk and
``os.replace``-d into place, so a file is either absent or whole. ``meta.pt`` comes last and
records each rank file's byte size and sha256, so:

    a checkpoint directory is COMPLETE  iff  meta.pt exists and lists files whose sizes
    (and sha256) match.

A crash at any moment of a save leaves a directory without meta.pt (incomplete, skipped by
:func:`latest_checkpoint`, refused by :func:`load_checkpoint`), and the previous step's directory
untouched. Every file is read back with ``torch.load(..., weights_only=True)``: loading a
checkpoint never runs code from it.

**Full export.** :func:`full_optimizer_state_dict` turns the sharded optimizer state into the
state dict a plain ``torch.optim`` optimizer over the UNWRAPPED model would have, so
``model.full_state_dict()`` plus it resume training in a single process.

Every function here is collective (call it on every rank, in the same order) unless its docstring
says otherwise. Data-loader position, RNG state and LR schedulers are the caller's to save.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re
import struct

import torch

from minishard import comm

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "check_checkpoint",
           "checkpoint_path", "CheckpointError", "full_optimizer_state_dict",
           "load_full_optimizer_state_dict", "original_parameter_names", "FORMAT_VERSION"]

FORMAT_VERSION = 1
META = "meta.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, damaged, or does not fit the model it is loaded into."""


def checkpoint_path(root: str | os.PathLike, step: int) -> str:
    """``root/step-000042``: one fresh directory per step, so a crash never touches the last good
    one (names sort in step order; :func:`latest_checkpoint` relies on that)."""
    return os.path.join(os.fspath(root), f"step-{step:06d}")


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.pt"


def saved_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The unpadded range of a flat of ``numel`` elements that ``rank`` of ``world_size`` saves:
    its shard at stages 1-3 (flat.py pads to N*k; the padding is never saved)."""
    k = math.ceil(numel / world_size)
    lo = min(rank * k, numel)
    return lo, min(lo + k, numel)


# --------------------------------------------------------------------------- the model's flats
def _flats(model):
    """``(name, flat, fqns)`` for every flat buffer of the engine, in unit order. ``name`` is the
    flat's tag, unit name + dtype (+ "/frozen"), e.g. ``blocks.0/float32``: stable across runs
    and world sizes. ``fqns[j]`` lists every name parameter j has in the module (tied: several)."""
    seen = set()
    for unit in model.units:
        for flat, places in zip(unit.flats, unit.bindings):
            if flat.name in seen or not flat.name:
                raise CheckpointError(f"two flat buffers share the name {flat.name!r}; "
                                      "checkpoints key flat buffers by name")
            seen.add(flat.name)
            yield flat.name, flat, [[b.fqn for b in bindings] for bindings in places]


def _held_range(flat) -> tuple[int, int]:
    """The unpadded range [lo, hi) that this rank's shard Parameter holds (stage 0: all of it)."""
    if flat.mode == "none":
        return 0, flat.numel
    lo = min(flat.shard_start, flat.numel)
    return lo, lo + flat.shard_real


def _split_state(state: dict, shard: torch.Tensor) -> tuple[dict, dict]:
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


def _group_flat_names(model, optimizer) -> list[list[str]]:
    """For each param group of ``optimizer``, the names of the flats whose shards it holds."""
    name_of = {id(flat.shard): name for name, flat, _ in _flats(model)}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in name_of for p in group["params"]):
            raise CheckpointError(
                f"param group {i} of the {type(optimizer).__name__} holds a tensor that is not a "
                "shard of this ZeRO model; build the optimizer over model.parameters()")
        groups.append([name_of[id(p)] for p in group["params"]])
    return groups


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


# ------------------------------------------------------------------------------- files on disk
def _atomic_save(obj, final: str) -> tuple[int, bytes]:
    """``torch.save`` to a temporary name in the same directory, fsync, ``os.replace``: readers
    see the old file or the whole new one, never half of it. Returns (byte size, sha256)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)  # atomic on POSIX and Windows, within one filesystem
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some platforms cannot fsync a directory
    return len(data), hashlib.sha256(data).digest()


def _read(file: str, expect: dict | None = None):
    """``torch.load(weights_only=True)`` one file; with ``expect`` ({"bytes", "sha256"} from
    meta.pt), first check that it is the very file the checkpoint recorded."""
    with open(file, "rb") as fh:
        data = fh.read()
    if expect is not None:
        if len(data) != expect["bytes"]:
            raise CheckpointError(_size_problem(file, len(data), expect["bytes"]))
        if hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise CheckpointError(
                f"{file} does not match the sha256 recorded in meta.pt: it was corrupted or "
                "overwritten after the checkpoint was saved. Load an earlier checkpoint.")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refusing to load {file}: it holds Python objects other than tensors and plain "
            "containers, and minishard loads with torch.load(weights_only=True), which never runs "
            "code from a file. save_checkpoint never writes such objects: this file was not "
            f"written by minishard, or was tampered with. ({str(exc).splitlines()[0]})") from exc
    except Exception as exc:
        raise CheckpointError(
            f"{file} could not be read ({type(exc).__name__}: {str(exc).splitlines()[0]}): it is "
            "truncated or corrupted. Load an earlier checkpoint (latest_checkpoint(root)).") from exc


def _size_problem(file: str, size: int, recorded: int) -> str:
    return (f"{file} has {size} bytes but meta.pt recorded {recorded}: it is truncated or was "
            "overwritten after the checkpoint was saved. Load an earlier checkpoint "
            "(latest_checkpoint(root) skips damaged ones).")


def check_checkpoint(path: str | os.PathLike, checksums: bool = True) -> dict:
    """Return the metadata of the checkpoint at ``path`` if it is complete; otherwise raise a
    :class:`CheckpointError` that names what is wrong. Complete: meta.pt exists, is readable, and
    every rank file it lists exists with the recorded size (and sha256, with ``checksums``).
    Not collective: any process may call it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: no such directory")
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise CheckpointError(
            f"checkpoint at {path} is incomplete: {META} is missing. It was probably interrupted "
            f"while saving ({META} is written last, once every rank's file is in place). Load the "
            "previous one: latest_checkpoint(root) returns the newest complete checkpoint.")
    meta = _read(meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_file} has format version {found!r}; this minishard reads "
                              f"version {FORMAT_VERSION}")
    world = meta["world_size"]
    names = [f["name"] for f in meta["files"]]
    expected = [shard_file_name(r, world) for r in range(world)]
    if names != expected:
        raise CheckpointError(
            f"checkpoint at {path} is inconsistent: {META} says world size {world}, so it should "
            f"list the files {expected}, but it lists {names}. Its metadata does not describe its "
            "files; load an earlier checkpoint.")
    for flat in meta["flats"]:
        ranges = [tuple(r) for r in flat["ranges"]]
        if ranges != [saved_range(flat["numel"], world, r) for r in range(world)]:
            raise CheckpointError(
                f"checkpoint at {path} is inconsistent: {META} says world size {world}, but flat "
                f"{flat['name']!r} was cut into the ranges {ranges}. Load an earlier checkpoint.")
    for info in meta["files"]:
        file = os.path.join(path, info["name"])
        if not os.path.exists(file):
            raise CheckpointError(f"checkpoint at {path} is incomplete: {info['name']} is missing. "
                                  "Load the previous one (latest_checkpoint(root)).")
        if os.path.getsize(file) != info["bytes"]:
            raise CheckpointError(_size_problem(file, os.path.getsize(file), info["bytes"]))
        if checksums:
            with open(file, "rb") as fh:
                if hashlib.sha256(fh.read()).hexdigest() != info["sha256"]:
                    raise CheckpointError(f"{file} does not match the sha256 recorded in {META}: "
                                          "it was corrupted after saving. Load an earlier one.")
    return meta


def _natural_key(name: str) -> list:
    # re.split with a group puts the digit runs at the odd positions: ints compare with ints.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def latest_checkpoint(root: str | os.PathLike, checksums: bool = False) -> str | None:
    """The newest COMPLETE checkpoint directory under ``root`` (by name, numbers compared as
    numbers: ``step-10`` after ``step-9``), or None. Incomplete or damaged ones are skipped:
    sizes are checked always, sha256 only with ``checksums`` (it reads every byte).
    Not collective."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    names = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
    for name in sorted(names, key=_natural_key, reverse=True):
        try:
            check_checkpoint(os.path.join(root, name), checksums=checksums)
            return os.path.join(root, name)
        except CheckpointError:
            continue
    return None


# ------------------------------------------------------------------------------------- save
def save_checkpoint(path: str | os.PathLike, model, optimizer=None, *,
                    overwrite: bool = False) -> None:
    """Save ``model`` (a ``minishard.ZeRO``) and its ``optimizer`` into the directory ``path``.

    Collective. Every rank writes its own file; then they tell rank 0 the size and sha256 of
    what they wrote (an all-gather, which is also the barrier: it cannot finish before every
    file is in place); then rank 0 writes meta.pt; a last all-reduce makes every rank return
    only once the checkpoint is complete. ``path`` must not hold a checkpoint already, unless
    ``overwrite`` (its meta.pt is then removed first: until the new one lands, the directory is
    incomplete -- that is why a fresh directory per step is safer).

    Hybrid sharding (a 2-D mesh): the replicas hold identical shards, so only the first one
    (replicate rank 0) writes, one file per rank of its shard group; the others wait for it
    and raise if it failed. The files are those of S ranks: load them at any world size.
    """
    replicas = getattr(model, "replicate_group", None)
    if replicas is None:
        return _save_shards(path, model, optimizer, overwrite)
    error = None
    if comm.group_rank(replicas) == 0:
        try:
            _save_shards(path, model, optimizer, overwrite)
        except Exception as exc:  # still join the all-reduce below, or the replicas would hang
            error = exc
    failed = torch.tensor([0.0 if error is None else 1.0])
    comm.all_reduce(failed, "max", replicas, tag="checkpoint: first replica done")
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError(f"the first replica could not save {path} (its error names the "
                              "problem); the checkpoint is incomplete")


def _save_shards(path, model, optimizer, overwrite: bool) -> None:
    """save_checkpoint on the ranks of ONE shard group (all of them, without replicas)."""
    path, group = os.fspath(path), model.group
    rank, world = comm.group_rank(group), comm.group_size(group)
    meta_file = os.path.join(path, META)
    if os.path.exists(meta_file) and not overwrite:
        raise FileExistsError(
            f"{path} already holds a checkpoint; save each step into a fresh directory "
            "(checkpoint_path(root, step)), or pass overwrite=True")
    os.makedirs(path, exist_ok=True)
    if overwrite:
        if rank == 0 and os.path.exists(meta_file):
            os.remove(meta_file)  # from here on the directory reads as incomplete
        comm.all_reduce(torch.zeros(1), "sum", group, tag="checkpoint: old meta removed")
    groups = _group_flat_names(model, optimizer) if optimizer is not None else None

    # 1. this rank's file: its range of every flat, master values and optimizer state.
    flats = {}
    for name, flat, _ in _flats(model):
        lo, hi = saved_range(flat.numel, world, rank)
        held_lo, _ = _held_range(flat)
        cut = slice(lo - held_lo, hi - held_lo)  # stage 0 holds everything; stages 1-3, [lo, hi)
        # .clone(): torch.save of a view would write its whole underlying storage
        entry = {"range": [lo, hi], "master": flat.shard.detach()[cut].clone()}
        state = optimizer.state.get(flat.shard) if optimizer is not None else None
        if state:
            per_element, scalars = _split_state(state, flat.shard)
            entry["state"] = {k: v.detach()[cut].clone() for k, v in per_element.items()}
            entry["scalars"] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                for k, v in scalars.items()}
        flats[name] = entry
    mine = {"format": FORMAT_VERSION, "rank": rank, "world_size": world, "flats": flats}
    error = None
    try:
        size, digest = _atomic_save(mine, os.path.join(path, shard_file_name(rank, world)))
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
    failed_meta = torch.zeros(1)
    if rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "world_size": world,
            "stage": model.stage,
            "files": [{"name": shard_file_name(r, world), "bytes": row[0],
                       "sha256": struct.pack("<4q", *row[1:]).hex()}
                      for r, row in enumerate(table)],
            "flats": [{"name": name, "numel": flat.numel,
                       "dtype": str(flat.dtype).replace("torch.", ""),
                       "shapes": [list(s) for s in flat.shapes], "fqns": fqns,
                       "ranges": [list(saved_range(flat.numel, world, r)) for r in range(world)]}
                      for name, flat, fqns in _flats(model)],
            # after wrapping, the module's state dict holds only its buffers (identical on all
            # ranks: ZeRO broadcast them at wrap time; the model's own code keeps them so)
            "buffers": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "optimizer": None if optimizer is None else {
                "class": type(optimizer).__name__,
                "param_groups": [{**_hyperparameters(g), "flats": names}
                                 for g, names in zip(optimizer.param_groups, groups)]},
        }
        try:
            _atomic_save(meta, meta_file)
        except Exception as exc:
            error, failed_meta[0] = exc, 1.0
    comm.all_reduce(failed_meta, "max", group, tag="checkpoint: meta written")
    if error is not None:
        raise error
    if failed_meta.item():
        raise CheckpointError(f"rank 0 could not write {meta_file}; {path} stays incomplete")


# ------------------------------------------------------------------------------------- load
def _check_same_model(path: str, meta: dict, model) -> None:
    """Refuse a checkpoint of another model, naming the first differences."""
    def shapes(flats):
        return {fqn: tuple(shape) for f in flats for shape, names in zip(f["shapes"], f["fqns"])
                for fqn in names}
    ours = [{"name": n, "numel": f.numel, "shapes": [list(s) for s in f.shapes], "fqns": q}
            for n, f, q in _flats(model)]
    saved, mine = shapes(meta["flats"]), shapes(ours)
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
    buffers = model.module.state_dict()
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
    layout = [(f["name"], f["numel"], f["fqns"]) for f in meta["flats"]]
    if layout != [(f["name"], f["numel"], f["fqns"]) for f in ours]:
        raise CheckpointError(
            f"checkpoint at {path} has the same parameters but grouped into other flat buffers "
            f"(checkpoint {[f['name'] for f in meta['flats']]}, model "
            f"{[f['name'] for f in ours]}): wrap the model with the same units= and parameter "
            "dtypes, or go through model.full_state_dict() / full_optimizer_state_dict().")


def _check_same_optimizer(path: str, meta: dict, model, optimizer) -> list[dict]:
    """The checkpoint's param groups, checked against ``optimizer``'s."""
    saved = meta["optimizer"]
    if saved is None:
        raise CheckpointError(f"checkpoint at {path} holds no optimizer state (it was saved "
                              "without an optimizer); call load_checkpoint(path, model)")
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint at {path} holds {saved['class']} state, but the "
                              f"optimizer is a {type(optimizer).__name__}")
    groups = _group_flat_names(model, optimizer)
    saved_groups = [g["flats"] for g in saved["param_groups"]]
    if groups != saved_groups:
        raise CheckpointError(f"checkpoint at {path}: the optimizer's param groups hold the flats "
                              f"{groups}, the saved ones held {saved_groups}; build the optimizer "
                              "with the same param groups")
    return saved["param_groups"]


def load_checkpoint(path: str | os.PathLike, model, optimizer=None) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (a ``minishard.ZeRO``) and ``optimizer``
    (built over ``model.parameters()``, as for training). Returns the checkpoint's metadata.

    Collective. The world size and the stage may differ from the saving run's: each rank works
    out which unpadded range of each flat its shard holds now, opens only the old ranks' files
    that overlap it, and concatenates the overlapping pieces of the master values and of the
    optimizer state (see the module docstring). Every check happens before anything changes: if
    any rank cannot load, all ranks raise and the model and optimizer are left as they were.
    """
    path, group = os.fspath(path), model.group
    error = None
    try:
        meta = check_checkpoint(path, checksums=False)  # sha256 is checked as each file is read
        _check_same_model(path, meta, model)
        saved_groups = (_check_same_optimizer(path, meta, model, optimizer)
                        if optimizer is not None else None)
        reader = _ShardFiles(path, meta)
        masters, states = [], {}
        for name, flat, _ in _flats(model):
            values, state = _assemble(name, flat, meta, reader)
            masters.append((flat, values))
            if state is not None:
                states[id(flat.shard)] = state
        optim_sd = _torch_format(optimizer, saved_groups, states) if optimizer else None
    except Exception as exc:  # still join the all-reduce below, or the other ranks would hang
        error = exc
    failed = torch.tensor([0.0 if error is None else 1.0])
    comm.all_reduce(failed, "max", group, tag="checkpoint: files read")
    if getattr(model, "replicate_group", None) is not None:  # max over shards, then replicas
        comm.all_reduce(failed, "max", model.replicate_group, tag="checkpoint: files read")
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError(f"another rank could not load {path} (its error names the "
                              "problem); nothing was loaded")

    # Everything checked: now change the model. Writing the shard bumps its version, so the next
    # forward would re-gather the full parameters anyway (flat.py: is_stale).
    with torch.no_grad():
        for flat, values in masters:
            flat.shard.copy_(values.to(flat.dtype).reshape(flat.shard.shape))
    model.module.load_state_dict(meta["buffers"], strict=False)  # keys checked above
    if optimizer is not None:
        optimizer.load_state_dict(optim_sd)
    model._refresh_after_load()  # stages 0-2 re-gather, one unit at a time; stage 3 when it runs
    return meta


class _ShardFiles:
    """The old ranks' files, each read (and checked against meta.pt) when first needed."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta, self.loaded = path, meta, {}

    def __getitem__(self, r: int) -> dict:
        if r not in self.loaded:
            info, world = self.meta["files"][r], self.meta["world_size"]
            content = _read(os.path.join(self.path, info["name"]), expect=info)
            if (content.get("rank"), content.get("world_size")) != (r, world):
                raise CheckpointError(
                    f"{info['name']} in {self.path} says it is rank {content.get('rank')} of "
                    f"{content.get('world_size')}; {META} expects rank {r} of {world}. The "
                    "checkpoint is inconsistent; load an earlier one.")
            self.loaded[r] = content
        return self.loaded[r]


def _assemble(name: str, flat, meta: dict, files: _ShardFiles):
    """This rank's range [lo, hi) of one flat, cut out of the old ranks' files that overlap it:
    (master values, optimizer state of the shard or None)."""
    lo, hi = _held_range(flat)
    ranges = next(f["ranges"] for f in meta["flats"] if f["name"] == name)
    sources = [r for r, (a, b) in enumerate(ranges) if a < hi and lo < b]
    # An empty shard (more ranks than elements) has no range to read but still needs the scalar
    # state (Adam's step): take it from old rank 0, cutting an empty piece.
    sources = sources or [0]
    pieces, state_pieces, scalars, with_state = [], {}, {}, []
    for r in sources:
        a, b = ranges[r]
        cut = slice(max(lo, a) - a, min(hi, b) - a)  # [lo, hi) ∩ [a, b), relative to a
        entry = files[r]["flats"][name]
        pieces.append(entry["master"][cut])
        if "state" in entry:
            with_state.append(r)
            scalars = entry["scalars"]
            for key, t in entry["state"].items():
                state_pieces.setdefault(key, []).append(t[cut])
    values = torch.cat(pieces)
    if values.numel() != hi - lo:
        raise CheckpointError(f"flat {name!r}: assembled {values.numel()} elements for [{lo}, "
                              f"{hi}) from {files.path}; the checkpoint is inconsistent")
    if not with_state:
        return values, None
    if with_state != sources:
        raise CheckpointError(f"flat {name!r}: old ranks {sources} hold this rank's range, but "
                              f"only {with_state} saved optimizer state; the checkpoint is "
                              "inconsistent")
    return values, {**scalars, **{k: torch.cat(v) for k, v in state_pieces.items()}}


def _torch_format(optimizer, saved_groups: list[dict], states: dict) -> dict:
    """A state dict in torch's own format for ``optimizer``: parameters numbered 0, 1, ... in
    param_groups order, the saved hyperparameters, the assembled state of each shard."""
    out, index = {"state": {}, "param_groups": []}, 0
    for group, saved in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in group["params"]:
            if id(p) in states:
                out["state"][index] = states[id(p)]
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in saved.items() if k != "flats"}
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
        for flat, places in zip(unit.flats, unit.bindings):
            for j, bindings in enumerate(places):
                for b in bindings:
                    by_alias[b.fqn] = (bindings[0].fqn, flat.name, j)
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
    groups = _group_flat_names(model, optimizer)
    full = {}  # flat name -> (per-element state, full length; scalars). Same order on all ranks.
    for name, flat, _ in _flats(model):
        state = optimizer.state.get(flat.shard)
        if state:
            per_element, scalars = _split_state(state, flat.shard)
            full[name] = ({k: flat.gather_shards(v, "optimizer state") for k, v in per_element.items()}, scalars)
    flat_of = {name: flat for name, flat, _ in _flats(model)}
    out, index = {"state": {}, "param_groups": []}, 0
    for group, names in zip(optimizer.param_groups, groups):
        ids = []
        for fqn, name, j in (s for s in slots if s[1] in names):
            if name in full:
                flat = flat_of[name]
                per_element, scalars = full[name]
                start, shape = sum(flat.numels[:j]), flat.shapes[j]
                out["state"][index] = {
                    **{k: v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in scalars.items()},
                    **{k: v[start:start + flat.numels[j]].view(shape).clone()
                       for k, v in per_element.items()}}
            ids.append(index)
            index += 1
        out["param_groups"].append({**_hyperparameters(group), "params": ids})
    return out


def load_full_optimizer_state_dict(model, optimizer, state_dict: dict,
                                   param_names: list[str] | None = None) -> None:
    """The inverse of :func:`full_optimizer_state_dict`: load a plain optimizer's state dict
    (numbered as described there) into the sharded ``optimizer``; each rank keeps its slice.
    Load the parameters with ``model.load_full_state_dict`` too. Not collective.

    The parameters of one flat buffer share one shard, so their scalar state (``step``) must be
    equal; per-element state is the parameter-shaped tensors (any key but ``step``)."""
    slots = _original_slots(model, param_names)
    groups = _group_flat_names(model, optimizer)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer "
                         f"{len(groups)}")
    flat_of = {name: flat for name, flat, _ in _flats(model)}
    sharded, index = {"state": {}, "param_groups": []}, 0
    for names, saved in zip(groups, saved_groups):
        mine = [s for s in slots if s[1] in names]
        if len(saved["params"]) != len(mine):
            raise ValueError(f"a param group of state_dict has {len(saved['params'])} parameters; "
                             f"the model's flats {names} hold {len(mine)}")
        per_param = {name: [None] * len(flat_of[name].numels) for name in names}
        for (fqn, name, j), i in zip(mine, saved["params"]):
            per_param[name][j] = state_dict["state"].get(i)
        ids = []
        for name in names:
            flat, states = flat_of[name], per_param[name]
            if any(s for s in states):
                if not all(s for s in states) or len({frozenset(s) for s in states}) != 1:
                    raise ValueError(f"the parameters of flat {name!r} must all have state with "
                                     "the same keys (they share one shard)")
                lo, hi = _held_range(flat)
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
                sharded["state"][index] = shard_state
            ids.append(index)
            index += 1
        sharded["param_groups"].append({**_hyperparameters(saved), "params": ids})
    optimizer.load_state_dict(sharded)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
