"""The planner beside one published large run: Llama 3 405B on 8,192 H100s (issue 54).

    python bench/published_run.py

Nothing is run: this prints what minishard's planner says about the data-parallel part of that
run (observe/memory.py's ``zero_bytes`` and ``step_bytes``: the formulas ``python -m
minishard.plan`` prints) beside the published figures, and every assumption it needs. There is
no pass line: we cannot run it. What it can say: how much of that run's step the planner's
part, ZeRO's data-parallel communication, can be, and what each stage would hold per GPU.

Published, as found by this project's search tools (2026-12-07):
  * 8,192 GPUs, tensor parallel 8, context parallel 1, pipeline parallel 16, 16M tokens a
    batch, 430 TFLOPS/GPU: P. Balaji, "Herding Llamas", SC'24, as tabled at
    glennklockwood.com/garden/llama-3.1 (which notes the table is probably the paper's too);
  * 126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads: the Llama 3
    paper (arXiv:2407.21783) as excerpted at aarnphm.xyz/thoughts/Llama-3; vocabulary 128,256;
  * H100 80 GB, 8 GPUs a server over NVLink, 400 Gbps between GPUs; MFU 38-43%.
Not published there: the H100's dense BF16 peak (NVIDIA's datasheet, 989 TFLOPS), used only
to turn 430 TFLOPS into a utilization.
"""
from minishard.observe.memory import step_bytes, zero_bytes

GPUS, TP, CP, PP = 8192, 8, 1, 16
LAYERS, D, FFN, HEADS, KV_HEADS, VOCAB = 126, 16384, 53248, 128, 8, 128256
TOKENS = 16 * 2**20            # "16M tokens": 2^20 assumed (10^6 makes the step 5% shorter)
TFLOPS = 430e12                # published, per GPU
PEAK = 989e12                  # H100 SXM dense BF16 (NVIDIA), for the utilization only
LINK = 400e9 / 8               # bytes/s: 400 Gbps each GPU, its data-parallel ring over it


def parameters() -> float:
    """Ψ from the published shape: attention (grouped keys and values), SwiGLU, two norms a
    layer, an embedding and an untied head."""
    head_dim = D // HEADS
    attention = 2 * D * D + 2 * D * KV_HEADS * head_dim
    return LAYERS * (attention + 3 * D * FFN + 2 * D) + 2 * VOCAB * D + D


def main() -> None:
    psi, model_parallel = parameters(), TP * CP * PP
    dp = GPUS // model_parallel
    part = psi / model_parallel  # assumed: each TP x PP rank holds an equal slice
    step_s = 6 * psi * TOKENS / (GPUS * TFLOPS)  # 6ΨT: weights' FLOPs only, no attention
    print(f"Llama 3 405B, {GPUS} GPUs = TP {TP} x CP {CP} x PP {PP} x DP {dp}")
    print(f"  Ψ from the shape: {psi / 1e9:.1f}e9 (published: 405e9); a DP rank's slice "
          f"Ψ/{model_parallel} = {part / 1e9:.2f}e9")
    print(f"  the step at the published {TFLOPS / 1e12:.0f} TFLOPS/GPU: 6ΨT/(GPUs x rate) = "
          f"{step_s:.1f} s ({TFLOPS / PEAK:.0%} of the H100's dense BF16 peak)")
    print(f"\n  The planner, on the slice over DP {dp} (mixed-precision Adam; GB = 1e9 B):")
    print(f"  {'stage':>7}{'model states/GPU':>18}{'DP bytes/GPU/step':>19}"
          f"{'at 400 Gbps':>13}{'of the step':>13}")
    for stage in range(4):
        held = sum(zero_bytes(part, dp, stage, "adam", mixed_precision=True).values())
        sent = step_bytes(part, stage, dp, element_bytes=2)  # bf16 on the wire
        print(f"  {stage:>7}{held / 1e9:>15.2f} GB{sent / 1e9:>16.2f} GB{sent / LINK:>11.2f} s"
              f"{sent / LINK / step_s:>13.1%}")
    print("\n  Assumed: equal slices (the embedding and head make the first and last pipeline "
          "stages heavier);\n  bf16 on the wire (an FP32 reduce-scatter doubles half of it); "
          "one ring per GPU at the link's\n  full rate; one forward and backward a step (a "
          "pipeline's micro-batches each gather again at\n  stage 3); activations, pipeline "
          "buffers and tensor-parallel traffic not counted (not the planner's).")


if __name__ == "__main__":
    main()
