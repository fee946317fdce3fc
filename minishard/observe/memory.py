"""Byte accounting: the ZeRO formulas, and terminal bar charts to show them.

The ZeRO paper's model-state memory per rank, for Ψ parameters on N ranks (activations excluded):

    bytes per parameter      params  grads  optimizer state       stage 0  stage 1     stage 2       stage 3
    fp32 training, Adam        4      4      8 (exp_avg, exp_avg_sq)  16Ψ   8Ψ + 8Ψ/N   4Ψ + 12Ψ/N    16Ψ/N
    mixed precision, Adam      2      2     12 (+ fp32 master copy)   16Ψ   4Ψ + 12Ψ/N  2Ψ + 14Ψ/N    16Ψ/N
    fp32 training, SGD+mom.    4      4      4 (momentum)

Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
Gradients are counted as *persistent* in the paper (stage 1 keeps full gradients); minishard's
stage 1 frees them at the end of backward, so its persistent gradient bytes are those of stage 2,
and the difference between the two shows up as the peak during backward instead.

Parameters kept whole on every rank (``ZeRO(replicate=..., persist_below=...)``), Ψ_r of the Ψ,
count at full size in every term: stage 3 holds 16Ψ_r + 16(Ψ - Ψ_r)/N with Adam in fp32.
"""
from __future__ import annotations

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "sgd-nomomentum": 0}


def zero_bytes(psi: float, ranks: int, stage: int, optimizer: str = "adam",
               mixed_precision: bool = False, replicated: float = 0) -> dict[str, float]:
    """Model-state bytes per rank by term, following the table in this module's docstring.
    ``replicated``: how many of the ``psi`` parameters are kept whole on every rank
    (``ZeRO(replicate=..., persist_below=...)``): their every term counts at full size."""
    if mixed_precision:  # bf16/fp16 params and grads; fp32 master copy counted with the optimizer
        p, g, k = 2, 2, OPTIMIZER_BYTES[optimizer] + 4
    else:
        p, g, k = 4, 4, OPTIMIZER_BYTES[optimizer]
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    per = {"params": p, "grads": g, "optimizer": k}
    sharded = psi - replicated
    return {term: b * (sharded / ranks if shard[term] else sharded) + b * replicated
            for term, b in per.items()}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_decimal(n: float) -> str:
    """Bytes in decimal units, three significant digits: 1.875e9 -> '1.88 GB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 999.5 or unit == "TB":  # 999.5 would print as "1e+03" with 3 digits
            return f"{n:.3g} {unit}" if abs(n) < 1000 else f"{n:,.0f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def bar_chart(rows: list[tuple[str, dict[str, float]]], width: int = 48) -> str:
    """Stacked horizontal bars, one per row: ``[(label, {part: value, ...}), ...]``.
    Each part gets its own fill character; the legend is printed below."""
    fills = "#=+.*o%@"
    parts = list(dict.fromkeys(p for _, d in rows for p in d))
    top = max((sum(d.values()) for _, d in rows), default=0) or 1
    label_w = max(len(label) for label, _ in rows)
    lines = []
    for label, d in rows:
        bar = "".join(fills[parts.index(p)] * round(width * v / top) for p, v in d.items())
        lines.append(f"{label:>{label_w}} |{bar:<{width}}| {fmt_bytes(sum(d.values()))}")
    lines.append(" " * label_w + "  " + "  ".join(f"{fills[i]} {p}" for i, p in enumerate(parts)))
    return "\n".join(lines)


def pyplot():
    """``matplotlib.pyplot`` drawing to files only, or None (saying so) when the optional
    ``plot`` extra is not installed: the tutorials' ``--plot FILE.png`` uses this."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'minishard[plot]'); skipped.")
        return None
    return plt


# ------------------------------------------------------------------------------- activations
def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int,
                               checkpointing: bool | str = False,
                               element_bytes: int = 2) -> float:
    """Activation bytes ONE transformer layer keeps for its backward, per rank (no tensor or
    sequence parallelism), from Korthikanti et al. 2022, "Reducing Activation Recomputation in
    Large Transformer Models" (arXiv:2205.05198, section 4.1 and Table 2), for sequence length
    s, micro-batch b, hidden size h, a attention heads, 16-bit activations, 1-byte dropout masks:

        attention  11sbh + 5as²b   QKV input 2, Q and K 4, V 2, projection input 2, its dropout
                                   mask 1 (all x sbh); softmax output 2, dropout mask 1, dropout
                                   output 2 (all x as²b: the scores, quadratic in s)
        MLP        19sbh           first linear's input 2, GeLU input 8, second linear's input 8
                                   (4h wide), dropout mask 1
        LayerNorms  4sbh           two inputs of 2sbh
        total      sbh(34 + 5as/h)

    With full activation checkpointing a layer keeps only its input: 2sbh (the paper's
    "full recomputation" row); ``checkpointing="selective"``, the paper's selective
    recomputation (the attention scores recomputed in backward, never stored: FlashAttention's
    way too), keeps sbh·34. ``element_bytes`` = 4 (fp32 activations) rescales the 2-byte
    items of the same itemisation, masks staying 1 byte: sbh(66 + 9as/h); that case is our
    derivation, not a number from the paper. FlashAttention-style kernels never store the
    as²b terms (the paper's "selective recomputation" keeps the same 34sbh)."""
    s, b, h, a, e = seq, micro_batch, hidden, heads, element_bytes
    if checkpointing == "selective":  # the paper's selective recomputation: scores recomputed
        return (16 * e + 2) * s * b * h
    if checkpointing:
        return e * s * b * h
    linear = (16 * e + 2) * s * b * h         # e = 2: 34 sbh (32 in 2-byte tensors + 2 masks)
    scores = (2 * e + 1) * a * s * s * b      # e = 2: 5 as²b
    return linear + scores


def activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int,
                     checkpointing: bool | str = False, element_bytes: int = 2) -> float:
    """Peak activation bytes per rank for a stack of ``layers`` transformer layers.

    Without checkpointing: layers x sbh(34 + 5as/h). With it: every layer's stored input,
    layers x 2sbh, PLUS one layer's full activations, which exist again while that layer is
    recomputed in backward (the paper's table counts the stored inputs only). Embeddings,
    the output layer and the loss (s·b·vocab logits) are not counted."""
    per = activation_bytes_per_layer(seq, micro_batch, hidden, heads, checkpointing,
                                     element_bytes)
    if checkpointing in (False, None, "selective"):  # (selective: layers x sbh·34 in 16 bits)
        return layers * per
    return layers * per + activation_bytes_per_layer(seq, micro_batch, hidden, heads, False,
                                                     element_bytes)


# ------------------------------------------------------------------------- bytes per step
def step_bytes(psi: float, stage: int, ranks: int, element_bytes: int = 4) -> float:
    """Bytes one rank sends per step under the ring model (comm.py), Ψ = ``psi`` parameters of
    ``element_bytes`` bytes on N = ``ranks`` ranks: stage 0 all-reduces the gradients,
    2Ψb(N-1)/N; stages 1-2 reduce-scatter them and all-gather the updated parameters, the
    same 2Ψb(N-1)/N; stage 3 gathers the parameters twice (forward and backward) and
    reduce-scatters the gradients, 3Ψb(N-1)/N."""
    collectives = 3 if stage == 3 else 2
    return collectives * psi * element_bytes * (ranks - 1) / ranks


def hybrid_step_bytes(psi: float, nodes: int, ranks_per_node: int,
                      element_bytes: int = 4, stage: int = 3) -> dict[str, float]:
    """Hybrid sharding (minishard's ``mesh=``): ``stage`` run over the S = ``ranks_per_node``
    ranks of a node, the state it shards replicated across the R = ``nodes`` nodes. Per rank
    per step: the stage inside the node, 2Ψb(S-1)/S at stages 1-2 (a reduce-scatter and an
    all-gather) or 3Ψb(S-1)/S at stage 3; then the rank's gradient shard (Ψ/S elements) is
    all-reduced with the ranks holding the same shard on the other nodes, 2(Ψ/S)b(R-1)/R,
    every hop of that ring crossing a node boundary.

    The same layout as FSDP1's HYBRID_SHARD (stage 3) and _HYBRID_SHARD_ZERO2 (stage 2), FSDP2
    on a 2-D mesh, and DeepSpeed's MiCS (``mics_shard_size``, stage 3). Not ZeRO++ hpZ
    (``zero_hpz_partition_size``): hpZ keeps optimizer state and gradients sharded over ALL
    N ranks and adds a secondary copy of the parameters, sharded inside a node, so that only
    the backward all-gather stays inside the node."""
    s, r, b = ranks_per_node, nodes, element_bytes
    inside = 3 if stage == 3 else 2
    return {"intra": inside * psi * b * (s - 1) / s, "cross": 2 * (psi / s) * b * (r - 1) / r}
