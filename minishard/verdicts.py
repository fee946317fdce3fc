"""Verdicts: every rank raises together, or none does.

A rank that raises on its own leaves the others waiting in their next collective until a timeout.
So where a step can fail on some ranks only (an initialiser on rank 0, a file one rank cannot
write), the ranks first agree on the outcome, with a collective that every rank joins whatever
happened to it, and only then raise:

* :func:`rank0_verdict`: rank 0 decides (it alone looked); every rank raises rank 0's message.
* :func:`raise_together`: each rank may have failed; one all-reduce(MAX) of a failed flag, then
  a failed rank raises its own error and the others ``others_failed``.
* :func:`ranks_range`: does every rank hold the same numbers (a configuration, a fingerprint)?
* :func:`all_gather_object`: every rank's picklable object, on every rank (a verdict's inputs);
  :func:`check_member`: a clear error before a collective on a group without this rank.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from minishard import comm

__all__ = ["rank0_verdict", "raise_together", "ranks_range", "all_gather_object", "check_member"]


def ranks_range(values: torch.Tensor, group, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise minimum and maximum of ``values`` over the ranks, in ONE all-reduce (MAX
    of x and of -x): equal exactly where every rank holds the same. Every rank gets the same
    answer, so a check on it raises on all of them together."""
    both = torch.cat([values, -values])
    comm.all_reduce(both, "max", group, tag=tag)
    return -both[len(values):], both[:len(values)]


def rank0_verdict(error: str | None, group, device=None, tag: str = "verdict") -> str | None:
    """Rank 0's decision, on every rank: None (go on) or the error every rank must raise. Two
    broadcasts (the message's length, then its text if any), so every rank raises the same
    error at the same point, before any later collective could hang."""
    data = (error or "").encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.broadcast(length, 0, group, tag=f"{tag} (verdict)")
    if length.item() == 0:
        return None
    text = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            if comm.group_rank(group) == 0 else
            torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    comm.broadcast(text, 0, group, tag=f"{tag} (verdict text)")
    return bytes(text.cpu().tolist()).decode(errors="replace")


def raise_together(error: BaseException | None, groups: list, tag: str,
                   others_failed: BaseException) -> None:
    """Join one all-reduce(MAX) of "this rank failed" on each of ``groups`` (in order), then
    raise ``error`` on a rank that failed and ``others_failed`` on a rank that did not while
    another did. Returns on every rank only when no rank failed."""
    failed = torch.tensor([0.0 if error is None else 1.0])
    for group in groups:
        comm.all_reduce(failed, "max", group, tag=tag)
    if error is not None:
        raise error
    if failed.item():
        raise others_failed


@torch.no_grad()
def all_gather_object(obj, group=None, tag: str = "", device=None) -> list:
    """Every rank's picklable ``obj``, in group rank order, on every rank: two ledger-counted
    all-gathers, of the pickles' lengths and of the pickles padded to the longest."""
    n, data = comm.group_size(group), torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    comm.all_gather(sizes, torch.tensor([data.numel()], device=device), group, tag=f"{tag} (sizes)")
    sizes = sizes.tolist()
    longest = max(sizes)
    send = torch.zeros(longest, dtype=torch.uint8, device=device)
    send[:data.numel()] = data
    out = torch.empty(n * longest, dtype=torch.uint8, device=device)
    comm.all_gather(out, send, group, tag=tag)
    rows = out.cpu().view(n, longest)
    return [pickle.loads(rows[j, :k].numpy().tobytes()) for j, k in enumerate(sizes)]


def check_member(group, who: str) -> None:
    """Raise a clear error if this rank is not in ``group`` (a collective there would never return)."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment for it).")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"{who}: this rank (global rank {dist.get_rank()}) is not a member of the process group "
            "it was given. Pass a group that contains this rank, or do not call it on this rank.")
