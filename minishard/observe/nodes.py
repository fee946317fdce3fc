"""Several nodes: DDP, stages 1-3 over every rank and hybrid stages 1-3, side by side, with the
bytes each sends inside a node and across nodes (``python -m minishard.plan --nodes R
--ranks-per-node S``; plan.py prints the table this module computes).
"""
from __future__ import annotations

import textwrap

from minishard.observe.memory import fmt_decimal, hybrid_step_bytes, step_bytes, zero_bytes

__all__ = ["choices", "recommend_choice", "multi_node_lines", "MULTI_NODE_FORMULAS",
           "left_words"]


def left_words(row: dict, counted: bool) -> str:
    """What a fitting choice leaves: beyond the counted activations, or for them."""
    if counted:
        return (f"{fmt_decimal(row['left'])} stays free beyond the counted activations and the "
                "headroom")
    return f"it leaves {fmt_decimal(row['left'])} per rank for activations"


# [Note: crosses nodes] Several nodes (``--nodes R --ranks-per-node S``, N = R·S ranks): the
# second table sets DDP, stages 1-3 over all N ranks and hybrid stages 1-3 (sharded over the S
# ranks of a node, replicated across nodes: minishard's ``mesh=``; FSDP1 HYBRID_SHARD at stage 3
# and _HYBRID_SHARD_ZERO2 at stage 2, FSDP2 on a 2-D mesh, DeepSpeed MiCS at stage 3; not ZeRO++
# hpZ, which keeps optimizer state and gradients sharded over all N ranks) side by side, with
# memory per rank and bytes per rank per step (``minishard.observe.memory.step_bytes``) inside a
# node and across nodes, b = 4 bytes per element (2 with --mixed-precision).
# What "crosses nodes" means per rank, under the ring model: a collective over all N ranks is a
# ring through every rank, ranks of one node adjacent, so R of its N hops join two nodes. Every
# chunk (or its partial sum) travels the whole ring, so it reaches the other nodes, and each
# boundary hop carries as many bytes as a rank sends: the whole collective runs at the speed of
# the inter-node link. We therefore count ALL of a rank's bytes as crossing. Hybrid sharding
# keeps the shard-group rings inside a node and crosses nodes only in the all-reduce of each
# rank's gradient shard with its R-1 peers (one per node), a ring in which every hop crosses.
# The recommendation: of the choices that fit, the one with the fewest cross-node bytes (ties:
# fewest bytes in all, then the lowest stage); on one node, the lowest stage that fits.
def choices(params: float, nodes: int, ranks_per_node: int, memory: float,
            optimizer: str = "adam", mixed_precision: bool = False, headroom: float = 0.0,
            activations: float = 0.0, replicated: float = 0) -> list[dict]:
    """Multi-node: DDP, stages 1-3 over all R·S ranks, and hybrid stages 1-3, each with its memory
    per rank (model states + activations), bytes per rank per step inside a node and across
    nodes (the module docstring's table), what is left, and whether it fits."""
    n, elem = nodes * ranks_per_node, 2 if mixed_precision else 4
    rows = []
    for stage in range(4):
        sent = step_bytes(params, stage, n, elem)
        crossing = nodes > 1  # one ring over every rank: see "crosses nodes" in the docstring
        states = sum(zero_bytes(params, n, stage, optimizer, mixed_precision,
                                replicated).values())
        rows.append({"choice": "DDP (stage 0)" if stage == 0 else f"stage {stage}",
                     "stage": stage, "states": states, "intra": 0.0 if crossing else sent,
                     "cross": sent if crossing else 0.0})
    for stage in range(1, 4):  # sharded over the S ranks of a node, replicated across nodes
        rows.append({"choice": f"hybrid stage {stage}", "stage": stage,
                     "states": sum(zero_bytes(params, ranks_per_node, stage, optimizer,
                                              mixed_precision, replicated).values()),
                     **hybrid_step_bytes(params, nodes, ranks_per_node, elem, stage)})
    for row in rows:
        row["memory"] = row["states"] + activations
        row["left"] = memory - headroom - row["memory"]
        row["fits"] = row["left"] >= 0
    return rows


def recommend_choice(rows: list[dict]) -> dict | None:
    """Of the fitting choices, the fewest cross-node bytes, then fewest bytes, then lowest stage
    (on one node every choice crosses nothing: the lowest stage that fits)."""
    fitting = [r for r in rows if r["fits"]]
    return min(fitting, key=lambda r: (r["cross"], r["cross"] + r["intra"], r["stage"]),
               default=None)


# memory.step_bytes / hybrid_step_bytes as printed (tests/test_plan.py evaluates them).
MULTI_NODE_FORMULAS = {
    "stages 0-2 over all N": "across 2·Ψ·b·(N-1)/N",
    "stage 3 over all N": "across 3·Ψ·b·(N-1)/N",
    "hybrid stages 1-2": "in node 2·Ψ·b·(S-1)/S, across 2·(Ψ/S)·b·(R-1)/R",
    "hybrid stage 3": "in node 3·Ψ·b·(S-1)/S, across 2·(Ψ/S)·b·(R-1)/R"}


def _on(nodes: int, who: str, formula: str) -> str:
    """On one node a ring over all N ranks crosses no node: its bytes stay in the node."""
    return formula if nodes > 1 or "hybrid" in who else formula.replace("across", "in node")


def multi_node_lines(params, nodes, per_node, memory, optimizer, mixed_precision, headroom,
                      acts, counted, replicated) -> list[str]:
    rows = choices(params, nodes, per_node, memory, optimizer, mixed_precision, headroom, acts,
                   replicated)
    elem = 2 if mixed_precision else 4
    lines = textwrap.wrap(
        f"{nodes} nodes x {per_node} ranks. Hybrid: each stage over a node's S = {per_node} "
        f"ranks, replicated over the R = {nodes} nodes. Bytes sent per rank per step (ring "
        f"model, b = {elem}-byte elements, N = {nodes * per_node}): "
        + "; ".join(f"{who}: {_on(nodes, who, formula)}"
                    for who, formula in MULTI_NODE_FORMULAS.items())
        + ". Simplification: a ring over all N ranks counts ALL of its bytes as crossing "
        "nodes (every chunk passes a node boundary, so the collective runs at the inter-node "
        "link's speed; only R of its N hops actually join two nodes).", 100)
    lines += [f"{'choice':<16}{'memory':>11}{'left':>11}{'in node':>11}{'across':>11}  fits"]
    for r in rows:
        lines.append(f"{r['choice']:<16}" + "".join(
            f"{fmt_decimal(r[t]):>11}" for t in ("memory", "left", "intra", "cross"))
            + f"  {'yes' if r['fits'] else 'no'}")
    lines.append("")
    best = recommend_choice(rows)
    lines += textwrap.wrap(
        "Rule with --nodes: of the choices that fit, the FEWEST BYTES ACROSS NODES (ties: "
        "fewest bytes in all, then the lowest stage), not the one-node rule (the lowest stage "
        "that fits): inter-node links are the slow ones.", 100)
    if best is None:
        advice = (f"Recommendation: nothing fits on {nodes * per_node} ranks; add nodes (stage "
                  "3 over more ranks), offload, or split the model.")
    elif nodes == 1 or best["cross"] == 0:
        advice = (f"Recommendation: {best['choice']}, the lowest stage that fits "
                  f"({left_words(best, counted)}); on one node nothing crosses a node.")
    else:
        advice = (f"Recommendation: {best['choice']}: of the choices that fit, it sends the "
                  f"fewest bytes across nodes, {fmt_decimal(best['cross'])} per rank per step "
                  f"(inter-node links are the slow ones); {left_words(best, counted)}.")
    return lines + textwrap.wrap(advice, 100)


