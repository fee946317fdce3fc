"""model.trace(path): the Chrome trace rank 0 writes is valid JSON with one process per rank,
and the schedule it shows keeps the engine's invariants: at stage 3 a unit's forward lies inside
its gather..free; with prefetch the next unit's gather starts before the current forward ends;
stage 0 gathers nothing; every rank issues the same collectives in the same order."""
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import minishard
from minishard import comm
from minishard.observe.trace import TRACKS, draw

BLOCKS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))


def traced_step(stage: int, prefetch: bool, path: str):
    """One step outside the trace (records the order prefetch follows), one inside; rank 0
    returns the file it wrote; every rank checks the trace left no hook behind."""
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=stage,
                           units={Block}, prefetch=prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    hooks = [len(u.module._forward_hooks) for u in model.units]
    optim_hooks = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    for traced in (False, True):
        with model.trace(path) if traced else minishard.ledger():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert comm._observer is None
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == optim_hooks
    assert [len(u.module._forward_hooks) for u in model.units] == hooks
    if dist.get_rank() != 0:
        return None
    with open(path) as f:
        return json.load(f)


def spans(trace, pid, cat=None, name=None):
    return sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
                   and (cat is None or e["cat"] == cat)
                   and (name is None or e["name"] == name)), key=lambda e: e["ts"])


def end(e):
    return e["ts"] + e["dur"]


CASES = [(2, 3, True), (3, 3, True), (2, 3, False), (2, 0, False), (3, 0, False), (2, 2, True)]


@pytest.fixture(scope="module")
def traces(pools, tmp_path_factory):
    out = {}
    for world, stage, prefetch in CASES:
        path = str(tmp_path_factory.mktemp("trace") / "step.json")
        out[world, stage, prefetch] = pools(world).run(traced_step, stage, prefetch, path)[0]
    return out


@pytest.mark.parametrize("case", CASES)
def test_valid_chrome_trace_one_process_per_rank(traces, case):
    trace, world = traces[case], case[0]
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == set(range(world))
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}
    for e in events:
        assert e["ph"] in "XiCM", e
        if e["ph"] == "X":
            assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0, e
            assert e["cat"] in TRACKS
    for r in range(world):
        assert len(spans(trace, r, name="SGD.step")) == 1
        assert spans(trace, r, "waits"), "no wait recorded"
        for b in range(BLOCKS):
            assert len(spans(trace, r, name=f"forward {b}")) == 1
            assert len(spans(trace, r, name=f"backward {b}")) == 1
            # once each, alone or in a bucket (stages 0-1: one for all)
            assert sum(str(b) in e["args"]["units"] for e in spans(trace, r, "reduce")) == 1
        # the step comes after the whole backward
        step = spans(trace, r, name="SGD.step")[0]
        assert all(end(e) <= step["ts"] for e in spans(trace, r, "compute")
                   if e["name"].startswith("backward"))


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 3])
def test_stage3_forward_inside_its_gather_and_free(traces, case):
    trace = traces[case]
    for r in range(case[0]):
        frees = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["pid"] == r]
        for b in range(BLOCKS):
            fwd = spans(trace, r, name=f"forward {b}")[0]
            gathers = [g for g in spans(trace, r, "gather") if str(b) in g["args"]["units"]
                       and end(g) <= fwd["ts"]]
            assert gathers, f"rank {r}: unit {b}'s forward started before its gather landed"
            # freed after its forward ends, before backward gathers it again
            free = min(f["ts"] for f in frees if f["args"]["unit"] == str(b)
                       and f["ts"] >= fwd["ts"])
            again = spans(trace, r, name=f"gather {b}")
            assert len(again) == 2 and end(fwd) <= free <= again[1]["ts"], (r, b, fwd, free)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 3])
def test_prefetch_issues_the_next_gather_during_this_forward(traces, case):
    trace, prefetch = traces[case], case[2]
    for r in range(case[0]):
        for b in range(BLOCKS - 1):
            fwd = spans(trace, r, name=f"forward {b}")[0]
            nxt = spans(trace, r, name=f"gather {b + 1}")[0]
            assert (nxt["ts"] < end(fwd)) == prefetch, (r, b, fwd, nxt)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 0])
def test_stage0_gathers_nothing(traces, case):
    trace = traces[case]
    assert not [e for e in trace["traceEvents"] if e.get("cat") == "gather"]
    assert not [e for e in trace["traceEvents"] if e.get("args", {}).get("op") == "all_gather"]
    assert {e["args"]["op"] for e in trace["traceEvents"] if e.get("cat") == "reduce"} \
        == {"all_reduce"}


@pytest.mark.parametrize("case", CASES)
def test_every_rank_issues_the_same_collectives_in_order(traces, case):
    trace, world = traces[case], case[0]

    def order(r):
        calls = sorted((e["args"]["seq"], e["args"]["op"], e["args"]["tag"], e["args"]["numel"],
                        e["args"]["bytes_sent"], e["args"]["algorithm"], tuple(e["args"]["group"]))
                       for e in trace["traceEvents"]
                       if e["ph"] == "X" and e["pid"] == r and "seq" in e["args"]
                       and e["cat"] != "waits")
        assert [c[0] for c in calls] == list(range(len(calls)))
        return [c[1:] for c in calls]
    assert order(0)
    assert all(order(r) == order(0) for r in range(1, world))


def test_draw_makes_a_png(traces, tmp_path):  # matplotlib: the 'plot' extra, also in 'test'
    png = tmp_path / "trace.png"
    draw(traces[2, 3, True], str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)


def traced_late(path: str, delay: float):
    """Rank r enters the trace r x ``delay`` seconds after rank 0: its clock starts later."""
    import time
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=3,
                           units={Block})
    dist.barrier()
    time.sleep(dist.get_rank() * delay)
    with model.trace(path):
        model(torch.randn(4, 16)).sum().backward()
    if dist.get_rank() != 0:
        return None
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("world", [2, 3])
def test_one_collective_ends_at_the_same_time_on_every_rank(pools, tmp_path, world):
    """Every rank's clock is placed on the wall clock: a collective that makes the early ranks
    wait for the late one ends at the same moment on every rank (within 30 ms on a loaded
    2-core machine), although the ranks entered the trace 150 ms apart. A wrong shift (wall
    nanoseconds divided by 1e6 instead of 1000) misplaces the late ranks by ~150 ms each."""
    trace = pools(world).run(traced_late, str(tmp_path / "late.json"), 0.15)[0]
    first = {e["pid"]: end(e) for e in trace["traceEvents"]
             if e["ph"] == "X" and e["args"].get("seq") == 0 and e["cat"] != "waits"}
    assert set(first) == set(range(world)), first
    assert max(first.values()) - min(first.values()) < 30_000, first  # microseconds
