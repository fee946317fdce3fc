"""Which ZeRO stage fits? The ZeRO paper's memory formulas, activations and communication as a
command-line estimator.

    python -m minishard.plan --params 7B --ranks 8 --memory 80GB --mixed-precision
    python -m minishard.plan --params 1.3e9 --ranks 4 --memory 24GB --mixed-precision \\
        --layers 24 --hidden 2048 --heads 16 --seq 2048 --micro-batch 4 [--checkpointing]
    python -m minishard.plan --params 70B --nodes 4 --ranks-per-node 8 --memory 80GB \\
        --mixed-precision

prints, for stages 0-3, the bytes one rank holds (model states: ``observe.memory.zero_bytes``;
the activations of a transformer of the given shape: ``activation_bytes``), which stages fit in
``--memory`` minus a stated headroom, and the LOWEST stage that fits: each stage up saves memory
by communicating more (stage 3: 1.5x the bytes of stages 0-2) or at least more often.

  model states   bytes a parameter (the ZeRO paper, section 3): fp32 Adam 4 + 4 + 8, mixed
                 precision Adam 2 + 2 + 12; SGD with momentum K = 4 (+ 4, the master copy, in
                 mixed precision). Stage 1 counts full gradients: a peak, and the peak must fit
  activations    Korthikanti et al. 2022 (arXiv:2205.05198), per layer: sbh(34 + 5as/h) bytes
                 in 16 bits, sbh(66 + 9as/h) in fp32, 2sbh with --checkpointing; only with a shape
  headroom       --headroom (default 10%), kept free for what neither formula counts
  GB             10^9 bytes (the paper's), GiB 2^30; in full: [Note: assumptions] in plan.py

--nodes R --ranks-per-node S (N = R·S ranks) adds a table: bytes per rank per step
(``step_bytes``, b bytes an element), and the choice that fits with the fewest bytes crossing
nodes (why a ring over all N counts wholly: [Note: crosses nodes] in nodes.py):

    DDP, stages 1-2     2Ψb(N-1)/N      all of it crosses nodes when R > 1
    stage 3             3Ψb(N-1)/N      all of it crosses nodes when R > 1
    hybrid stages 1-2   2Ψb(S-1)/S inside the node  +  2(Ψ/S)b(R-1)/R across nodes
    hybrid stage 3      3Ψb(S-1)/S inside the node  +  2(Ψ/S)b(R-1)/R across nodes
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap

from minishard.observe.memory import OPTIMIZER_BYTES, activation_bytes, fmt_decimal, zero_bytes
from minishard.observe.nodes import choices, left_words, multi_node_lines, recommend_choice
from minishard.observe.on_paper import GPU_OPTIONS, add_arguments, gpu_lines

__all__ = ["parse_bytes", "parse_count", "parse_headroom", "fmt_decimal", "estimate",
           "min_ranks", "choices", "report", "main"]

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_COUNTS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*"
DEFAULT_HEADROOM = "10%"


def parse_bytes(text: str) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '24G' -> 24e9, '1.5e10' or '1000' -> bytes.
    Decimal units (K, M, G, T, with or without B) are powers of 10, binary ones (KiB, MiB, GiB,
    TiB, or Ki, Mi, Gi, Ti) powers of 2, as in Kubernetes and the SI/IEC prefixes."""
    match = re.fullmatch(_NUMBER, text, re.IGNORECASE)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 80GB, 80GiB, 24G or bytes")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_count(text: str) -> float:
    """A parameter count: '7B' or '7b' -> 7e9 (B = billion, as model names use it), '70B',
    '1.3e9', '350M', '125m', '1.5T', '7000000000'."""
    match = re.fullmatch(_NUMBER, text, re.IGNORECASE)
    if not match or match.group(2).upper() not in _COUNTS:
        raise ValueError(f"cannot read {text!r} as a parameter count: use e.g. 7B, 70b, 350M, "
                         "1.3e9 or 7000000000")
    return float(match.group(1)) * _COUNTS[match.group(2).upper()]


def parse_headroom(text: str, memory: float) -> float:
    """'10%' -> a tenth of ``memory``; '2GB' (any size parse_bytes reads) -> those bytes."""
    text = text.strip()
    if text.endswith("%"):
        pct = float(parse_count(text[:-1]))
        if not 0 <= pct < 100:
            raise ValueError(f"headroom {text!r}: a percentage must be in [0, 100)")
        return memory * pct / 100
    return parse_bytes(text)


# [Note: assumptions] What the estimate counts, in full:
# * model states (the ZeRO paper, section 3). Bytes per parameter: fp32 Adam 4 + 4 + 8 (params,
#   grads, exp_avg + exp_avg_sq); mixed precision Adam 2 + 2 + K with K = 12 (fp32 master
#   params + the two Adam moments); SGD with momentum K = 4 (plus 4 for the master copy in mixed
#   precision). Stage 1 counts full gradients (the paper's accounting); minishard frees them at
#   the end of backward, so they are a peak, not a resident cost; the peak is what has to fit.
# * activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
#   Transformer Models", arXiv:2205.05198): sbh(34 + 5as/h) bytes per layer with 16-bit
#   activations (s sequence, b micro-batch, h hidden, a heads), 2sbh per layer with full
#   activation checkpointing plus one layer recomputed at a time
#   (``minishard.observe.memory.activation_bytes``); without --mixed-precision the activations
#   are fp32, sbh(66 + 9as/h) (the same itemisation at 4 bytes, masks 1 byte: our rescaling, not
#   the paper's number). Only counted when the shape is given; otherwise the "left" column is
#   what remains for them, and the recommendation says how much that is.
# * headroom (``--headroom``, default 10%): kept free for what neither formula counts (the
#   framework and allocator, fragmentation, temporary buffers, stage 3's gathered units, the
#   logits of the output layer). A stage fits when states + activations <= memory - headroom.
# * GB = 10^9 bytes (as in the paper); GiB = 2^30.
# The paper's Figure 1 (7.5B parameters, 64 ranks, mixed-precision Adam): 120 GB, 31.4 GB,
# 16.6 GB, 1.88 GB per rank for stages 0-3. ``python -m minishard.plan --params 7.5e9 --ranks 64
# --memory 80GB --mixed-precision`` prints those numbers (tests/test_plan.py checks it, and the
# paper's Table 1: all 54 cells of 7.5B / 128B / 1T parameters on 1 to 1024 ranks).
def estimate(params: float, ranks: int, memory: float, optimizer: str = "adam",
             mixed_precision: bool = False, headroom: float = 0.0,
             activations: float = 0.0, replicated: float = 0) -> list[dict]:
    """One row per stage: the per-rank bytes by term, their total (model states), the
    activations, what is left of ``memory - headroom`` after both, and whether that is >= 0.
    ``replicated``: parameters kept whole on every rank (``ZeRO(persist_below=...)``)."""
    rows = []
    for stage in range(4):
        terms = zero_bytes(params, ranks, stage, optimizer, mixed_precision, replicated)
        total = sum(terms.values())
        left = memory - headroom - total - activations
        rows.append({"stage": stage, **terms, "total": total, "activations": activations,
                     "left": left, "fits": left >= 0})
    return rows


def min_ranks(params: float, memory: float, stage: int, optimizer: str = "adam",
              mixed_precision: bool = False, replicated: float = 0) -> int | None:
    """The fewest ranks with which ``stage`` fits in ``memory`` (model states only), or None if
    no number of ranks does (the unsharded terms alone exceed it)."""
    one, two = (sum(zero_bytes(params, n, stage, optimizer, mixed_precision,
                               replicated).values()) for n in (1, 2))
    divisible = 2 * (one - two)  # the states are fixed + divisible / N
    fixed = one - divisible
    if fixed > memory or (divisible > 0 and fixed == memory):
        return None
    return 1 if divisible == 0 else max(1, math.ceil(divisible / (memory - fixed)))


def _activation_lines(shape: dict | None, element_bytes: int) -> tuple[list[str], float]:
    if shape is None:
        return (["activations NOT counted (give --layers --hidden --heads --seq --micro-batch "
                 "to count them): the 'left' column is what remains for them."], 0.0)
    dims = {k: shape[k] for k in ("layers", "seq", "micro_batch", "hidden", "heads")}
    plain = activation_bytes(**dims, checkpointing=False, element_bytes=element_bytes)
    ckpt = activation_bytes(**dims, checkpointing=True, element_bytes=element_bytes)
    selective = activation_bytes(**dims, checkpointing="selective", element_bytes=element_bytes)
    how = shape["checkpointing"]
    used = {"selective": selective, "full": ckpt, True: ckpt}.get(how, plain)
    formula, ckpt_formula = activation_formulas(element_bytes)
    source = ("the paper's 16-bit itemisation" if element_bytes == 2 else
              "the paper's itemisation with fp32 tensors (4 bytes), masks 1 byte: our rescaling")
    lines = [
        f"activations per rank (Korthikanti et al. 2022; {8 * element_bytes}-bit activations, "
        f"{source}): {formula} without checkpointing, {ckpt_formula} with full activation "
        f"checkpointing, for L={shape['layers']} layers, s={shape['seq']}, "
        f"b={shape['micro_batch']}, h={shape['hidden']}, a={shape['heads']}: "
        f"{fmt_decimal(plain)} without, {fmt_decimal(ckpt)} with; with selective recomputation "
        f"(the paper's: attention's scores recomputed, never stored) "
        f"L·s·b·h·{16 * element_bytes + 2}: {fmt_decimal(selective)}. Counted: "
        f"{'without' if not how else 'selective' if how == 'selective' else 'with full'}."]
    return lines, used


def activation_formulas(element_bytes: int) -> tuple[str, str]:
    """memory.activation_bytes as printed: (without checkpointing, with it), e-byte tensors and
    1-byte dropout masks: per layer (16e + 2)sbh + (2e + 1)as²b; checkpointed, every layer's
    e·sbh input plus one layer recomputed."""
    e = element_bytes
    layer = f"s·b·h·({16 * e + 2} + {2 * e + 1}·a·s/h)"
    return f"L·{layer}", f"L·{e}·s·b·h + {layer}"


# The model-state bytes per rank that memory.zero_bytes computes, written as the header prints
# them (tests/test_plan.py evaluates these strings against the printed table).
STATE_FORMULAS = {0: "(p + g + K)·Ψ", 1: "(p + g)·Ψ + K·Ψ/N", 2: "p·Ψ + (g + K)·Ψ/N",
                  3: "(p + g + K)·Ψ/N"}


def _dtypes(optimizer: str, mixed_precision: bool) -> str:
    """What the bytes per parameter assume, in words."""
    state = {"adam": "exp_avg + exp_avg_sq", "adamw": "exp_avg + exp_avg_sq",
             "sgd": "momentum", "sgd-nomomentum": "nothing"}[optimizer]
    if mixed_precision:
        return f"bf16/fp16 params and grads, fp32 master params + fp32 {state}"
    return f"fp32 params and grads, fp32 {state}"


def report(params: float, ranks: int, memory: float, optimizer: str = "adam",
           mixed_precision: bool = False, headroom: float = 0.0, shape: dict | None = None,
           nodes: int | None = None, replicated: float = 0, gpu: dict | None = None) -> str:
    """The printed estimate. ``shape``: {layers, seq, micro_batch, hidden, heads,
    checkpointing} or None; ``nodes``: with ``ranks`` ranks per node, adds the multi-node table;
    ``replicated``: parameters kept whole on every rank, counted at full size; ``gpu``:
    {tflops, efficiency, link, vocab}, the time on paper (observe/on_paper.py), with a shape."""
    elem = 2 if mixed_precision else 4
    world = ranks * (nodes or 1)
    act_lines, acts = _activation_lines(shape, elem)
    rows = estimate(params, world, memory, optimizer, mixed_precision, headroom, acts,
                    replicated)
    k = zero_bytes(1, 1, 0, optimizer, mixed_precision)
    precision = "mixed precision (bf16/fp16 params and grads)" if mixed_precision else "fp32"
    where = f"{nodes} nodes x {ranks} ranks" if nodes else f"{ranks} ranks"
    lines = [
        f"{params:,.0f} parameters on {where} with {fmt_decimal(memory)} each, "
        f"{precision}, {optimizer}:",
        *textwrap.wrap(
            f"bytes per parameter: p = {k['params']:g} (params), g = {k['grads']:g} (grads), "
            f"K = {k['optimizer']:g} (optimizer state): {_dtypes(optimizer, mixed_precision)}."
            f" Model states per rank, Ψ = {params:,.0f}, N = {world}: " + "; ".join(
                f"stage {stage} {formula}" for stage, formula in STATE_FORMULAS.items()) + ".",
            100),
        f"headroom kept free: {fmt_decimal(headroom)} (framework, fragmentation, temporary "
        f"buffers): {fmt_decimal(memory - headroom)} usable per rank.",
        *textwrap.wrap(f"{replicated:,.0f} of the parameters kept whole on every rank "
                       "(--replicated): every term counts them at full size." if replicated
                       else "", 100),
        *textwrap.wrap(" ".join(act_lines), 100),
        "",
    ]
    act_col = shape is not None
    head = f"{'stage':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}"
    lines.append(head + (f"{'activations':>13}" if act_col else "") + f"{'left':>11}  fits")
    for r in rows:
        cells = "".join(f"{fmt_decimal(r[t]):>11}" for t in ("params", "grads", "optimizer",
                                                            "total"))
        if act_col:
            cells += f"{fmt_decimal(r['activations']):>13}"
        lines.append(f"{r['stage']:<6}{cells}{fmt_decimal(r['left']):>11}  "
                     f"{'yes' if r['fits'] else 'no'}")
    lines.append("")
    if gpu is not None:
        lines += [line for text in gpu_lines(params, world, shape, gpu, elem)
                  for line in (textwrap.wrap(text, 100) if len(text) > 100 else [text])] + [""]
    if nodes:
        lines += multi_node_lines(params, nodes, ranks, memory, optimizer, mixed_precision,
                                  headroom, acts, act_col, replicated)
    else:
        lines += textwrap.wrap(_advice(rows, params, world, memory - headroom - acts, optimizer,
                                       mixed_precision, act_col, shape, replicated), 100)
    return "\n".join(lines)


def _advice(rows, params, world, usable, optimizer, mixed_precision, counted, shape,
            replicated) -> str:
    fitting = [r for r in rows if r["fits"]]
    if fitting and fitting[0]["stage"] == 0:
        return (f"Recommendation: stage 0; {left_words(fitting[0], counted)}. If the model "
                "fits, plain DDP (stage 0) is simplest and fastest: nothing to gather, one "
                "all-reduce of the gradients per step. Higher stages only buy room for "
                "activations (larger batches).")
    if fitting:
        s = fitting[0]
        return (f"Recommendation: stage {s['stage']}, the lowest stage that fits; "
                f"{left_words(s, counted)} (stages 1-2 send the same bytes as DDP; stage 3 "
                "sends 1.5x as many, gathering parameters in every forward and backward).")
    hint = ""
    if shape is not None and not shape["checkpointing"]:
        hint = (" Or activation checkpointing (--checkpointing: each layer keeps its 2sbh input "
                "and is recomputed in backward).")
    need = (min_ranks(params, usable, 3, optimizer, mixed_precision, replicated) if usable > 0
            else None)
    if need is None:
        return (f"Recommendation: nothing fits on {world} ranks, at any number of ranks: the "
                "activations and headroom alone fill the memory. Use a smaller micro-batch or "
                "sequence." + hint)
    return (f"Recommendation: nothing fits on {world} ranks. Stage 3 needs at least {need} "
            "ranks of this size for the model states"
            + (" and activations" if counted else " alone")
            + "; otherwise offload optimizer state to CPU or split the model (tensor/pipeline "
            "parallelism)." + hint)


def _arg(parse):
    def convert(text: str) -> float:
        try:
            return parse(text)
        except ValueError as exc:  # argparse then prints our message, not "invalid value"
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


_memory_arg = _arg(parse_bytes)
_SHAPE = ("layers", "hidden", "heads", "seq", "micro_batch")


def _check_ranks(parser, args) -> bool:
    """--ranks, or --nodes with --ranks-per-node, checked; True for the multi-node form."""
    multi = args.nodes is not None or args.ranks_per_node is not None
    if multi:
        if args.nodes is None or args.ranks_per_node is None:
            parser.error("--nodes and --ranks-per-node go together")
        if args.nodes < 1 or args.ranks_per_node < 1:
            parser.error("--nodes and --ranks-per-node must be positive")
        if args.ranks is not None and args.ranks != args.nodes * args.ranks_per_node:
            parser.error(f"--ranks {args.ranks} is not --nodes x --ranks-per-node = "
                         f"{args.nodes * args.ranks_per_node}: give one or the other")
    elif args.ranks is None:
        parser.error("give --ranks, or --nodes and --ranks-per-node")
    elif args.ranks < 1:
        parser.error("--ranks must be positive")
    return multi


def _headroom(parser, args) -> float:
    try:
        headroom = parse_headroom(args.headroom, args.memory)
    except ValueError as exc:
        parser.error(str(exc))
    if headroom >= args.memory:
        parser.error(f"--headroom {args.headroom} leaves nothing of --memory")
    return headroom


def _gpu(parser, args, shape: dict | None) -> dict | None:
    """--tflops, --efficiency and --link, checked: all three with a shape, or none."""
    given = [getattr(args, n) is not None for n in GPU_OPTIONS]
    if not any(given):
        return None
    if not all(given) or shape is None:
        parser.error("the time on paper needs --tflops, --efficiency and --link together, with "
                     "the transformer shape (--layers ... --micro-batch)")
    if args.tflops <= 0 or args.link <= 0 or not 0 < args.efficiency <= 1:
        parser.error("--tflops and --link must be positive, --efficiency in (0, 1]")
    return {n: getattr(args, n) for n in (*GPU_OPTIONS, "vocab")}


def _dry_run_arguments(parser) -> None:
    """--model, --check, --timeline: a model's own step, run here (observe/model_plan.py)."""
    parser.add_argument("--model", metavar="mlp|gpt|FILE.py:FUNCTION",
                        help="plan this model on --ranks (default 2): DDP and stages 0-3, what "
                             "a rank holds, its step's peak and time (FUNCTION() returns "
                             "{'model', 'batch', 'units', 'loss'}: tutorials/planning.md)")
    parser.add_argument("--check", action="store_true",
                        help="under torchrun: predict --model's step (default mlp) with DDP and "
                             "stages 0-3, then measure it here")
    parser.add_argument("--timeline", metavar="SYSTEM", choices=("ddp", "0", "1", "2", "3"),
                        help="dry runs here of --model (default mlp) on --ranks (default 2): "
                             "DDP and stages 0-3 predicted, SYSTEM's step on every rank in time")
    parser.add_argument("--wire", action="store_true",
                        help="--timeline as if collectives had a link of their own (a GPU's)")
    parser.add_argument("--steps", type=int,
                        help="steps timed a system (defaults: --check 20, --timeline 10, "
                             "--model 5)")


class _Parser(argparse.ArgumentParser):
    """An error is one line (on rank 0 alone under torchrun), then exit status 2."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="python -m minishard.plan",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    _dry_run_arguments(parser)
    parser.add_argument("--params", type=_arg(parse_count), help="parameters: 7B, 70b, 350M, 1.3e9")
    parser.add_argument("--ranks", type=int, help="data-parallel ranks (devices), one node")
    parser.add_argument("--nodes", type=int, help="nodes (with --ranks-per-node)")
    parser.add_argument("--ranks-per-node", type=int, help="ranks on each node")
    parser.add_argument("--memory", type=_memory_arg,
                        help="memory per rank: 80GB (10^9), 80GiB (2^30), 24G, or bytes")
    parser.add_argument("--headroom", default=DEFAULT_HEADROOM,
                        help=f"kept free per rank: a percentage of --memory or a size "
                             f"(default {DEFAULT_HEADROOM.replace('%', '%%')})")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bf16/fp16 params and grads with an fp32 master copy")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_BYTES))
    parser.add_argument("--replicated", type=_arg(parse_count), default=0,
                        help="of --params, how many are kept whole on every rank "
                             "(ZeRO(replicate=..., persist_below=...)): e.g. 50M")
    shape = parser.add_argument_group("transformer shape (all five, to count activations)")
    for name in _SHAPE:
        shape.add_argument("--" + name.replace("_", "-"), type=int)
    shape.add_argument("--checkpointing", nargs="?", const="full", choices=("full", "selective"),
                       help="activation checkpointing: full (recompute each layer in backward; "
                            "the default) or selective (recompute attention's scores)")
    add_arguments(parser, _memory_arg)
    args = parser.parse_args(argv)
    if args.check or args.timeline or args.model:
        from minishard.observe import model_plan  # (torch and the engine: only for these)
        headroom = _headroom(parser, args) if args.memory is not None else 0.0
        return model_plan.command(parser, args, sys.argv[1:] if argv is None else argv, headroom)
    if args.params is None or args.memory is None:
        parser.error("give --params and --memory (or --timeline, or --check under torchrun)")
    if args.params <= 0 or args.memory <= 0:
        parser.error("--params and --memory must be positive")
    if not 0 <= args.replicated <= args.params:
        parser.error("--replicated counts some of --params: between 0 and --params")
    multi = _check_ranks(parser, args)
    given = [n for n in _SHAPE if getattr(args, n) is not None]
    if given and len(given) < len(_SHAPE):
        missing = ", ".join("--" + n.replace("_", "-") for n in _SHAPE if n not in given)
        parser.error(f"to count activations give the whole transformer shape; missing {missing}")
    if any(getattr(args, n) is not None and getattr(args, n) < 1 for n in _SHAPE):
        parser.error("the transformer shape's numbers must be positive")
    if args.checkpointing and not given:
        parser.error("--checkpointing needs the transformer shape (--layers ... --micro-batch)")
    headroom = _headroom(parser, args)
    shape_d = ({n: getattr(args, n) for n in _SHAPE} | {"checkpointing": args.checkpointing}
               if given else None)
    gpu = _gpu(parser, args, shape_d)
    per_node = args.ranks_per_node if multi else args.ranks
    print(report(args.params, per_node, args.memory, args.optimizer, args.mixed_precision,
                 headroom, shape_d, args.nodes if multi else None, args.replicated, gpu))


if __name__ == "__main__":
    main()
