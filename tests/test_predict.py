"""The planner's memory prediction (observe/predict.py) against the engine it predicts.

A plan is made from the unwrapped module on the meta device, with no process group; the same
configuration is then wrapped for real. Every claim is checked against what the wrapped model
IS, not against the planner's own arithmetic:
  * each planned buffer equals the engine's (cut, mode, dtypes, bytes), unit by unit;
  * the step's buffers (``transients``) equal ``model.step_transients()``;
  * parameters and optimizer state equal what ``memory_report`` counts held after a step
    (the stamps' room included: it is held).
A step's peak is predicted by a dry run (observe/dry_run.py: the engine's own step in this
process, alone, as rank r of N) and measured on N real ranks: within 5% on every rank, over
drawn configurations (DDP and stages 0-3, 1-4 ranks, an MLP and a GPT, fp32 and bf16, buckets
and prefetch on and off, for-loop and foreach Adam).
"""
import copy
import functools
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from minishard import MixedPrecision, ZeRO, checks, comm
from minishard.observe import plan
from minishard.observe.memory import zero_bytes
from minishard.observe.dry_run import Call
from minishard.observe.predict import (GPT_UNITS, MLP_UNITS, SYSTEMS, DryStep, check, describe,
                                       gpt, mlp, plan_buffers, predict, predict_memory, price,
                                       timeline, timelines, train)
from minishard.testing import _free_port
from test_memory_wall import Block, Net

WORLD_SIZES = (1, 2, 3, 4)
MP = {"none": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16),
      "bf16+fp32 reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
FIELDS = ("shapes", "chunks", "chunk", "padded_numel", "shard_numel", "shard_real", "mode",
          "dtype", "param_dtype", "requires_grad", "tail", "full_bytes")


def plan_and_engine(width, depth, stage, mp, prefetch, bucket, persist, find_unused, optimizer):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    net = Net(width, depth)
    net.blocks[0].norm.requires_grad_(False)  # a frozen buffer beside a trainable one
    config = dict(units={Block}, mixed_precision=MP[mp], persist_below=persist)
    meta = copy.deepcopy(net).to("meta")
    plan = plan_buffers(meta, stage, world, rank, **config)
    predicted = predict_memory(meta, stage, world, rank, optimizer=optimizer[0], prefetch=prefetch,
                               bucket_bytes=bucket, find_unused=find_unused, **config)
    model = ZeRO(net, stage=stage, prefetch=prefetch, bucket_bytes=bucket,
                 find_unused_parameters=find_unused, **config)
    built = [(u.module is model.module, [{k: getattr(f, k) for k in FIELDS} for f in u.flats])
             for u in model.units]
    planned = [(root, [{k: getattr(b, k) for k in FIELDS} for b in bs]) for root, bs in plan]
    kind, foreach = optimizer
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=foreach),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=foreach)}[kind]
    opt = make(model.parameters())
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    report = model.memory_report(opt)
    return built, planned, model.step_transients(), predicted, report


@given(ws=st.sampled_from(WORLD_SIZES), width=st.integers(3, 20), depth=st.integers(1, 3),
       stage=st.sampled_from([0, 1, 2, 3]), mp=st.sampled_from(sorted(MP)),
       prefetch=st.booleans(), bucket=st.sampled_from([0, 2000]),
       persist=st.sampled_from([0, 24]), find_unused=st.booleans(),
       optimizer=st.tuples(st.sampled_from(["adam", "sgd"]), st.booleans()))  # (kind, foreach)
def test_the_plan_is_the_engine_buffer_by_buffer(pools, ws, width, depth, stage, mp, prefetch,
                                                  bucket, persist, find_unused, optimizer):
    find_unused = find_unused and stage < 3  # (refused at stage 3)
    for rank, (built, planned, step, predicted, report) in enumerate(pools(ws).run(
            plan_and_engine, width, depth, stage, mp, prefetch, bucket, persist, find_unused,
            optimizer)):
        assert planned == built, (rank, planned, built)
        assert {k: v for k, v in predicted.items()
                if k not in ("parameters", "optimizer state")} == step, (rank, predicted, step)
        assert predicted["parameters"] == report["params"] + report["stamps"], (rank, report)
        assert predicted["optimizer state"] == report["optimizer"], (rank, predicted, report)


# Sizes: a batch whose activations outweigh any one collective's buffers. gloo's worker thread
# lets go of a collective's tensors just after the wait returns, so now and then a real step's
# peak holds one more (a race: measured up to 6% above on a 0.8 MB peak; the dry run never).
MODELS = {"mlp": (functools.partial(mlp, 64, 4, 1024), MLP_UNITS),
          "gpt": (functools.partial(gpt, 96, 32, 32, 3, 32), GPT_UNITS)}


def arguments(model, system, mp, bucket, prefetch, foreach):
    """train()'s keyword arguments for a drawn configuration (DDP takes no ZeRO argument)."""
    kwargs = {"optimizer": functools.partial(torch.optim.Adam, lr=1e-3, foreach=foreach)}
    if system != "ddp":
        kwargs |= dict(units=MODELS[model][1], mixed_precision=MP[mp], bucket_bytes=bucket,
                       prefetch=prefetch)
    return kwargs


def measured_peak(model, system, kwargs) -> int:
    return train(MODELS[model][0], system, **kwargs).peak


@given(ws=st.sampled_from(WORLD_SIZES), model=st.sampled_from(sorted(MODELS)),
       system=st.sampled_from(SYSTEMS), mp=st.sampled_from(["none", "bf16"]),
       bucket=st.sampled_from([0, 20_000]), prefetch=st.booleans(), foreach=st.booleans())
def test_a_dry_run_predicts_every_ranks_peak_within_5_percent(pools, ws, model, system, mp,
                                                              bucket, prefetch, foreach):
    kwargs = arguments(model, system, mp, bucket, prefetch, foreach)
    measured = pools(ws).run(measured_peak, model, system, kwargs)
    for rank in range(ws):
        predicted = predict(MODELS[model][0], system, ws, rank, **kwargs).peak
        assert abs(predicted - measured[rank]) <= 0.05 * measured[rank], (rank, predicted,
                                                                          measured)


def test_a_dry_run_needs_a_process_of_its_own(pools):
    """The default process group is one a process: refused, saying what to do, where one is."""
    with pytest.raises(RuntimeError, match="before init_process_group"):
        pools(2).run(predict, MODELS["mlp"][0], 0, 2, 0)


def test_a_dry_run_under_debug_mode_predicts_the_same_peak():
    """MINISHARD_DEBUG's check compares the ranks' collectives; in a dry run there is one rank,
    which agrees with itself: the check is off inside, back on after."""
    build = MODELS["mlp"][0]
    plain, was = predict(build, 3, 3, 1, units=MLP_UNITS).peak, checks.DEBUG["on"]
    comm.set_debug(True)
    try:
        assert predict(build, 3, 3, 1, units=MLP_UNITS).peak == plain
        assert checks.DEBUG["on"]
    finally:
        comm.set_debug(was)


def check_on_this_rank(predicted_by_rank, build):
    return check(predicted_by_rank[dist.get_rank()], build, SYSTEMS, timed=5, units=MLP_UNITS)


def test_check_prints_each_system_predicted_beside_measured(pools):
    """``python -m minishard.plan --check``'s lines (observe/predict.py: check), on a small MLP
    at 2 and 3 ranks: two a system, in the issue's format; the peaks within 5% of each other,
    the times within 3x (a shared CPU's five-step medians: a bound on gross errors only)."""
    build = MODELS["mlp"][0]
    for world in (2, 3):
        predicted = timelines(build, world, timed=5, units=MLP_UNITS)
        lines = pools(world).run(check_on_this_rank, predicted, build)[0]
        names = ["DDP"] + [f"minishard stage {s}" for s in range(4)]
        assert [line.rsplit(" ", 2)[0] for line in lines] == [
            f"{name} {what}" for name in names for what in ("peak_allocated", "step_time")], lines
        for line in lines:
            predicted, measured = map(float, re.fullmatch(
                r".* (?:peak_allocated|step_time) predicted=([\d.]+) measured=([\d.]+)",
                line).groups())
            assert predicted > 0 and measured > 0, line
            if "peak_allocated" in line:
                assert abs(predicted - measured) <= 0.05 * measured, line
            else:  # within 15% in bench/RESULTS.md's rounds, mostly; here: no order of magnitude
                assert measured / 3 <= predicted <= 3 * measured, line


# ----------------------------------------------------------------------------- the timeline
def collectives(draw_calls, start, seconds):
    """Drawn (op, bytes, of, issue fraction, wait fraction or None) -> dry_run.Calls, in issue
    order, as a dry run records them (perf_counter times from ``start``; ``of``: 0, a call from
    outside comm.py, else its collective's number: neighbours alike are one collective)."""
    calls = []
    for op, nbytes, of, at, wait in sorted(draw_calls, key=lambda c: c[3]):
        issued = start + at * seconds
        calls.append(Call(op, nbytes, f"c{of}" if of else "", issued,
                          None if wait is None else issued + wait * (start + seconds - issued),
                          of))
    return calls


CALLS = st.lists(st.tuples(st.sampled_from(["allreduce", "broadcast", "send", "recv"]),
                           st.integers(0, 4 << 20), st.integers(0, 2), st.floats(0, 1),
                           st.one_of(st.none(), st.floats(0, 1))), max_size=8)


@given(calls=CALLS, seconds=st.floats(1e-4, 0.5), world=st.integers(1, 4))
def test_a_timeline_lays_out_the_step_by_each_rule(calls, seconds, world):
    step = DryStep(100.0, seconds, collectives(calls, 100.0, seconds))
    shared, eps = max(1, world / 2), 1e-9
    priced = shared * sum(price(c.op, c.nbytes, world) for c in step.calls)
    for wire in (False, True):
        spans = timeline(step, world, wire, cores=2)
        compute = [s for s in spans if s.what == "compute"]
        talk = [s for s in spans if s.what != "compute"]
        end = max(s.start + s.seconds for s in spans)
        assert sum(s.seconds for s in compute) == pytest.approx(shared * seconds)
        assert sum(s.seconds for s in talk) == pytest.approx(priced, abs=eps)
        for lane in (compute, talk):  # the computation one at a time; the wire one at a time
            assert all(a.start + a.seconds <= b.start + eps for a, b in zip(lane, lane[1:]))
        assert all(-eps <= s.exposed <= s.seconds + eps for s in talk)
        # every second the rank waited is a second some collective was exposed
        assert end == pytest.approx(shared * seconds + sum(s.exposed for s in talk), abs=eps)
        if not wire:  # this machine: every byte's price exposed, the cores moving it
            assert end == pytest.approx(shared * seconds + priced, abs=eps)
            assert all(s.exposed == s.seconds for s in talk)
        else:  # a link of its own hides what lands before the engine waits for it
            assert end <= shared * seconds + priced + eps


def test_a_timeline_by_hand():
    """Worked by hand: a 10 ms step on 2 ranks (2 cores), sends priced 3 ms each; a call
    (collective, issued, waited[, its number: else one per name])."""
    three = round((3e-3 - comm.ALPHA) / comm.BETA)  # a send's bytes priced 3 ms
    p = price("send", three, 2)
    assert p == pytest.approx(3e-3)

    def layout(*calls, wire):
        calls = [Call("send", three, *c[:3], of=c[3] if len(c) > 3 else ord(c[0])) for c in calls]
        spans = timeline(DryStep(0.0, 10e-3, calls), 2, wire, cores=2)
        return [(s.what, round(s.start * 1e3, 3), round(s.seconds * 1e3, 3),
                 round(s.exposed * 1e3, 3)) for s in spans]
    waited_at_once = ("a", 2e-3, 2e-3)
    assert layout(waited_at_once, wire=False) == layout(waited_at_once, wire=True) == [
        ("compute", 0, 2, 0), ("a", 2, 3, 3), ("compute", 5, 8, 0)]
    landed_first = ("a", 2e-3, 6e-3)  # waited 4 ms after its issue: landed after 3
    assert layout(landed_first, wire=True) == [("compute", 0, 10, 0), ("a", 2, 3, 0)]
    assert layout(landed_first, wire=False) == [("compute", 0, 2, 0), ("a", 2, 3, 3),
                                                 ("compute", 5, 8, 0)]
    # b queues behind a on the wire (a lands at 4 ms, b at 7); waiting for b at 2 ms blocks
    # 5 ms: a's last 2 on the wire, then b's 3
    queued = [("a", 1e-3, 9e-3), ("b", 1e-3, 2e-3)]
    assert layout(*queued, wire=True) == [("compute", 0, 2, 0), ("a", 1, 3, 2),
                                          ("b", 4, 3, 3), ("compute", 7, 8, 0)]
    # two backend calls of one collective (an all-gather's broadcasts): one span, both prices
    assert layout(("g", 1e-3, 1e-3), ("g", 1e-3, 1e-3), wire=False) == [
        ("compute", 0, 1, 0), ("g", 1, 6, 6), ("compute", 7, 9, 0)]
    # the same collective again (a unit's gather in forward, then in backward): two spans
    assert layout(("g", 1e-3, 1e-3, 1), ("g", 2e-3, 2e-3, 2), wire=False)[1:4:2] == [
        ("g", 1, 3, 3), ("g", 5, 3, 3)]


def test_a_dry_runs_waits_are_the_engines():
    """The timeline's overlap is read from the engine's own waits in the dry run: at stage 3 the
    forward waits for a unit's gather as soon as it is issued, unless prefetch issues it a unit
    early, and that unit's forward hides it (on a link of its own); DDP's buckets are waited
    when backward ends, as DDP's reducer does. Every backend call of comm.py carries its
    collective. (Medians over a step's gathers: a preempted moment moves one gather, not all.)"""
    build = functools.partial(mlp, 256, 4, 2048)  # a unit's forward: milliseconds, a gather's 1

    def exposed(prefetch):  # the forward's gathers: the median fraction of each that is exposed
        step = predict(build, 3, 2, 0, timed=1, units=MLP_UNITS, prefetch=prefetch).dry_steps[0]
        assert all(c.what.split(" ")[0] in ("all_gather", "reduce_scatter")
                   and c.waited >= c.issued for c in step.calls), step.calls
        spans = timeline(step, 2, wire=True)
        backward = min(s.start for s in spans if s.what.startswith("reduce_scatter"))
        return statistics.median(s.exposed / s.seconds for s in spans
                                 if s.what.startswith("all_gather") and s.start < backward)
    assert exposed(prefetch=False) >= 0.8
    assert exposed(prefetch=True) <= 0.2
    ddp = predict(build, "ddp", 2, 0, timed=1).dry_steps[-1].calls
    assert ddp and all(c.what == "" and c.waited >= ddp[-1].issued for c in ddp), ddp


def test_the_timeline_command_prints_the_systems_and_each_ranks_step(capsys):
    """``python -m minishard.plan --timeline 3 --ranks 2``, and its report (describe) of DDP on
    a small GPT at 3 ranks by the rule of a link of its own."""
    plan.main(["--timeline", "3", "--ranks", "2"])
    small = functools.partial(gpt, 64, 16, 32, 2, 2)
    print("\n".join(describe(timelines(small, 3, timed=3, units=GPT_UNITS), shown="ddp",
                             wire=True)))
    first, second = capsys.readouterr().out.split("Predicted on 3 ranks")
    for out, world, shown in ((first, 2, "minishard stage 3"), (second, 3, "DDP")):
        rows = {line[:18].strip(): [float(x) for x in line[18:].replace("|", "").split()]
                for line in out.splitlines() if line[:18].strip() in (
                    "DDP", *(f"minishard stage {s}" for s in range(4)))}
        assert len(rows) == 5, out
        for compute, talk, step, exposed, own in rows.values():
            assert 0 < compute <= step <= compute + talk + 2e-2  # (each printed to 0.01 ms)
            assert 0 <= exposed <= talk + 2e-2 and own <= step + 2e-2
        for rank in range(world):
            assert f"{shown}, rank {rank} of {world}, its median step" in out
        assert "all_gather" in first and "reduce_scatter" in first and "allreduce" in second


def dry_run_late(rank: int, port: int, late: float) -> list[float]:
    """One of two processes: this rank's dry run ``late`` seconds late, stepping with the
    other's through a shared store; when each timed step started (a clock both share)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    time.sleep(late)
    run = predict(functools.partial(mlp, 64, 2, 16), 0, 2, rank, timed=3,
                  together=dist.PrefixStore("test", store))
    assert all(step.together for step in run.dry_steps)
    return [step.start for step in run.dry_steps]


def test_dry_runs_together_step_together():
    """predictions() times every rank's dry run at once (so they share the cores as the real
    ranks will), in step: a rank that starts half a second late holds the other at each step."""
    port = _free_port()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        first, late = pool.starmap(dry_run_late, [(0, port, 0.0), (1, port, 0.5)])
    assert len(first) == len(late) == 3
    assert all(abs(a - b) < 0.1 for a, b in zip(first, late)), (first, late)


# ------------------------------------------------------------------- a model of yours: --model
ROOT = Path(__file__).resolve().parents[1]
YOURS = str(ROOT / "tests" / "your_models.py")  # written apart from the planner, as a user's
SYSTEM_NAMES = ["DDP"] + [f"minishard stage {s}" for s in range(4)]


@pytest.mark.parametrize("function", ["conv_net", "tied_gpt"])
def test_check_on_a_model_of_yours(function):
    """``torchrun --nproc_per_node=2 -m minishard.plan --check --model FILE.py:FUNCTION``: a
    conv net with BatchNorm (its loss a cross-entropy of its own labels) and a tied-embedding LM
    returning (logits, loss): for DDP and stages 0-3 a peak_allocated line (predicted within 5%
    of measured) and a step_time line. Times are printed, never bounded here."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "minishard.plan", "--check", "--model", f"{YOURS}:{function}", "--steps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "predicted=" in line]
    assert [line.rsplit(" ", 2)[0] for line in lines] == [
        f"{name} {what}" for name in SYSTEM_NAMES for what in ("peak_allocated", "step_time")]
    for line in lines:
        predicted, measured = map(float, re.findall(r"=([\d.]+)", line))
        assert predicted > 0 and measured > 0, line
        if "peak_allocated" in line:
            assert abs(predicted - measured) <= 0.05 * measured, line


def test_the_timeline_names_your_models_modules(capsys):
    """``--timeline 3 --ranks 2 --model FILE.py:tied_gpt``: stage 3's step on each rank names
    the user's own modules (its units, layers.0-2, each gathered and reduce-scattered)."""
    plan.main(["--timeline", "3", "--ranks", "2", "--model", f"{YOURS}:tied_gpt", "--steps", "2"])
    out = capsys.readouterr().out
    for rank in range(2):
        assert f"minishard stage 3, rank {rank} of 2, its median step" in out, out
    for layer in range(3):
        assert f"all_gather layers.{layer}/float32" in out, out
        assert f"reduce_scatter layers.{layer}/float32" in out, out


def test_the_plan_of_your_model_on_the_meta_device_is_the_zero_formulas(capsys):
    """A 124M-parameter LM on the meta device, 8 ranks: nothing runs; what a rank holds at rest
    (parameters and Adam's two moments, fp32; gradients freed by zero_grad) is the ZeRO paper's
    formula with the gradients left out: 12Ψ at stage 0, 4Ψ + 8Ψ/N at stages 1-2, 12Ψ/N at
    stage 3, give or take the engine's padding and stamps (under 0.1% here)."""
    plan.main(["--model", f"{YOURS}:tied_gpt_on_meta", "--ranks", "8"])
    out = capsys.readouterr().out
    psi = int(re.search(r": ([\d,]+) parameters", out).group(1).replace(",", ""))
    rows = {line[:18].strip(): float(line[18:].split()[0]) for line in out.splitlines()
            if line.startswith("minishard stage")}
    for stage in range(4):
        terms = zero_bytes(psi, 8, stage, "adam")
        want = terms["params"] + terms["optimizer"]
        assert rows[f"minishard stage {stage}"] == pytest.approx(want / 2**20, rel=1e-3), out
    assert "ACTIVATIONS NOT COUNTED" in out and "DDP" not in out.split("\n\n")[0], out


def test_the_plan_of_your_model_runs_every_system(capsys):
    """``python -m minishard.plan --model FILE.py:conv_net --ranks 2 --memory 1GB``: a row a
    system (at rest, step peak, step time), a fits column and the lowest that fits."""
    plan.main(["--model", f"{YOURS}:conv_net", "--ranks", "2", "--memory", "1GB", "--steps", "2"])
    out = capsys.readouterr().out
    rows = {line[:18].strip(): line[18:].split() for line in out.splitlines()
            if line.startswith(("DDP", "minishard stage"))}
    assert list(rows) == SYSTEM_NAMES, out
    rest = [float(cells[0]) for cells in rows.values()]
    assert all(float(c[1]) > float(c[0]) > 0 and float(c[2]) > 0 and c[3] == "yes"
               for c in rows.values()), rows
    assert rest[1] >= rest[2] >= rest[4], rows  # stage 0 >= 1 >= 3 at rest
    assert "The lowest that fits in 1 GB less 100 MB headroom: DDP" in out, out


@pytest.mark.parametrize("function, says", [
    ("no_file.py:build", "no such file no_file.py"),
    (f"{YOURS}:no_such_function", "defines no function 'no_such_function' (it defines: "),
    (f"{YOURS}:returns_a_tuple", "returned a tuple; return a dict"),
    (f"{YOURS}:no_loss_for_a_tuple_output", "a model whose output is not a tensor needs 'loss'"),
    (f"{YOURS}:units_not_in_the_model", "'units' DecoderLayer: no module of the model is one"),
    (YOURS, "give FILE.py:FUNCTION")])
def test_a_wrong_model_is_one_line(capsys, function, says):
    for argv in (["--model", function], ["--timeline", "3", "--model", function]):
        with pytest.raises(SystemExit) as exit_:
            plan.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err
        assert err.startswith("python -m minishard.plan: error: --model ") and "Traceback" \
            not in err


def test_a_model_on_the_meta_device_is_not_timed(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--timeline", "3", "--model", f"{YOURS}:tied_gpt_on_meta"])
    assert "the model is on the meta device; --check and --timeline run its step" in \
        capsys.readouterr().err
