"""Which ZeRO stage fits? The ZeRO paper's memory formulas as a command-line estimator.

    python -m minishard.plan --params 7e9 --ranks 8 --memory 80GB --mixed-precision

prints, for stages 0-3, the model-state bytes one rank holds (parameters, gradients, optimizer
state; the formulas are ``minishard.memory.zero_bytes``), which stages fit in ``--memory``, and a
recommendation: the LOWEST stage that fits, because each stage up saves memory by communicating
more (stage 3: 1.5x the bytes of stages 0-2) or at least more often.

Assumptions (the paper's, section 3):
  * model states only: activations, temporary buffers, the framework and memory fragmentation are
    NOT counted. They can be large (activations grow with batch size and sequence length): a stage
    "fits" here only if what is left over holds them. The "left" column says how much that is.
  * bytes per parameter: fp32 Adam 4 + 4 + 8 (params, grads, exp_avg + exp_avg_sq); mixed
    precision Adam 2 + 2 + K with K = 12 (fp32 master params + the two Adam moments); SGD with
    momentum K = 4 (plus 4 for the master copy in mixed precision).
  * stage 1 counts full gradients (the paper's accounting). minishard frees them at the end of
    backward, so they are a peak, not a resident cost; the peak is what has to fit.
  * GB = 10^9 bytes (as in the paper); GiB = 2^30.

The paper's Figure 1 (7.5B parameters, 64 ranks, mixed-precision Adam): 120 GB, 31.4 GB, 16.6 GB,
1.88 GB per rank for stages 0-3. ``python -m minishard.plan --params 7.5e9 --ranks 64
--memory 80GB --mixed-precision`` prints those numbers (tests/test_plan.py checks it).
"""
from __future__ import annotations

import argparse
import math
import re
import textwrap

from minishard.memory import OPTIMIZER_BYTES, zero_bytes

__all__ = ["parse_bytes", "fmt_decimal", "estimate", "min_ranks", "report", "main"]

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '24G' -> 24e9, '1.5e10' or '1000' -> bytes.
    Decimal units (K, M, G, T, with or without B) are powers of 10, binary ones (KiB, MiB, GiB,
    TiB, or Ki, Mi, Gi, Ti) powers of 2, as in Kubernetes and the SI/IEC prefixes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text, re.IGNORECASE)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 80GB, 80GiB, 24G or bytes")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def fmt_decimal(n: float) -> str:
    """Bytes in decimal units, three significant digits: 1.875e9 -> '1.88 GB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 999.5 or unit == "TB":  # 999.5 would print as "1e+03" with 3 digits
            return f"{n:.3g} {unit}" if abs(n) < 1000 else f"{n:,.0f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def estimate(params: float, ranks: int, memory: float, optimizer: str = "adam",
             mixed_precision: bool = False) -> list[dict]:
    """One row per stage: the per-rank bytes by term, their total, what is left, whether it fits."""
    rows = []
    for stage in range(4):
        terms = zero_bytes(params, ranks, stage, optimizer, mixed_precision)
        total = sum(terms.values())
        rows.append({"stage": stage, **terms, "total": total, "left": memory - total,
                     "fits": total <= memory})
    return rows


def min_ranks(params: float, memory: float, stage: int, optimizer: str = "adam",
              mixed_precision: bool = False) -> int | None:
    """The fewest ranks with which ``stage`` fits in ``memory`` (model states only), or None if
    no number of ranks does (the unsharded terms alone exceed it)."""
    full = zero_bytes(params, 1, stage, optimizer, mixed_precision)   # every term at N = 1
    sharded = zero_bytes(params, 2, stage, optimizer, mixed_precision)
    fixed = sum(v for k, v in full.items() if sharded[k] == v)         # terms not divided by N
    divisible = sum(full.values()) - fixed
    if fixed > memory or (divisible > 0 and fixed == memory):
        return None
    return 1 if divisible == 0 else max(1, math.ceil(divisible / (memory - fixed)))


def report(params: float, ranks: int, memory: float, optimizer: str = "adam",
           mixed_precision: bool = False) -> str:
    rows = estimate(params, ranks, memory, optimizer, mixed_precision)
    k = zero_bytes(1, 1, 0, optimizer, mixed_precision)
    precision = "mixed precision (bf16/fp16 params and grads)" if mixed_precision else "fp32"
    lines = [
        f"{params:,.0f} parameters on {ranks} ranks with {fmt_decimal(memory)} each, "
        f"{precision}, {optimizer}:",
        f"bytes per parameter: params {k['params']:g}, grads {k['grads']:g}, optimizer state "
        f"{k['optimizer']:g} (K{', with the fp32 master copy' if mixed_precision else ''})",
        "model states only: activations, temporary buffers and fragmentation are NOT counted.",
        "",
        f"{'stage':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}{'left':>11}  fits",
    ]
    for r in rows:
        lines.append(f"{r['stage']:<6}" + "".join(
            f"{fmt_decimal(r[t]):>11}" for t in ("params", "grads", "optimizer", "total", "left"))
            + f"  {'yes' if r['fits'] else 'no'}")
    lines.append("")
    fitting = [r["stage"] for r in rows if r["fits"]]
    if fitting and fitting[0] == 0:
        advice = ("Recommendation: stage 0. If the model fits, plain DDP (stage 0) is simplest "
                  "and fastest: nothing to gather, one all-reduce of the gradients per step. "
                  "Higher stages only buy room for activations (larger batches).")
    elif fitting:
        s = fitting[0]
        advice = (f"Recommendation: stage {s}, the lowest stage that fits (stages 1-2 send the "
                  "same bytes as DDP; stage 3 sends 1.5x as many, gathering parameters in "
                  "every forward and backward).")
    else:
        need = min_ranks(params, memory, 3, optimizer, mixed_precision)
        advice = (f"Recommendation: nothing fits on {ranks} ranks. Stage 3 needs at least "
                  f"{need} ranks of this size for the model states alone; otherwise offload "
                  "optimizer state to CPU or split the model (tensor/pipeline parallelism).")
    return "\n".join(lines + textwrap.wrap(advice, 100))


def _memory_arg(text: str) -> float:
    try:
        return parse_bytes(text)
    except ValueError as exc:  # argparse then prints our message, not "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minishard.plan",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, required=True, help="parameters, e.g. 7e9")
    parser.add_argument("--ranks", type=int, required=True, help="data-parallel ranks (devices)")
    parser.add_argument("--memory", type=_memory_arg, required=True,
                        help="memory per rank: 80GB (10^9), 80GiB (2^30), 24G, or bytes")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bf16/fp16 params and grads with an fp32 master copy")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_BYTES))
    args = parser.parse_args(argv)
    if args.params <= 0 or args.ranks < 1 or args.memory <= 0:
        parser.error("--params, --ranks and --memory must be positive")
    print(report(args.params, args.ranks, args.memory, args.optimizer, args.mixed_precision))


if __name__ == "__main__":
    main()
