"""The planner beside published runs (issues 54 and 67): Llama 3 405B on 8,192 H100s, and
torchtitan's Llama 3.1 8B on 8 H100s (its docs/performance.md, Table 1).

    python bench/published_run.py

Nothing is run here: this prints what minishard's planner says (observe/memory.py's
``zero_bytes``, ``step_bytes`` and ``activation_bytes``, observe/on_paper.py's ``step_times``:
what ``python -m minishard.plan`` prints, the command given) beside the published figures, every
assumption named. For the 8B run, predicted against published with the error; for 405B, only
what the planner's part of that run (ZeRO's data-parallel communication) can be.

Published, as found by this project's search tools:
  405B (2026-12-07) 8,192 GPUs, tensor parallel 8, context parallel 1, pipeline parallel 16,
       16M tokens a batch, 430 TFLOPS/GPU: P. Balaji, "Herding Llamas", SC'24, as tabled at
       glennklockwood.com/garden/llama-3.1; 126 layers, dimension 16,384, FFN 53,248, 128 heads,
       8 key/value heads: the Llama 3 paper (arXiv:2407.21783) as excerpted at
       aarnphm.xyz/thoughts/Llama-3; vocabulary 128,256; H100 80 GB, 400 Gbps; MFU 38-43%.
  8B   (2026-12-08) torchtitan docs/performance.md, Table 1: 1-D FSDP, 8 GPUs, local batch 2,
       selective activation checkpointing: 5,762 tokens/s/GPU, 82.4 GiB; H100 SXM with 96 GB
       HBM2e at a 500 W limit ("the actual peak TFLOPs ... between SXM and NVL"); 8B without
       Float8 at 33-39% MFU. torchtitan's llama3_8b.toml: seq_len 8192, AdamW, selective AC by
       op; Llama 3.1 8B's shape: 32 layers, 4,096 wide, FFN 14,336, 32 heads, 8 KV heads.
Not published there: the H100's dense BF16 peak (NVIDIA's datasheet, 989 TFLOPS, torchtitan's
own MFU denominator), NVLink 4's 450 GB/s a direction.
"""
from minishard.observe.memory import activation_bytes, step_bytes, zero_bytes
from minishard.observe.on_paper import flops_per_token, step_times

PEAK = 989e12  # H100 SXM dense BF16 (NVIDIA)


def llama_params(layers: int, d: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> int:
    """Ψ from a Llama shape: attention (grouped keys and values), SwiGLU, two norms a layer, an
    input embedding and an untied head, a final norm."""
    attention = 2 * d * d + 2 * d * kv_heads * (d // heads)
    return layers * (attention + 3 * d * ffn + 2 * d) + 2 * vocab * d + d


def llama_405b() -> None:
    gpus, tp, cp, pp, tokens, tflops = 8192, 8, 1, 16, 16 * 2**20, 430e12
    link = 400e9 / 8  # bytes/s: 400 Gbps each GPU, its data-parallel ring over it
    psi, model_parallel = llama_params(126, 16384, 53248, 128, 8, 128256), tp * cp * pp
    dp = gpus // model_parallel
    part = psi / model_parallel  # assumed: each TP x PP rank holds an equal slice
    step_s = 6 * psi * tokens / (gpus * tflops)  # 6ΨT: weights' FLOPs only, no attention
    print(f"Llama 3 405B, {gpus} GPUs = TP {tp} x CP {cp} x PP {pp} x DP {dp}")
    print(f"  Ψ from the shape: {psi / 1e9:.1f}e9 (published: 405e9); a DP rank's slice "
          f"Ψ/{model_parallel} = {part / 1e9:.2f}e9")
    print(f"  the step at the published {tflops / 1e12:.0f} TFLOPS/GPU: 6ΨT/(GPUs x rate) = "
          f"{step_s:.1f} s ({tflops / PEAK:.0%} of the H100's dense BF16 peak)")
    print(f"\n  The planner, on the slice over DP {dp} (mixed-precision Adam; GB = 1e9 B):")
    print(f"  {'stage':>7}{'model states/GPU':>18}{'DP bytes/GPU/step':>19}"
          f"{'at 400 Gbps':>13}{'of the step':>13}")
    for stage in range(4):
        held = sum(zero_bytes(part, dp, stage, "adam", mixed_precision=True).values())
        sent = step_bytes(part, stage, dp, element_bytes=2)  # bf16 on the wire
        print(f"  {stage:>7}{held / 1e9:>15.2f} GB{sent / 1e9:>16.2f} GB{sent / link:>11.2f} s"
              f"{sent / link / step_s:>13.1%}")
    print("\n  Assumed: equal slices (the embedding and head make the first and last pipeline "
          "stages heavier);\n  bf16 on the wire (an FP32 reduce-scatter doubles half of it); "
          "one ring per GPU at the link's\n  full rate; one forward and backward a step (a "
          "pipeline's micro-batches each gather again at\n  stage 3); activations, pipeline "
          "buffers and tensor-parallel traffic not counted (not the planner's).")


def error(predicted: float, published: float, places: int = 0) -> str:
    return f"{predicted - published:+,.{places}f} ({(predicted - published) / published:+.1%})"


def torchtitan_8b(efficiency: float = 0.40) -> None:
    layers, d, heads, seq, batch, vocab, gpus = 32, 4096, 32, 8192, 2, 128256, 8
    psi = llama_params(layers, d, 14336, heads, 8, vocab)
    shape = {"layers": layers, "hidden": d, "heads": heads, "seq": seq, "micro_batch": batch}
    gpu = {"tflops": PEAK / 1e12, "efficiency": efficiency, "link": 450e9, "vocab": vocab}
    times = step_times(psi, gpus, 3, shape, gpu, element_bytes=2)  # FSDP: stage 3, bf16 gathers
    states = sum(zero_bytes(psi, gpus, 3, "adam", mixed_precision=True).values())
    acts = activation_bytes(layers, seq, batch, d, heads, checkpointing="selective")
    published_tps, published_gib = 5762, 82.4
    implied = published_tps * flops_per_token(psi, layers, d, seq, vocab) / PEAK
    print(f"\nLlama 3.1 8B, FSDP on {gpus} H100s (torchtitan, Table 1), Ψ from the shape "
          f"{psi:,}")
    print(f"  python -m minishard.plan --params {psi} --ranks {gpus} --memory 96GB "
          f"--mixed-precision --layers {layers} --hidden {d} --heads {heads} --seq {seq} "
          f"--micro-batch {batch} --checkpointing selective --tflops 989 --efficiency "
          f"{efficiency} --link 450GB --vocab {vocab}")
    print(f"  {'':34}{'predicted':>12}{'published':>12}  error")
    for what, hidden in (("tokens/s/GPU, comm hidden", True), ("tokens/s/GPU, comm exposed",
                                                               False)):
        tps = times["tokens"] / times["hidden" if hidden else "exposed"]
        print(f"  {what:34}{tps:>12,.0f}{published_tps:>12,}  {error(tps, published_tps)}")
    gib = (states + acts) / 2**30
    print(f"  {'GiB per GPU (stage 3 + activations)':34}{gib:>12.1f}{published_gib:>12.1f}  "
          f"{error(gib, published_gib, 1)}")
    print(f"\n  Assumed: {efficiency:.0%} model FLOPs utilisation (the 405B run's published "
          f"38-43%); 989 TFLOPS; 450 GB/s a GPU;\n  bf16 on the wire. The published "
          f"tokens/s imply {implied:.1%} (torchtitan's own note: 33-39%): the time is as good "
          f"as the\n  efficiency assumed, and its GPUs ran at 500 W. Memory: model states "
          f"16Ψ/8 = {states / 2**30:.1f} GiB, activations\n  L·34·s·b·h = {acts / 2**30:.1f} "
          f"GiB (GPT's itemisation, Korthikanti's selective recomputation). Not counted: the "
          f"logits\n  (s·b·V in bf16: {2 * seq * batch * vocab / 2**30:.1f} GiB), stage 3's "
          f"gathered layers, the allocator's reserve; counted that Llama has not:\n  dropout "
          f"masks (2·s·b·h·L = {2 * seq * batch * d * layers / 2**30:.1f} GiB), GPT's 4h MLP "
          f"for Llama's SwiGLU at 3.5h, full K and V for 8 KV heads.\n  The agreement is "
          f"closer than the itemisation deserves.")


if __name__ == "__main__":
    llama_405b()
    torchtitan_8b()
