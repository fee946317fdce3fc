"""A broken loop ends the job in minishard's words, and the doctor says only what the records show.

Every broken job is a real launch: tutorials/15_when_it_hangs.py's loop under torchrun, with
MINISHARD_TIMEOUT=3 s and MINISHARD_FLIGHT_DIR, as a user runs it (the lesson asserts each
cause once; the job must end by itself, from when its ranks are up, within the timeout plus
30 s). Oracles: the doctor's first line, its exit status, and the records themselves. Here: a
drawn cause, stage 0-3 and 2-4 ranks (where two causes leave the same records the doctor must
say "not sure" and name both: lesson 15's UNSURE); the cases users met that the lesson does not
show (a rank-0 evaluation at stage 2, SyncBatchNorms numbered apart by build order, a Join
epoch before a hang, a run that ended normally); two launches into one directory, the second
after a dry run; a ring that dropped its oldest entries; a job stopped from outside while its
ranks wait inside a collective; bad records and bad settings, each refused in one line. The
record holds the collectives DTensor runs for torch's tools, on the group comm uses, and stays
within its stated memory.
"""
import importlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import minishard
from minishard import checks, comm
from minishard.observe import doctor
from minishard.testing import RankPool

LIMIT = 3.0
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tutorials"))  # the lesson's module, by this name
LESSON = importlib.import_module("15_when_it_hangs")


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
    assert "MINISHARD_TIMEOUT" in error and LIMIT <= after, outs


def test_the_flight_record_is_bounded():
    """The ring keeps the last ``size`` collectives, numbered on: filling it twice over costs no
    more than filling it once, at most 400 bytes an entry (README states 1024 entries, 400 KiB)."""
    flight = checks.Flight(1024)
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


def said(report: list[str], cause: str, stage: int, markers) -> None:
    """The doctor's first line: the cause (or, where the lesson says two causes leave the
    same records, "not sure" naming both) and one of the lines it may name."""
    first = report[0]
    assert any(LESSON.line_of(m) in first for m in markers), report
    if (cause, stage) in LESSON.UNSURE:
        assert first.startswith("not sure: "), report
        assert all(c in first for c in LESSON.UNSURE[cause, stage]), report
    else:
        assert first.startswith(LESSON.CASES[cause][2] + ":"), report


# A forward or a torch tool's norm on some ranks only costs nothing at stage 0: no collective.
FAILING = [(cause, stage) for cause in LESSON.CASES for stage in range(4)
           if (cause, stage) not in (("eval", 0), ("norm", 0))]


@settings(max_examples=2 if settings.default.max_examples <= 25 else 24, deadline=None)
@given(case=st.sampled_from(FAILING), world=st.integers(2, 4))
def test_the_doctor_names_a_drawn_cause(tmp_path_factory, case, world):
    """Lesson 15 shows each cause once; here a drawn (cause, stage, world)."""
    cause, stage = case
    report = LESSON.run(cause, stage, world, str(tmp_path_factory.mktemp(cause)))
    said(report, cause, stage, LESSON.CASES[cause][3])


# Cases users met that the lesson does not show: (cause, stage, the first line's start, lines).
MET = {
    "eval": (2, "a forward on some ranks only:", ("# CAUSE eval",)),  # nanoGPT's, at stage 2
    # ...in nanoGPT's order: rank 0 evaluates before the first step, where every rank
    # accumulates a micro-batch under no_sync; no line yet that both ranks share
    "eval_first": (2, "a forward on some ranks only:", ("# CAUSE eval",)),
    "syncbn": (2, "ended normally: ", ()),  # rank 0 built one SyncBatchNorm more: #1 vs #0
    "syncbn_eval": (2, "a forward on some ranks only:", ("# CAUSE eval",)),
    "join": (3, "a forward on some ranks only:", ("# CAUSE eval",)),  # after a Join epoch
}


@pytest.mark.parametrize("cause", sorted(MET))
def test_the_cases_users_met(tmp_path, cause):
    stage, first, markers = MET[cause]
    report = LESSON.run(cause, stage, 2, str(tmp_path))
    assert report[0].startswith(first), report
    assert all(LESSON.line_of(m) in report[0] for m in markers), report


def test_two_launches_into_one_directory(tmp_path):
    """Plain torchrun names every run "none" and the port is the same: a 3-rank job, then a
    2-rank one whose ranks first ran a dry run of 4 (as plan --check does). The doctor reads
    the second, at 2 ranks, and says it left the first's rank2.json aside."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plain = (f"--master_port={port}", "--master_addr=127.0.0.1")
    LESSON.run("eval", 3, 3, str(tmp_path), launch=plain)
    report = LESSON.run("skip", 3, 2, str(tmp_path), launch=plain, planned=True)
    said(report, "skip", 3, LESSON.CASES["skip"][3])
    assert "left aside, another job's: rank2.json" in report[-1], report
    assert not any("rank 2" in line or "rank 3" in line for line in report), report
    records = [json.loads(p.read_text()) for p in tmp_path.glob("rank[01].json")]
    assert {r["world"] for r in records} == {2} and len({r["job"] for r in records}) == 1


def test_a_ring_that_dropped_its_oldest_entries(tmp_path):
    """Rings of 8: rank 0 goes on to a step rank 1 never takes, so its ring has dropped one
    entry more; lined up from where both still hold one, rank 1's stream is the one that ends."""
    report = LESSON.run("uneven", 2, 2, str(tmp_path), env={"MINISHARD_FLIGHT_RING": "8"})
    said(report, "uneven", 2, LESSON.CASES["uneven"][3])
    first = [json.loads(p.read_text())["collectives"][0]["nth"] for p in tmp_path.glob("*.json")]
    assert len(set(first)) == 2 and min(first) > 1, first  # both dropped some, not alike


def test_a_job_stopped_while_its_ranks_wait(tmp_path):
    """MINISHARD_TIMEOUT of 10 minutes: the ranks of a rank-0 evaluation at stage 2 wait inside
    gloo. kill -USR1 writes each rank's record at once (a thread wakes for it), without stopping
    the job; stopping torchrun writes them again, SIGTERM the reason. Both name the cause."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(MINISHARD_TIMEOUT="600", MINISHARD_FLIGHT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2", str(LESSON.__file__), "--broken", "eval", "2"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        report = snapshot_once_stuck(job, tmp_path)
        assert report[0].startswith("a forward on some ranks only:"), report
        job.send_signal(signal.SIGTERM)  # torchrun passes it to its ranks
        job.wait(timeout=90)
    finally:
        if job.poll() is None:  # torchrun stops its ranks (SIGTERM, then SIGKILL) and ends
            job.terminate()
            job.wait(timeout=90)
    whys = [json.loads(p.read_text())["why"] for p in tmp_path.glob("rank*.json")]
    assert len(whys) == 2 and all(w.startswith("SIGTERM") for w in whys), whys
    report = doctor.diagnose(tmp_path)
    assert report[0].startswith("a forward on some ranks only:"), report
    assert LESSON.line_of("# CAUSE eval") in report[0], report


def snapshot_once_stuck(job, flight_dir: Path, tries: int = 60) -> list[str]:
    """kill -USR1 both ranks (once each has armed: its rank<r>.fault is there) until their
    records show them waiting where they disagree."""
    for _ in range(tries):
        time.sleep(1)
        if len(list(flight_dir.glob("rank*.fault"))) < 2:
            continue
        for pid in ranks_of(job.pid):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        if len(list(flight_dir.glob("rank*.json"))) == 2:
            status, report = doctor.examine(flight_dir)
            if not report[0].startswith("no divergence"):
                return report
    raise AssertionError(f"the ranks never stopped agreeing: {doctor.diagnose(flight_dir)}")


def ranks_of(pid: int) -> list[int]:
    """torchrun's worker processes: its children running the lesson."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"--broken" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def a_record(directory: Path, **changes) -> Path:
    """A real record of this process (dumped, no job around it), with ``changes``."""
    path = minishard.dump_flight_record(directory)
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps({k: v for k, v in record.items() if v is not None}))
    return path


@pytest.mark.parametrize("damage, says", [
    ("garbage", "not a flight record: not JSON"),
    ("cut short", "not a flight record: not JSON, or cut short"),
    ("foreign", 'expected a JSON object with "format"'),
    ("a field missing", "has no 'job' of type str"),
    ("empty", "no flight records"),
])
def test_bad_input_gets_one_line(tmp_path, capsys, damage, says):
    """The doctor on what it cannot read: one line on stderr naming the file (or directory)
    and what it expects, exit status 2; a stray ``rank.fault`` beside a record is ignored."""
    if damage != "empty":
        path = a_record(tmp_path)
        (tmp_path / "rank.fault").write_text("not a rank's")
        if damage == "garbage":
            path.write_text("\x00\x01 not json")
        elif damage == "cut short":
            path.write_text(path.read_text()[:-40])
        elif damage == "foreign":
            path.write_text(json.dumps({"rank": 0, "loss": 1.5}))
        else:
            a_record(tmp_path, job=None)
    assert doctor.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and str(tmp_path) in err, err
    if damage == "empty":
        assert "MINISHARD_FLIGHT_DIR" in err, err


def test_the_exit_status_means_something(tmp_path, capsys):
    """A usage error and a missing directory exit 2 (one line each); end to end, a report
    that found nothing wrong exits 0."""
    assert doctor.main(["a", "b"]) == 2 and doctor.main([str(tmp_path / "none")]) == 2
    assert all("minishard.doctor" in line for line in capsys.readouterr().err.splitlines())
    a_record(tmp_path, why="exit")
    done = subprocess.run([sys.executable, "-m", "minishard.doctor", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("ended normally"), done


SETTINGS = [("MINISHARD_TIMEOUT", v) for v in ("abc", "inf", "nan", "-1", "0")] + [
    ("MINISHARD_DEBUG_TIMEOUT", "-5"), ("MINISHARD_FLIGHT_RING", "abc"),
    ("MINISHARD_FLIGHT_RING", "-1"), ("MINISHARD_FLIGHT_RING", "2.5")]
_TRY = """
import importlib, os, sys
from minishard import checks, comm
for name, value in {settings!r}:
    os.environ[name] = value
    try:
        importlib.reload(checks), importlib.reload(comm)
        print("accepted", name, repr(value))
    except ValueError as exc:
        print(exc)
    del os.environ[name]
"""


def test_bad_settings_are_refused_by_name():
    """Each bad value of minishard's variables is refused at import, naming the variable and
    what it takes (no timeout of -1 that fails every collective at once); empty means unset."""
    out = subprocess.run([sys.executable, "-c", _TRY.format(settings=SETTINGS + [
        ("MINISHARD_TIMEOUT", "")])], capture_output=True, text=True).stdout.splitlines()
    assert len(out) == len(SETTINGS) + 1, out
    for (name, value), line in zip(SETTINGS, out):
        assert line.startswith(f"{name}={value!r}: expected "), (name, value, line)
    assert out[-1] == "accepted MINISHARD_TIMEOUT ''", out
    failed = subprocess.run([sys.executable, "-c", "import minishard"], capture_output=True,
                            text=True, env={**os.environ, "MINISHARD_TIMEOUT": "-1"})
    last = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode != 0 and "MINISHARD_TIMEOUT='-1': expected" in last, last
    with pytest.raises(ValueError, match="set_timeout: expected a number of seconds above 0"):
        comm.set_timeout(float("nan"))


def torch_clip_is_recorded() -> list:
    """One stage-3 step clipped by torch's own clip_grad_norm_ on the DTensor parameters: what
    the flight record holds of it, from the last gather on."""
    model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stage=3,
                           units={nn.Linear})
    model(torch.randn(2, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # CLIP
    return [(f.op, f.tag, f.event[0], f.site, f.group, f.nth)
            for f in list(comm.FLIGHT.ring)[-4:]]


def test_dtensor_collectives_for_torch_tools_are_recorded(pools):
    """torch runs clip_grad_norm_'s all-reduce itself (DTensor); the record holds it, with the
    user's line, after the engine's own reductions, on the same group's count (DTensor passes
    the default group's object, comm None: one group, one stream the doctor lines up)."""
    for rank_rows in pools(2).run(torch_clip_is_recorded):
        op, tag, phase, site, group, nth = rank_rows[-1]
        assert (op, tag, phase) == ("all_reduce", "torch all_reduce", "after backward"), rank_rows
        source, first = inspect.getsourcelines(torch_clip_is_recorded)
        line = first + next(i for i, s in enumerate(source) if s.rstrip().endswith("# CLIP"))
        assert site == (__file__, line), (site, line)
        assert any(row[0] == "reduce_scatter" for row in rank_rows), rank_rows
        assert group == rank_rows[-2][4] and nth == rank_rows[-2][5] + 1, rank_rows
