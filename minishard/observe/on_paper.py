"""A step on GPUs, on paper: its time from FLOPs and a link, beside plan.py's memory.

    python -m minishard.plan --params 8.03B --ranks 8 --memory 96GB --mixed-precision \\
        --layers 32 --hidden 4096 --heads 32 --seq 8192 --micro-batch 2 \\
        --checkpointing selective --tflops 989 --efficiency 0.4 --link 450GB --vocab 128256

``--check`` measures a step on the machine it runs on; a GPU job cannot be measured here, so its
time is a formula whose every guess is an option, printed beside the answer:

  compute     FLOPs a token: 6(Ψ - V·h) + 12·L·h·s (PaLM's appendix B, as nanoGPT's
              ``estimate_mfu`` and torchtitan count: every weight's matmul forward and
              backward, the input embedding's lookup not, attention's scores; recomputation
              not counted), over --tflops (the GPU's dense peak) x --efficiency (the model
              FLOPs utilisation the job reaches: the part of this plan most worth doubting)
  communicate the planner's bytes a rank sends a step (``memory.step_bytes``: 2Ψb(N-1)/N at
              stages 0-2, 3Ψb(N-1)/N at stage 3, b = 2 with --mixed-precision, else 4) at
              --link bytes a second, each GPU's own
  the step    a link of its own beside the computation: the longer of the two if it hides
              entirely, their sum if none of it does; tokens a GPU a second: s·b over the step
  memory      plan.py's table: the model states and Korthikanti's activations (--checkpointing
              full or selective), no logits, no allocator's reserve

bench/published_run.py holds this against published runs (bench/RESULTS.md).
"""
from __future__ import annotations

from minishard.observe.memory import step_bytes

__all__ = ["flops_per_token", "step_times", "gpu_lines", "add_arguments", "GPU_OPTIONS"]

GPU_OPTIONS = ("tflops", "efficiency", "link")


def flops_per_token(params: float, layers: int, hidden: int, seq: int, vocab: int = 0) -> float:
    """Training FLOPs a token: 6 per weight (a multiply and an add, forward, and twice that
    backward) of the Ψ - V·h weights that multiply (the input embedding's V·h rows are looked up;
    a tied output layer is counted in Ψ once, so give ``vocab`` 0 for a tied model), and
    12·L·h·s for attention's QKᵀ and its product with V (2 matmuls, 3 passes, 2 FLOPs each)."""
    return 6 * (params - vocab * hidden) + 12 * layers * hidden * seq


def step_times(params: float, ranks: int, stage: int, shape: dict, gpu: dict,
               element_bytes: int) -> dict[str, float]:
    """Seconds of one step on one GPU: computing, communicating, and the step both ways."""
    tokens = shape["seq"] * shape["micro_batch"]
    flops = tokens * flops_per_token(params, shape["layers"], shape["hidden"], shape["seq"],
                                     gpu.get("vocab") or 0)
    compute = flops / (gpu["tflops"] * 1e12 * gpu["efficiency"])
    talk = step_bytes(params, stage, ranks, element_bytes) / gpu["link"]
    return {"tokens": tokens, "compute": compute, "comm": talk,
            "hidden": max(compute, talk), "exposed": compute + talk}


def gpu_lines(params: float, ranks: int, shape: dict, gpu: dict, element_bytes: int) -> list[str]:
    """The printed time table: each stage's step and tokens a GPU a second, both ways."""
    per_token = flops_per_token(params, shape["layers"], shape["hidden"], shape["seq"],
                                gpu.get("vocab") or 0)
    lines = [f"Time on paper: {per_token / 1e9:.4g} GFLOPs a token = 6(Ψ - V·h) + 12·L·h·s "
             f"(V = {gpu.get('vocab') or 0}); {gpu['tflops']:g} TFLOPS x {gpu['efficiency']:g} "
             f"efficiency a GPU; a link of {gpu['link'] / 1e9:g} GB/s a GPU; "
             f"{shape['seq'] * shape['micro_batch']:,} tokens a GPU a step; "
             f"{8 * element_bytes}-bit elements on the wire.",
             f"{'stage':<6}{'compute s':>11}{'comm s':>9}{'step s':>17}{'tokens/s/GPU':>20}",
             f"{'':<26}{'hidden / exposed':>17}{'hidden / exposed':>20}"]
    for stage in range(4):
        t = step_times(params, ranks, stage, shape, gpu, element_bytes)
        lines.append(f"{stage:<6}{t['compute']:>11.3f}{t['comm']:>9.3f}"
                     f"{t['hidden']:>8.3f} / {t['exposed']:<6.3f}"
                     f"{t['tokens'] / t['hidden']:>11,.0f} / {t['tokens'] / t['exposed']:<,.0f}")
    return lines + ["hidden: the communication entirely behind the computation (the step is the "
                    "longer); exposed: none of it (their sum). Recomputation, kernels' "
                    "efficiency and everything else the GPU does are in --efficiency."]


def add_arguments(parser, parse_bytes) -> None:
    """plan.py's options for the time on paper (all three, with the transformer's shape)."""
    group = parser.add_argument_group(
        "time on a GPU, on paper (all three, with the transformer shape; observe/on_paper.py)")
    group.add_argument("--tflops", type=float, help="a GPU's dense peak, TFLOPS (H100 SXM "
                       "BF16: 989)")
    group.add_argument("--efficiency", type=float,
                       help="the model FLOPs utilisation to assume, 0-1 (published large runs "
                            "on H100s: 0.33-0.43)")
    group.add_argument("--link", type=parse_bytes,
                       help="bytes a second each GPU sends: 450GB (NVLink 4, one direction), "
                            "50GB (400 Gb/s between nodes)")
    group.add_argument("--vocab", type=int, default=0,
                       help="rows of an UNTIED input embedding (looked up, not multiplied)")
