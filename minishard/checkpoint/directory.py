"""One checkpoint directory's life around a save (state.py writes what goes in it): room made
(an overwrite beside the checkpoint it replaces), the training loop's own state (``extra=``)
written before the checkpoint's marker and read back, the new checkpoint swapped in.

Collective: every function here is called on every rank; rank 0 alone touches the directory,
then every rank returns, or raises, together (verdicts.py).
"""
from __future__ import annotations

import os
import shutil

from minishard import comm
from minishard.checkpoint import files as checkpoint_files
from minishard.checkpoint.files import (DCP_METADATA, EXTRA, META, PREVIOUS, SAVING,
                                        CheckpointError, atomic_save)
from minishard.verdicts import all_gather_object, raise_together

__all__ = ["make_room", "swap_in", "gather_extras", "write_extras", "read_extras"]


# [Note: overwrite] Replacing a checkpoint never leaves none: the new one is written into
# ``path.saving``; once complete, rank 0 renames ``path`` -> ``path.previous`` and ``path.saving``
# -> ``path``, moves back what no save wrote (files.own_file: the user's ckpt.pt, notes), then
# deletes ``path.previous``. At every moment one complete checkpoint is where files.committed
# looks (path, else path.saving, else path.previous): a crash leaves the previous or the new one
# loadable, never a mix, never none; the next save finishes what it left, the user's files first.
def make_room(path: str, group, overwrite: bool) -> str:
    """Where to write: ``path`` when it holds no checkpoint of either format; with
    ``overwrite``, ``path.saving`` beside the one it holds; else refused. Rank 0 first finishes
    a swap a crash interrupted and removes what a crashed save left beside ``path``."""
    def holds() -> bool:
        return any(os.path.exists(os.path.join(path, m)) for m in (META, DCP_METADATA))

    def tidy() -> None:
        found = checkpoint_files.committed(path)
        if not os.path.exists(path) and found != path:  # crashed between swap_in's renames
            os.rename(found, path)
        checkpoint_files.move_users_files(path + PREVIOUS, path)
        for leftover in (path + SAVING, path + PREVIOUS) if holds() and overwrite else ():
            if os.path.exists(leftover):
                shutil.rmtree(leftover)
    _on_rank0(tidy, group, f"rank 0 could not tidy {path} before saving", "room made")
    if holds() and not overwrite:
        raise FileExistsError(
            f"{path} already holds a checkpoint; save each step into a fresh directory "
            "(checkpoint_path(root, step)), or pass overwrite=True")
    into = path + SAVING if holds() else path
    os.makedirs(into, exist_ok=True)
    return into


def swap_in(into: str, path: str, group) -> None:
    """The complete checkpoint in ``into`` becomes ``path`` ([Note: overwrite])."""
    def swap() -> None:
        os.rename(path, path + PREVIOUS)  # a crash here: files.committed finds path.saving
        os.rename(into, path)
        checkpoint_files.move_users_files(path + PREVIOUS, path)
        shutil.rmtree(path + PREVIOUS)
    _on_rank0(swap, group, f"rank 0 could not swap the new checkpoint into {path} (what is "
              "there loads: load_checkpoint finds the complete one)", "swapped in")


def _on_rank0(work, group, failed: str, done: str) -> None:
    """``work()`` on rank 0 (the directory's moves), then every rank returns or raises together."""
    error = None
    if comm.group_rank(group) == 0:
        try:
            work()
        except OSError as exc:  # still join the verdict, or the others would wait in vain
            error = exc
    raise_together(error, [group], f"checkpoint: {done}", CheckpointError(failed))


def gather_extras(extra, every) -> list:
    """Every rank's ``extra`` (None where none was given), on every rank: each rank sends its
    own, or why it cannot be saved and read back, so all of them raise together."""
    try:
        checkpoint_files.check_loadable(extra, "save_checkpoint(extra=...)")
        mine = (extra, None)
    except CheckpointError as exc:
        mine = (None, str(exc))
    sent = all_gather_object(mine, every, tag="checkpoint: extra")
    if mine[1] is not None:
        raise CheckpointError(mine[1])
    if any(error is not None for _, error in sent):
        raise CheckpointError("another rank's save_checkpoint(extra=...) cannot be saved (its "
                              "error says why); nothing was written")
    return [value for value, _ in sent]


def write_extras(path: str, extras: list, group) -> dict | None:
    """Rank 0 writes extra.pt (every rank's ``extra``, by rank) BEFORE the checkpoint's marker,
    so a complete checkpoint holds it; without any, it removes one an interrupted save left
    here. Returns extra.pt's record for meta.pt (on rank 0)."""
    error = record = None
    if comm.group_rank(group) == 0:
        file = os.path.join(path, EXTRA)
        try:
            if any(e is not None for e in extras):
                size, digest = atomic_save({"ranks": extras}, file)
                record = {"name": EXTRA, "bytes": size, "sha256": digest.hex()}
            elif os.path.exists(file):
                os.remove(file)
        except Exception as exc:  # still join the verdict, or the other ranks would hang
            error = exc
    raise_together(error, [group], "checkpoint: extra written", CheckpointError(
        f"rank 0 could not write {EXTRA} into {path}"))
    return record


def read_extras(path: str, record: dict | None, every, together: bool) -> dict:
    """``{"extra": this rank's (its rank in ``every``), "extras": every saving rank's}`` from
    extra.pt, checked against meta.pt's ``record`` if given. ``together``: the ranks of
    ``every`` raise together when one cannot read it (else the caller does that)."""
    error, extras = None, None
    file = os.path.join(path, EXTRA)
    try:
        if record is not None or (together and os.path.exists(file)):
            extras = checkpoint_files.read_checked(file, record)["ranks"]
    except Exception as exc:
        if not together:
            raise
        error = exc
    if together:
        raise_together(error, [every], "checkpoint: extra read", CheckpointError(
            f"another rank could not read {file} (its error names the problem); nothing was "
            "loaded"))
    rank = comm.group_rank(every)
    return {"extra": extras[rank] if extras and rank < len(extras) else None, "extras": extras}
