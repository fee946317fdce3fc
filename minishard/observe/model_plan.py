"""The planner on a model, yours or bench/'s: ``python -m minishard.plan --model``, ``--check``
and ``--timeline`` (plan.py's options; observe/models.py loads the model, observe/predict.py
runs it).

    python -m minishard.plan --model FILE.py:FUNCTION --ranks 4 [--memory 24GB]

prints, for DDP and stages 0-3, what a rank holds at rest, its step's peak (both measured in a
dry run of every rank: the engine's real step, observe/dry_run.py) and the step's time on this
machine; a model on the meta device gets the plan's bound (:func:`predict.predict_memory`) and
no time. A wrong input (no such file, a dict not as models.py asks) is one line, never a
traceback.
"""
from __future__ import annotations

import os
import textwrap

from torch import nn

from minishard.observe import predict
from minishard.observe.memory import fmt_decimal
from minishard.observe.models import OPTIMIZERS, Model, ModelError, on_meta, runs_once

__all__ = ["plan_lines", "dry_run_lines", "meta_plan_lines", "command"]


def plan_lines(model: Model, world: int, optimizer: str = "adam", memory: float | None = None,
               headroom: float = 0.0, timed: int = 5) -> list[str]:
    """``python -m minishard.plan --model ...``: DDP and stages 0-3 of ``model`` on ``world``
    ranks, what a rank holds at rest, its step's peak and the step's time, from every rank's dry
    run (observe/predict.py); a model on the meta device gets the plan's bound instead."""
    made = model.check(runs=False)
    module = made["model"]
    count = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    head = (f"--model {model.where}: {count:,} parameters, units "
            f"{', '.join(sorted(c.__name__ for c in made['units'] or ())) or 'the root alone'}; "
            f"{world} ranks, {optimizer}")
    if on_meta(module):
        lines = meta_plan_lines(module, world, made["units"], optimizer, memory, headroom)
    else:
        runs_once(model.where, made)
        runs = predict.timelines(model, world, timed=timed, units=made["units"],
                                 loss=made["loss"], optimizer=OPTIMIZERS[optimizer])
        lines = dry_run_lines(runs, memory, headroom)
    return [head] + [short for line in lines for short in (textwrap.wrap(line, 100) or [""])]


def command(parser, args, argv: list[str], headroom: float) -> None:
    """--model, --check or --timeline, checked, then run: a wrong input is one line
    (``parser.error``), never a traceback."""
    given = [flag for flag, value in (("--params", args.params), ("--nodes", args.nodes),
                                      ("--mixed-precision", args.mixed_precision),
                                      ("--layers", args.layers)) if value]
    if given:
        parser.error(f"--model, --check and --timeline run the model's own step: {given[0]} "
                     "is for the formulas (python -m minishard.plan --params ...)")
    if args.check and args.ranks is not None:
        parser.error("--check runs on torchrun's ranks: give --nproc_per_node, not --ranks")
    if args.check and "RANK" not in os.environ:
        parser.error("--check predicts, then measures, ranks: start it with torchrun, e.g. "
                     "torchrun --standalone --nproc_per_node=2 -m minishard.plan "
                     + " ".join(argv))
    world = 2 if args.ranks is None else args.ranks
    if world < 1:
        parser.error(f"--ranks {world}: give a number of ranks, 1 or more")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: time at least 1 step")
    model, steps = Model(args.model or "mlp"), {} if args.steps is None else {"timed": args.steps}
    try:
        if args.check:
            predict.check_here(model, **steps)
        elif args.timeline:
            predict.print_timeline(model, world, args.timeline, args.wire, **steps)
        else:
            print("\n".join(plan_lines(model, world, args.optimizer, args.memory, headroom,
                                        **steps)))
    except ModelError as exc:
        parser.error(str(exc))


def _fits(peak: float, memory: float | None, headroom: float) -> str:
    return "" if memory is None else f"{'yes' if peak <= memory - headroom else 'no':>6}"


def _unit(largest: float) -> tuple[str, int]:
    """The table's unit: MiB, or KiB for a model whose every number is under a MiB."""
    return ("KiB", 2**10) if largest < 2**20 else ("MiB", 2**20)


def dry_run_lines(runs: list[list[predict.Run]], memory: float | None = None,
                  headroom: float = 0.0) -> list[str]:
    """``python -m minishard.plan --model``'s table from :func:`timelines`: each system's bytes
    at rest and step peak on the rank where they are largest, its slowest rank's median step."""
    world, fitting, rows = len(runs), [], []
    for i, system in enumerate(predict.SYSTEMS):
        rest, peak = (max(getattr(rank[i], key) for rank in runs) for key in ("at_rest", "peak"))
        rows.append((system, rest, peak, max(rank[i].median_s for rank in runs)))
        if memory is not None and peak <= memory - headroom:
            fitting.append(system)
    unit, size = _unit(max(peak for _, _, peak, _ in rows))
    lines = [f"{'':18}{'at rest ' + unit:>12}{'step peak ' + unit:>15}{'step ms':>10}"
             + ("  fits" if memory is not None else "")]
    lines += [f"{predict.name_of(system):18}{rest / size:12.2f}{peak / size:15.2f}"
              f"{1e3 * seconds:10.2f}" + _fits(peak, memory, headroom)
              for system, rest, peak, seconds in rows]
    lines += ["", "at rest: allocated between steps, the batch not counted (parameters, "
              "optimizer state, what the system keeps); step peak: the most allocated at once in "
              "a step, its activations included; both on the rank where they are largest, "
              "measured in a dry run of each rank (on a GPU, add what this does not count: "
              "NCCL's own buffers, what the caching allocator reserves beyond what is "
              "allocated). step ms: the slowest rank's median step on THIS machine's cores and "
              f"gloo, {world} ranks sharing them (where that time goes: --timeline)."]
    if memory is not None:
        lines.append(f"The lowest that fits in {fmt_decimal(memory)} less {fmt_decimal(headroom)} "
                     "headroom: " + (predict.name_of(fitting[0]) if fitting else "none"))
    return lines


def meta_plan_lines(module: nn.Module, world: int, units, optimizer: str = "adam",
                    memory: float | None = None, headroom: float = 0.0) -> list[str]:
    """A model on the meta device: stages 0-3 by the plan (:func:`predict_memory`: what a rank
    holds at rest, and the step's buffers at their largest), activations not counted."""
    rows = []
    for stage in range(4):
        parts = [predict.predict_memory(module, stage, world, r, units, optimizer)
                 for r in range(world)]
        rows.append((stage, max(p["parameters"] + p["optimizer state"] for p in parts),
                     max(sum(p.values()) for p in parts)))
    unit, size = _unit(max(bound for *_, bound in rows))
    lines = [f"{'':18}{'at rest ' + unit:>12}{'with step buffers':>18}"
             + ("  fits" if memory is not None else "")]
    lines += [f"{predict.name_of(stage):18}{rest / size:12.2f}{bound / size:18.2f}"
              + _fits(bound, memory, headroom) for stage, rest, bound in rows]
    return lines + ["", "On the meta device nothing runs: at rest is the plan's (the engine's "
                    "buffers by its own rules, the optimizer's state); 'with step buffers' adds "
                    f"what a step allocates beyond it ({unit}), each buffer at its largest (a "
                    "bound), the ACTIVATIONS NOT COUNTED. DDP and the step time need a dry run: "
                    "build the model on the CPU."]
