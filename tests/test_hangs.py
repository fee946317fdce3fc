"""A broken loop ends the job in minishard's words, within MINISHARD_TIMEOUT; its record is bounded.

Each case runs in a fresh pool of ranks (a collective left pending would pair with the next
test's), with the timeout lowered to 3 s; the oracle is the clock and the message: a rank that
waited raises CollectiveError naming the collective it waited in, well before the pool's own
timeout. The six known causes of a hang, each injected into a training loop at stages 0-3 and
2-4 ranks, the job ending within the timeout plus 30 s and the doctor's first line naming the
cause and the line: tutorials/15_when_it_hangs.py, which asserts them (run by test_tutorials).
"""
import time
import tracemalloc

import torch
import torch.distributed as dist

from minishard import comm, costs
from minishard.testing import RankPool

LIMIT = 3.0


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




def test_the_flight_record_is_bounded():
    """The ring keeps the last ``size`` collectives, numbered on: filling it twice over costs no
    more than filling it once, at most 400 bytes an entry (README states 1024 entries, 400 KiB)."""
    flight = costs.Flight(1024)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(1024):
            flight.issued("all_gather", 100 + i, torch.float32, None, f"unit {i % 7}+{i}")
        once = tracemalloc.get_traced_memory()[0] - base
        for i in range(3 * 1024):
            flight.issued("reduce_scatter", 100 + i, torch.float32, None, f"unit {i % 7}+{i}")
        thrice = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(flight.ring) == 1024 and flight.seq == 4 * 1024 and flight.ring[0].seq == 3 * 1024 + 1
    assert [f.nth for f in flight.ring][-2:] == [4 * 1024 - 1, 4 * 1024]
    assert once <= 400 * 1024 and thrice <= once * 1.1, (once, thrice)
    assert flight.ring[-1].site[0] == __file__  # the user's line: this test, not minishard
