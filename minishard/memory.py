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
"""
from __future__ import annotations

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "sgd-nomomentum": 0}


def zero_bytes(psi: float, ranks: int, stage: int, optimizer: str = "adam",
               mixed_precision: bool = False) -> dict[str, float]:
    """Model-state bytes per rank by term, following the table in this module's docstring."""
    if mixed_precision:  # bf16/fp16 params and grads; fp32 master copy counted with the optimizer
        p, g, k = 2, 2, OPTIMIZER_BYTES[optimizer] + 4
    else:
        p, g, k = 4, 4, OPTIMIZER_BYTES[optimizer]
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    per = {"params": p * psi, "grads": g * psi, "optimizer": k * psi}
    return {term: b / ranks if shard[term] else b for term, b in per.items()}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
