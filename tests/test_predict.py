"""The planner's memory prediction (observe/predict.py) against the engine it predicts.

A plan is made from the unwrapped module on the meta device, with no process group; the same
configuration is then wrapped for real. Every claim is checked against what the wrapped model
IS, not against the planner's own arithmetic:
  * each planned buffer equals the engine's (cut, mode, dtypes, bytes), unit by unit;
  * the step's buffers (``transients``) equal ``model.step_transients()``;
  * parameters and optimizer state equal what ``memory_report`` counts held after a step
    (the stamps' room included: it is held).
"""
import copy
import re

import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from minishard import MixedPrecision, ZeRO
from minishard.observe.predict import check, plan_buffers, predict_memory
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
    predicted = predict_memory(meta, stage, world, rank, optimizer=optimizer, prefetch=prefetch,
                               bucket_bytes=bucket, find_unused=find_unused, **config)
    model = ZeRO(net, stage=stage, prefetch=prefetch, bucket_bytes=bucket,
                 find_unused_parameters=find_unused, **config)
    built = [(u.module is model.module, [{k: getattr(f, k) for k in FIELDS} for f in u.flats])
             for u in model.units]
    planned = [(root, [{k: getattr(b, k) for k in FIELDS} for b in bs]) for root, bs in plan]
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)}[optimizer]
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
       optimizer=st.sampled_from(["adam", "sgd"]))
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


def test_check_prints_each_stage_predicted_beside_measured(pools):
    """``python -m minishard.plan --check``'s lines (observe/predict.py: check), on a small MLP
    at 2 and 3 ranks: one a stage, in the issue's format, and the measured peak (Allocations,
    this machine) within the prediction, which is today the step formula's upper bound (its
    distance above, not checked here, is bench/RESULTS.md's "The planner beside a run")."""
    for world in (2, 3):
        lines = pools(world).run(check, width=48, blocks=3, batch=4, steps=2)[0]
        assert [line.split(" peak")[0] for line in lines] == [f"minishard stage {s}"
                                                              for s in range(4)], lines
        for line in lines:
            predicted, measured = map(float, re.fullmatch(
                r"minishard stage \d peak_allocated predicted=([\d.]+) measured=([\d.]+)",
                line).groups())
            assert 0 < measured <= predicted, line
