"""A broken loop ends the job in minishard's words, and the doctor names why and where.

Each case runs in a fresh pool of ranks (a collective left pending would pair with the next
test's), with MINISHARD_TIMEOUT lowered to 3 s. Oracles: the clock (no rank is left waiting:
the job ends within the timeout plus 30 s, never by the pool's own timeout), the message (a rank
that waited raises CollectiveError naming the collective), and, for each known cause injected
into one small training loop (stages 0-3, 2-4 ranks), the first line of
``python -m minishard.doctor`` on the ranks' flight records: the cause's name from
``doctor.CAUSES`` and the line of THIS file the cause was injected at (or, where the cause
issues no collective itself, the line whose collective the ranks disagreed on). A mismatch gloo
detects itself aborts that rank's process (no Python runs): its faulthandler file stands in.
"""
import inspect
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.observe import doctor
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




def broken_loop(cause: str, stage: int, flight_dir: str) -> dict:
    """Three training steps of a small model, with ``cause`` injected at step 1 on one rank."""
    os.environ["MINISHARD_FLIGHT_DIR"] = flight_dir
    comm.set_timeout(LIMIT)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
                           stage=stage, units={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(2 if cause == "uneven" and rank == 1 else 3):
            if step == 1 and cause == "eval" and rank == 0:
                with torch.no_grad():
                    model(torch.randn(2, 8))  # CAUSE eval
            if step == 1 and cause == "save" and rank == 0:
                minishard.save_checkpoint(f"{flight_dir}/ckpt", model, opt)  # CAUSE save
            if step == 1 and cause == "frozen" and rank == 1:
                model.module[2].requires_grad_(False)
            if step == 1 and cause == "died" and rank == 1:
                os._exit(3)
            with model.no_sync() if cause == "no_sync" and rank == 0 and step == 0 \
                    else torch.enable_grad():
                model(torch.randn(2, 8)).sum().backward()  # TRAIN
            opt.step()
            opt.zero_grad()
    except (comm.CollectiveError, comm.CollectiveMismatch) as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    minishard.dump_flight_record(why="exit")  # what leaving the script does (atexit)
    return {"error": None, "after": time.monotonic() - start}


def _line(marker: str) -> str:
    source, first = inspect.getsourcelines(broken_loop)
    return f"test_hangs.py:{first + next(i for i, s in enumerate(source) if s.rstrip().endswith(marker))}"


# cause -> (stage, world, the doctor's cause, the line it names): stages 0-3, worlds 2-4.
CASES = {
    "eval": (3, 3, "a forward on some ranks only", "# CAUSE eval"),
    "uneven": (2, 2, "uneven inputs without Join", "# TRAIN"),
    "save": (3, 2, "a save or full_state_dict on some ranks only", "# CAUSE save"),
    "no_sync": (0, 2, "no_sync on some ranks only", "# TRAIN"),
    "frozen": (2, 3, "a parameter frozen on some ranks only", "# TRAIN"),
    "died": (1, 4, "a rank died", "# TRAIN"),
}


@pytest.mark.parametrize("cause", list(CASES))
def test_the_doctor_names_each_known_cause(tmp_path, cause):
    stage, world, named, marker = CASES[cause]
    start = time.monotonic()
    with RankPool(world, timeout=60) as pool:
        try:
            outs = pool.run(broken_loop, cause, stage, str(tmp_path))
        except TimeoutError as exc:  # a rank gone (os._exit, or aborted by gloo), not waiting
            assert "rank processes died" in str(exc), exc
        else:
            assert any(out["error"] for out in outs), outs  # the job did fail...
            for out in outs:  # ...in minishard's words, on every rank that raised
                assert out["error"] is None or "minishard" in out["error"], out
    assert time.monotonic() - start < LIMIT + 30
    report = subprocess.run([sys.executable, "-m", "minishard.doctor", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    first = report.stdout.splitlines()[0]
    assert first.startswith(named + ":") and _line(marker) in first, report.stdout
    assert named in doctor.CAUSES and f"fix: {doctor.CAUSES[named]}" in report.stdout


def test_the_doctor_finds_no_divergence_in_a_healthy_run(tmp_path):
    """The control: the same loop with no cause on every rank; the records agree."""
    with RankPool(2, timeout=60) as pool:
        outs = pool.run(broken_loop, "none", 3, str(tmp_path))
    assert all(out["error"] is None for out in outs), outs
    assert doctor.diagnose(tmp_path)[0].startswith("no divergence"), doctor.diagnose(tmp_path)


def test_the_flight_record_is_bounded():
    """The ring keeps the last ``size`` collectives, numbered on: filling it twice over costs no
    more than filling it once, at most 400 bytes an entry (README states 1024 entries, 400 KiB)."""
    import tracemalloc
    from minishard import costs
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
