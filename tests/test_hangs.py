"""A collective that never completes ends the job in minishard's words, within MINISHARD_TIMEOUT.

Each case runs in a fresh pool of ranks (a collective left pending would pair with the next
test's), with the timeout lowered to 3 s; the oracle is the clock and the message: a rank that
waited raises CollectiveError naming the collective it waited in, well before the pool's own
timeout. (Known gap: a mismatch gloo itself detects aborts that rank's process.)
"""
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.testing import RankPool

LIMIT = 3.0


def one_rank_saves(ckpt: str) -> dict:
    """The per-rank save decision: rank 0 decides to save (its own eval loss was best), the
    others train on; save_checkpoint is collective."""
    comm.set_timeout(LIMIT)
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stage=3,
                           units={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            minishard.save_checkpoint(ckpt, model, opt)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step(), opt.zero_grad()
    except comm.CollectiveError as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    except comm.CollectiveMismatch as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


def only_rank0_reduces() -> dict:
    comm.set_timeout(LIMIT)
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            comm.all_reduce(torch.ones(4), tag="the lonely sum")
    except comm.CollectiveError as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


def test_a_collective_no_other_rank_calls_raises_after_the_timeout():
    with RankPool(2, timeout=60) as pool:
        outs = pool.run(only_rank0_reduces)
    assert outs[1]["error"] is None
    error, after = outs[0]["error"], outs[0]["after"]
    assert error and "rank 0, all_reduce of the lonely sum" in error, outs
    assert "MINISHARD_TIMEOUT" in error and LIMIT <= after < LIMIT + 30, outs


@pytest.mark.parametrize("world", [2])
def test_a_save_on_one_rank_ends_the_job(tmp_path, world):
    """The per-rank save decision. The save's first collective (8 bytes) meets the others'
    training gather (more): gloo aborts the saving rank's process from its own thread ("Received
    data size doesn't match expected size"), which no Python code can catch; every other rank
    raises CollectiveError within the timeout. Either way no rank is left waiting: the pool's
    own timeout (90 s) is never what ends it."""
    start = time.monotonic()
    with RankPool(world, timeout=90) as pool:
        try:
            outs = pool.run(one_rank_saves, str(tmp_path / "ckpt"))
        except TimeoutError as exc:
            assert "rank processes died" in str(exc), exc  # aborted by gloo, not left waiting
        else:
            for rank, out in enumerate(outs):
                assert out["error"] and "minishard" in out["error"], (rank, out)
    assert time.monotonic() - start < LIMIT + 30
