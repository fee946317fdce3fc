"""A broken loop ends the job in minishard's words, and the doctor says why; the record is bounded.

Each broken job runs in a fresh pool of ranks (a collective left pending would pair with the
next test's), with MINISHARD_TIMEOUT lowered to 3 s. Oracles: the clock (the job ends within the
timeout plus 30 s, never by the pool's own timeout), the message (a rank that waited raises
CollectiveError naming the collective), and for the six known causes of a hang (injected by
tutorials/15_when_it_hangs.py into a training loop, which asserts each once), a drawn cause,
stage 0-3 and 2-4 ranks: the doctor's first line names the cause and the line. The record holds
the collectives DTensor runs for torch's tools too, and stays within its stated memory.
"""
import importlib
import inspect
import sys
import time
import tracemalloc
from pathlib import Path

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import minishard
from minishard import comm, costs
from minishard.testing import RankPool

LIMIT = 3.0
TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"


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
    assert len(flight.ring) == 1024 and flight.seq == 4 * 1024
    assert flight.ring[0].seq == 3 * 1024 + 1
    assert [f.nth for f in flight.ring][-2:] == [4 * 1024 - 1, 4 * 1024]
    assert once <= 400 * 1024 and thrice <= once * 1.1, (once, thrice)
    assert flight.ring[-1].site[0] == __file__  # the user's line: this test, not minishard


# Where each cause of tutorials/15 ends a job (the oracle: the lesson's control and its sweep):
# a forward on some ranks only costs nothing at stage 0, whose forward issues no collective.
sys.path.insert(0, str(TUTORIALS))  # the lesson's ranks import it by this name too
LESSON = importlib.import_module("15_when_it_hangs")
FAILING = [(cause, stage) for cause in LESSON.CASES for stage in range(4)
           if (cause, stage) != ("eval", 0)]


@settings(max_examples=2 if settings.default.max_examples <= 25 else 24, deadline=None)
@given(case=st.sampled_from(FAILING), world=st.integers(2, 4))
def test_the_doctor_names_a_drawn_cause(tmp_path_factory, case, world):
    """Lesson 15 shows each cause once; here a drawn (cause, stage, world): the job ends within
    the timeout plus 30 s, and the doctor's first line names the cause and the line."""
    cause, stage = case
    _, _, named, marker = LESSON.CASES[cause]
    report = LESSON.run(cause, stage, world, str(tmp_path_factory.mktemp(cause)))
    assert report[0].startswith(named + ":") and LESSON.line_of(marker) in report[0], report


def torch_clip_is_recorded() -> list:
    """One stage-3 step clipped by torch's own clip_grad_norm_ on the DTensor parameters: what
    the flight record holds of it, from the last gather on."""
    model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stage=3,
                           units={nn.Linear})
    model(torch.randn(2, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # CLIP
    return [(f.op, f.tag, f.event[0], f.site) for f in list(comm.FLIGHT.ring)[-4:]]


def test_dtensor_collectives_for_torch_tools_are_recorded(pools):
    """torch runs clip_grad_norm_'s all-reduce itself (DTensor); the record holds it, with the
    user's line, after the engine's own reductions."""
    for rank_rows in pools(2).run(torch_clip_is_recorded):
        op, tag, phase, site = rank_rows[-1]
        assert (op, tag, phase) == ("all_reduce", "torch all_reduce", "after backward"), rank_rows
        source, first = inspect.getsourcelines(torch_clip_is_recorded)
        line = first + next(i for i, s in enumerate(source) if s.rstrip().endswith("# CLIP"))
        assert site == (__file__, line), (site, line)
        assert any(row[0] == "reduce_scatter" for row in rank_rows), rank_rows
