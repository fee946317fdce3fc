"""A checkpoint's files on disk: written atomically, read back checked, complete or not.

state.py decides WHAT goes into a checkpoint (each rank's rows of every parameter, then
``meta.pt``); this file knows the directory's layout and guarantees::

    a checkpoint directory is COMPLETE  iff  meta.pt exists and lists files whose sizes
    (and sha256) match.

Every file is written to a temporary name in the same directory, flushed to disk and
``os.replace``-d into place (:func:`atomic_save`), so a file is either absent or whole; every
file is read back with ``torch.load(..., weights_only=True)`` (:func:`read_checked`): loading a
checkpoint never runs code from it. Nothing here is collective.

A torch.distributed.checkpoint (DCP) directory (dcp.py) is recognised by its
``.metadata``, which DCP writes last and atomically: it is COMPLETE iff ``.metadata`` is
readable and every data file holds the bytes it records (:func:`check_dcp`). ``.metadata`` is a
pickle, read here through an allow-list (:class:`SafeDCPReader`) for the same promise.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader

from minishard.zero.flat import rows_of

__all__ = ["CheckpointError", "FORMAT_VERSION", "META", "checkpoint_path", "shard_file_name",
           "saved_rows", "saved_piece", "atomic_save", "read_checked", "check_checkpoint", "latest_checkpoint",
           "DCP_METADATA", "SafeDCPReader", "check_dcp", "DCP_DIGESTS", "file_sha256",
           "dcp_data_files", "check_dcp_digests", "dcp_extra_record", "EXTRA", "check_loadable",
           "own_file", "move_users_files", "path_first"]

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: written last, atomically, by DCP
DCP_DIGESTS = "minishard-sha256.pt"  # beside a DCP save: {data file: sha256}; DCP ignores it

# 1: slices of the flat buffers (before parameters kept their names); 2: rows of each parameter
FORMAT_VERSION = 2
META = "meta.pt"
EXTRA = "extra.pt"  # save_checkpoint(extra=...): every rank's own state, by rank
SAVING, PREVIOUS = ".saving", ".previous"  # beside a checkpoint being overwritten
# What a save writes into its directory (either format, and their temporary names); anything
# else there is the user's (nanoGPT's ckpt.pt, notes): an overwrite keeps it (state.py).
_OWN = re.compile(r"(meta\.pt|extra\.pt|rank\d+-of-\d+\.pt|minishard-sha256\.pt|"
                  r"(__\d+)?\.metadata|.*\.distcp)(\.tmp.*)?")


def own_file(name: str) -> bool:
    """Is ``name`` (in a checkpoint directory) a file a save writes? Not collective."""
    return _OWN.fullmatch(name) is not None


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, damaged, or does not fit the model it is loaded into."""


def checkpoint_path(root: str | os.PathLike, step: int) -> str:
    """``root/step-000042``: one fresh directory per step, so a crash never touches the last good
    one (names sort in step order; :func:`latest_checkpoint` relies on that)."""
    return os.path.join(os.fspath(root), f"step-{step:06d}")


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.pt"


def saved_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a parameter with ``n_rows`` rows (dim 0; a 0-dim one has 1) that
    ``rank`` of ``world_size`` saves: what it holds at stages 1-3 (flat.py; never padding)."""
    return rows_of(n_rows, world_size, rank)


def saved_piece(param, held: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The rows :func:`saved_rows` gives ``rank`` of one parameter (unit.py's Param), cut out
    of ``held``: what this rank holds of its values, or of optimizer state shaped like them
    (stage 0 holds every row; stages 1-3 exactly these). A (rows, row numel) view."""
    flat, j = param.flat, param.index
    lo, hi = saved_rows(flat.n_rows[j], world_size, rank)
    held_lo, held_hi = flat.row_ranges[j]
    return held.detach().reshape(held_hi - held_lo, flat.row_numels[j])[lo - held_lo:hi - held_lo]


def atomic_save(obj, final: str) -> tuple[int, bytes]:
    """``torch.save`` to a temporary name in the same directory, fsync, ``os.replace``: readers
    see the previous file or the whole new one, never half of it. Returns (byte size, sha256)."""
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


def read_checked(file: str, expect: dict | None = None):
    """``torch.load(weights_only=True)`` one file; with ``expect`` ({"bytes", "sha256"} from
    meta.pt), first check that it is the very file the checkpoint recorded."""
    with open(file, "rb") as fh:
        data = fh.read()
    if expect is not None:
        if len(data) != expect["bytes"]:
            raise CheckpointError(_size_problem(file, len(data), expect["bytes"]))
        if hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise CheckpointError(
                f"{file} does not match the sha256 its checkpoint recorded: it was corrupted or "
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


def check_loadable(obj, what: str) -> None:
    """Raise a CheckpointError unless ``obj`` survives ``torch.save`` and the
    ``torch.load(weights_only=True)`` every checkpoint file is read with."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{what} cannot be saved: {type(exc).__name__}: {str(exc).splitlines()[0]}. "
            "Checkpoints are read with torch.load(weights_only=True), which never runs code from "
            "a file: pass numbers, strings, tensors (torch.get_rng_state() is one; a numpy array: "
            "torch.from_numpy(a)) and lists, tuples or dicts of them (random.getstate() is "
            "one).") from exc


def _size_problem(file: str, size: int, recorded: int) -> str:
    return (f"{file} has {size} bytes but meta.pt recorded {recorded}: it is truncated or was "
            "overwritten after the checkpoint was saved. Load an earlier checkpoint "
            "(latest_checkpoint(root) skips damaged ones).")


def check_checkpoint(path: str | os.PathLike, checksums: bool = True) -> dict:
    """Return the metadata of the checkpoint at ``path`` if it is complete; otherwise raise a
    :class:`CheckpointError` that names what is wrong. Complete: meta.pt exists, is readable, and
    every file it lists (the ranks', and extra.pt if any) exists with the recorded size (and
    sha256, with ``checksums``).
    A torch.distributed.checkpoint directory (``.metadata``): complete when ``.metadata`` is
    readable and every data file holds the bytes it records; with ``checksums``, its files
    also match the sha256 digests minishard writes beside it (:func:`check_dcp_digests`).
    Returns ``{"format": "dcp", "sha256": whether digests were checked}``. Not collective."""
    path = os.fspath(path)
    if os.path.isfile(path):
        raise CheckpointError(
            f"{path} is a file, not a checkpoint directory: a file written by torch.save (a "
            "full state dict, nanoGPT's ckpt.pt) loads with torch.load and load_state_dict, into "
            "the plain model before wrapping or into the wrapped one (each rank keeps its rows)")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: no such directory")
    if os.path.isfile(os.path.join(path, DCP_METADATA)):  # torch.distributed.checkpoint's
        metadata = check_dcp(path)
        extra = dcp_extra_record(path)
        if extra is not None:
            _check_file(path, extra, checksums, DCP_DIGESTS)
        return {"format": "dcp", "sha256": checksums and check_dcp_digests(path, metadata)}
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise CheckpointError(
            f"checkpoint at {path} is incomplete: {META} is missing. It was probably interrupted "
            f"while saving ({META} is written last, once every rank's file is in place). Load the "
            "previous one: latest_checkpoint(root) returns the newest complete checkpoint.")
    meta = read_checked(meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        hint = (" (version 1 files cut flat buffers across parameters: load it with "
                "the minishard that wrote it, export model.full_state_dict() and "
                "full_optimizer_state_dict(), and load those here)") if found == 1 else ""
        raise CheckpointError(f"{meta_file} has format version {found!r}; this minishard reads "
                              f"version {FORMAT_VERSION}{hint}")
    world = meta["world_size"]
    names = [f["name"] for f in meta["files"]]
    expected = [shard_file_name(r, world) for r in range(world)]
    if names != expected:
        raise CheckpointError(
            f"checkpoint at {path} is inconsistent: {META} says world size {world}, so it should "
            f"list the files {expected}, but it lists {names}. Its metadata does not describe its "
            "files; load an earlier checkpoint.")
    for param in meta["params"]:
        rows = [tuple(r) for r in param["rows"]]
        if rows != [saved_rows(param["n_rows"], world, r) for r in range(world)]:
            raise CheckpointError(
                f"checkpoint at {path} is inconsistent: {META} says world size {world}, but "
                f"parameter {param['name']!r} was cut into the rows {rows}. Load an earlier "
                "checkpoint.")
    for info in meta["files"] + [e for e in [meta.get("extra_file")] if e]:
        _check_file(path, info, checksums, META)
    return meta


def _check_file(path: str, info: dict, checksums: bool, where: str) -> None:
    """The file ``info`` records ({"name", "bytes", "sha256"}) is there with its size (and its
    sha256, with ``checksums``), or a CheckpointError says what is wrong."""
    file = os.path.join(path, info["name"])
    if not os.path.exists(file):
        raise CheckpointError(f"checkpoint at {path} is incomplete: {info['name']} is missing. "
                              "Load the previous one (latest_checkpoint(root)).")
    if os.path.getsize(file) != info["bytes"]:
        raise CheckpointError(_size_problem(file, os.path.getsize(file), info["bytes"]))
    if checksums and file_sha256(file) != info["sha256"]:
        raise CheckpointError(f"{file} does not match the sha256 recorded in {where}: "
                              "it was corrupted after saving. Load an earlier one.")


def _natural_key(name: str) -> list:
    # re.split with a group puts the digit runs at the odd positions: ints compare with ints.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def committed(path: str) -> str:
    """The directory holding the checkpoint saved at ``path``: ``path`` if it exists (an
    overwrite never leaves it incomplete); else, after a crash between the renames of an
    overwrite (directory.py: [Note: overwrite]), the complete one of ``path.saving`` (the new) and
    ``path.previous``. Not collective."""
    if os.path.exists(path):
        return path
    for candidate in (path + SAVING, path + PREVIOUS):
        try:
            check_checkpoint(candidate, checksums=False)
            return candidate
        except CheckpointError:
            continue
    return path


def move_users_files(source: str, path: str) -> None:
    """Every entry of ``source`` that no save wrote goes back into ``path`` (one rename each),
    unless ``path`` holds that name already (directory.py: [Note: overwrite]). Not collective."""
    if not os.path.isdir(source) or not os.path.isdir(path):
        return
    for name in os.listdir(source):
        if not own_file(name) and not os.path.exists(os.path.join(path, name)):
            os.rename(os.path.join(source, name), os.path.join(path, name))


def path_first(verb: str, path, model) -> str:
    """``path`` normalised; the arguments in torch.save's order (the model first) refused with
    the order this function takes, before anything collective."""
    if isinstance(path, torch.nn.Module) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{verb}(path, model, optimizer): the directory comes first, then the "
                        f"model; got {type(path).__name__} and {type(model).__name__} (torch.save "
                        f"takes the object first; {verb} takes the path first)")
    return os.path.normpath(os.fspath(path))


def latest_checkpoint(root: str | os.PathLike, checksums: bool = False) -> str | None:
    """The newest COMPLETE checkpoint directory under ``root`` (by name, numbers compared as
    numbers: ``step-10`` after ``step-9``), or None. Incomplete or damaged ones are skipped:
    sizes are checked always, sha256 only with ``checksums`` (it reads every byte). An
    overwrite's ``X.saving`` and ``X.previous`` stand for ``X``: what :func:`committed` finds
    there (an overwrite interrupted after its renames leaves ``X`` the newer save and
    ``X.previous`` the one before).
    Not collective."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    names = {_without_suffix(d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))}
    for name in sorted(names, key=_natural_key, reverse=True):
        path = committed(os.path.join(root, name))
        try:
            check_checkpoint(path, checksums=checksums)
            return path
        except CheckpointError:
            continue
    return None


def _without_suffix(name: str) -> str:
    for suffix in (SAVING, PREVIOUS):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


# ------------------------------------------ torch.distributed.checkpoint's directories (DCP)
def check_dcp(path: str):
    """DCP's metadata of the checkpoint at ``path`` if it is complete: ``.metadata`` (written
    last, atomically, by DCP) is readable and every data file it names holds the bytes it
    records. Otherwise a :class:`CheckpointError` naming what is wrong. Not collective."""
    try:
        metadata = SafeDCPReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{os.path.join(path, DCP_METADATA)} could not be read "
                              f"({type(exc).__name__}: {exc}); load an earlier checkpoint") from exc
    needed = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file) or os.path.getsize(file) < size:
            raise CheckpointError(f"DCP checkpoint at {path} is damaged: {name} is missing or "
                                  f"shorter than the {size} bytes its {DCP_METADATA} records. Load an "
                                  "earlier checkpoint (latest_checkpoint(root) skips it).")
    return metadata


def file_sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dcp_data_files(metadata) -> list[str]:
    """The data files a DCP checkpoint's metadata names, sorted."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def check_dcp_digests(path: str, metadata, share: tuple[int, int] = (0, 1)) -> bool:
    """Check the data files of the DCP checkpoint at ``path`` against the sha256 digests
    minishard saves beside it (DCP records none, so a byte changed in place would load
    silently). ``share`` = (rank, ranks): this rank reads every ranks-th file from its rank on,
    so the ranks of a load divide the reading. Returns False when there is no digest file (a
    checkpoint written by FSDP2, torchtitan or torch itself: its sizes are checked, its bytes
    cannot be); raises a CheckpointError naming a file that does not match."""
    file = os.path.join(path, DCP_DIGESTS)
    if not os.path.exists(file):
        return False
    digests = {k: v for k, v in read_checked(file).items() if k != EXTRA}  # dcp_extra_record
    if sorted(digests) != dcp_data_files(metadata):
        raise CheckpointError(f"DCP checkpoint at {path}: {DCP_DIGESTS} lists other files than "
                              f"its {DCP_METADATA}: the two come from different saves. Load an "
                              "earlier checkpoint.")
    rank, ranks = share
    for name in sorted(digests)[rank::ranks]:
        if file_sha256(os.path.join(path, name)) != digests[name]:
            raise CheckpointError(f"DCP checkpoint at {path} is damaged: {name} does not match "
                                  f"the sha256 recorded in {DCP_DIGESTS} (corrupted or replaced "
                                  "after saving). Load an earlier checkpoint.")
    return True


def dcp_extra_record(path: str) -> dict | None:
    """extra.pt's record ({"name", "bytes", "sha256"}, as meta.pt keeps it) in the digests
    minishard writes beside a DCP checkpoint; None without digests or without extra.pt."""
    file = os.path.join(path, DCP_DIGESTS)
    return read_checked(file).get(EXTRA) if os.path.exists(file) else None


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


class SafeDCPReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read through the allow-list instead of plain pickle."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, DCP_METADATA), "rb") as fh:
            metadata = _Restricted(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
