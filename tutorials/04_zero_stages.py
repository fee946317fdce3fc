"""Tutorial 04: the memory wall, and how ZeRO's stages climb over it.

    torchrun --standalone --nproc_per_node=2 tutorials/04_zero_stages.py
    torchrun --standalone --nproc_per_node=4 tutorials/04_zero_stages.py

Plain data parallelism (DDP) keeps a full copy of everything on every rank: parameters, gradients
and optimizer state. With fp32 Adam that is 4 + 4 + 8 = 16 bytes per parameter, on EVERY rank, so
adding ranks never lets you train a bigger model. ZeRO removes the copies one kind at a time:

    stage 1  shard the optimizer state      (each rank updates only its 1/N: rows of each param)
    stage 2  ... and the gradients          (reduce-scatter: each rank receives only its slice)
    stage 3  ... and the parameters         (all-gather each unit just before it computes)

This script trains the same model with each stage, MEASURES what each rank holds (tensor storage,
not estimates) and how many bytes each rank sends per step (minishard's comm ledger), and asserts
that both equal the formulas. Stage 3 pays for its memory with one extra all-gather per step:
3Ψ of traffic instead of 2Ψ.

First, though: WHICH 1/N does a rank hold? Two layouts are in use. Take a unit with parameters
a (3x2), b (3) and c (5) on N = 2 ranks (one label per element: a1 is an element of a's row 1):

    FSDP1 / DeepSpeed stages 1-2: concatenate, pad the END to a multiple of N (DeepSpeed: of 2N;
    FSDP1 with use_orig_params=True also aligns each parameter to 16 bytes), cut in N 1-D pieces
    (DeepSpeed's ZeRO-3 cuts each parameter alone, flattened: N equal 1-D pieces of it)
        rank 0: [a0 a0 a1 a1 a2 a2 b0]      rank 1: [b1 b2 c0 c1 c2 c3 c4]
    FSDP2 / minishard: cut EACH parameter along dim 0 into N chunks of ceil(R/N) rows
        rank 0: [a0 a0 a1 a1 | b0 b1 | c0 c1 c2]      rank 1: [a2 a2 _ _ | b2 _ | c3 c4 _]

In the first, a piece is a slice of bytes that runs across parameter boundaries (b is split
between ranks 0 and 1 mid-parameter): what the optimizer sees is ``flat_param`` pieces with no
names and no shapes. In the second, rank r's shard of each parameter is a block of its ROWS, so
the module keeps its own parameters, with their names and number of dimensions: a is (2, 2) on
rank 0 and (1, 2) on rank 1. That is why FSDP2 moved to it: ``named_parameters()`` and
``p.dim() >= 2`` (weight decay on matrices only) work as without sharding, any single parameter
can be frozen, and a state dict is each rank's rows of each named tensor, saved without
communication. What it costs: padding per PARAMETER (up to N-1 rows each, not N-1 elements in
all: 18 elements move for 14 here, where the concatenation needs none), and one copy of the
unit's bytes per all-gather and per reduce-scatter, to put each rank's rows of every parameter
side by side (none when the unit has one parameter: then both layouts are the same).
Part 0 builds that unit at your N, prints both layouts, and asserts every rank's parameters and
the bytes its all-gather moves.
"""
import argparse
import math

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.observe.memory import bar_chart, fmt_bytes, zero_bytes, pyplot

WIDTH, BLOCKS, BATCH = 96, 4, 8  # every parameter has 96 rows: divisible by 1-4, no padding
LAYOUT = {"a": (3, 2), "b": (3,), "c": (5,)}  # part 0's unit (minishard/zero/flat.py draws it too)


class Three(nn.Module):
    """Part 0's unit: parameters a, b, c whose values are their element's row number."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in LAYOUT.items():
            rows = torch.arange(shape[0], dtype=torch.float32)
            self.register_parameter(name, nn.Parameter(rows.reshape(-1, *[1] * (len(shape) - 1))
                                                       .expand(shape).clone()))

    def forward(self, x):
        return x * sum(p.sum() for p in self.parameters())


def concatenation_pieces(world: int) -> list[list[str]]:
    """FSDP1's layout, computed plainly: every element's label, end to end, padded, cut in N."""
    labels = [f"{name}{row}" for name, shape in LAYOUT.items()
              for row in range(shape[0]) for _ in range(math.prod(shape[1:]))]
    k = -(-len(labels) // world)
    labels += ["_"] * (k * world - len(labels))
    return [labels[r * k:(r + 1) * k] for r in range(world)]


def row_chunks(world: int) -> list[dict[str, list[int]]]:
    """FSDP2's layout: each parameter's rows cut with torch.chunk (which may give fewer than N
    chunks: the last ranks then hold no rows). Per rank, per parameter, the rows it holds."""
    out = [{} for _ in range(world)]
    for name, shape in LAYOUT.items():
        chunks = torch.arange(shape[0]).chunk(world)
        for r in range(world):
            out[r][name] = chunks[r].tolist() if r < len(chunks) else []
    return out


def show_layouts(rank: int, world: int, say) -> None:
    """Part 0: both layouts at this N; the engine's parameters and gather bytes asserted."""
    chunks = row_chunks(world)
    width = {n: -(-s[0] // world) for n, s in LAYOUT.items()}  # rows every chunk is padded to
    per_row = {n: math.prod(s[1:]) for n, s in LAYOUT.items()}
    k = sum(width[n] * per_row[n] for n in LAYOUT)
    model = minishard.ZeRO(Three(), stage=3)
    first_column = lambda p: p.detach()[(slice(None),) + (0,) * (p.dim() - 1)]  # noqa: E731
    # each parameter is a DTensor: the global shape, a placement, and this rank's rows (local)
    mine = {name: ((tuple(p.to_local().shape), first_column(p.to_local()).tolist()),
                   (type(p).__name__, tuple(p.shape), repr(p.placements[0])))
            for name, p in model.module.named_parameters()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # rank 0 checks and prints every rank's
    for r, got in enumerate(everyone):
        assert list(got) == list(LAYOUT), got  # the module's own names, in order
        for name, shape in LAYOUT.items():     # this rank's rows, with the original ndim
            rows = chunks[r][name]
            assert got[name][0] == ((len(rows), *shape[1:]), [float(i) for i in rows]), (r, got)
            assert got[name][1] == ("DTensor", shape, "Shard(dim=0)"), (r, got)
    with minishard.ledger() as led:
        model(torch.ones(1))                   # stage 3: one all-gather of the unit
    assert led.total_bytes("all_gather") == 4 * k * (world - 1), led.table()
    numel = sum(math.prod(s) for s in LAYOUT.values())
    old = concatenation_pieces(world)
    say(f"Part 0: where a rank's 1/{world} lives. a (3x2), b (3), c (5): {numel} elements; "
        "a label per element.")
    say("  FSDP1 / DeepSpeed stages 1-2, the concatenation cut in N:")
    for r, piece in enumerate(old):
        say(f"    rank {r}: [{' '.join(piece)}]")
    say("  FSDP2 / minishard, each parameter cut along dim 0 (asserted on every rank):")
    for r in range(world):
        parts = [" ".join([f"{n}{i}" for i in chunks[r][n] for _ in range(per_row[n])]
                          + ["_"] * ((width[n] - len(chunks[r][n])) * per_row[n]))
                 for n in LAYOUT]
        shapes = ", ".join(f"{n} {everyone[r][n][0][0]}" for n in LAYOUT)
        say(f"    rank {r}: [{' | '.join(parts)}]   local rows: {shapes}")
    say("  Each parameter is a DTensor, as in FSDP2: " + ", ".join(
        f"{n}: shape {everyone[0][n][1][1]} {everyone[0][n][1][2]}" for n in LAYOUT) +
        ";\n  p.to_local() is this rank's rows (a view into the shard), p.full_tensor() all of "
        "them (an all-gather).\n  So torch's clip_grad_norm_, get_state_dict and DCP see a "
        "shard and run the collective it needs.")
    say(f"  Padded: {world * len(old[0])} elements cut as a concatenation, {world * k} cut per "
        f"parameter (up to N-1 rows each);\n  an all-gather of the unit sends "
        f"{4 * k * (world - 1)} bytes per rank (asserted), then copies each parameter's rows "
        "into place.\n")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def train_and_measure(stage: int, rank: int, group=None) -> dict:
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=stage,
                           units={Block}, process_group=group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # built AFTER wrapping: sees the shards
    data = torch.randn(3, BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))

    model(data[0]).square().mean().backward()  # step 1 creates Adam's state
    opt.step()
    opt.zero_grad()
    with minishard.ledger() as led:            # a steady-state step: forward + backward
        model(data[1]).square().mean().backward()
    mem = model.memory_report(opt)             # measured now: params, grads AND optimizer state live
    opt.step()
    return {"mem": mem, "sent": float(led.total_bytes()), "ledger": led}


def main(rank: int, world: int, plot: str | None) -> None:
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)   # parameters in the model
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"Model: {BLOCKS} x Linear({WIDTH}) = {psi:,} parameters, fp32 Adam, {world} ranks.\n")

    show_layouts(rank, world, say)
    results = {stage: train_and_measure(stage, rank) for stage in range(4)}

    say(f"{'stage':<6}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
        f"{'formula':>12}{'sent/step':>12}")
    rows = []
    for stage, r in results.items():
        m, f = r["mem"], zero_bytes(psi, world, stage)
        # What each rank holds is exactly the formula: params and optimizer state always; the
        # gradients too except in stage 1, which keeps FULL gradients only DURING backward (they
        # are reduce-scattered and freed when it ends): there the formula's 4Ψ is the peak.
        assert m["params"] == f["params"], (stage, m, f)
        assert m["optimizer"] == f["optimizer"], (stage, m, f)
        grads = grads_held(stage, m)
        assert grads == f["grads"], (stage, m, f)
        # Communication: 2Ψ per step for stages 0-2 (all-reduce, or reduce-scatter + all-gather),
        # 3Ψ for stage 3 (all-gather in forward AND in backward, reduce-scatter), times (N-1)/N.
        expected = (3 if stage == 3 else 2) * 4 * psi * (world - 1) / world
        assert r["sent"] == expected, (stage, r["sent"], expected)
        total = m["params"] + grads + m["optimizer"]
        say(f"{stage:<6}{fmt_bytes(m['params']):>12}{fmt_bytes(grads):>12}"
            f"{fmt_bytes(m['optimizer']):>12}{fmt_bytes(total):>12}{fmt_bytes(sum(f.values())):>12}"
            f"{fmt_bytes(r['sent']):>12}")
        rows.append((f"stage {stage}", {"params": m["params"], "grads": grads,
                                        "optimizer": m["optimizer"]}))
    say("\n(stage 1's grads column: full gradients alive at the end of backward)\n")
    say("Bytes held per rank:")
    say(bar_chart(rows))
    say("\nOne stage-3 step, as the ledger recorded it on this rank:")
    say(results[3]["ledger"].table())
    say(f"\nEvery rank holds {fmt_bytes(sum(zero_bytes(psi, world, 0).values()))} with DDP and "
        f"{fmt_bytes(sum(zero_bytes(psi, world, 3).values()))} with stage 3: 1/{world} of it. "
        "All assertions held.")
    if plot:
        plot_against_world_size(plot, psi, rank, world)


def grads_held(stage: int, mem: dict) -> int:
    """Stage 1 frees its full gradients at the end of backward; the formula's 4 psi is its peak."""
    return mem["peak_full_grads"] if stage == 1 else mem["grads"]


def plot_against_world_size(path: str, psi: int, rank: int, world: int) -> None:
    """What the table cannot show: how each stage's bytes per rank fall as ranks are added.

    Lines: the formulas (minishard/observe/memory.py) for 1 to 8 ranks. Points: measured in this run at
    every world size up to ours, by training on the first k ranks only (a process group of k),
    and asserted equal to the formula there too."""
    measured = {}  # (stage, k) -> bytes held per rank
    for k in range(1, world + 1):
        group = dist.new_group(list(range(k)))  # every rank must take part in new_group
        if rank < k:
            for stage in range(4):
                mem = train_and_measure(stage, rank, group)["mem"]
                held = mem["params"] + grads_held(stage, mem) + mem["optimizer"]
                assert held == sum(zero_bytes(psi, k, stage).values()), (stage, k, held)
                measured[stage, k] = held
    plt = pyplot() if rank == 0 else None
    if plt is None:
        return
    ns = list(range(1, max(8, world) + 1))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    formulas = ["16\u03a8", "8\u03a8 + 8\u03a8/N", "4\u03a8 + 12\u03a8/N", "16\u03a8/N"]
    for stage in range(4):
        line, = ax.plot(ns, [sum(zero_bytes(psi, n, stage).values()) / 1024 for n in ns],
                        label=f"stage {stage}: {formulas[stage]}")
        ks = [k for s, k in measured if s == stage]
        ax.plot(ks, [measured[stage, k] / 1024 for k in ks], "o", color=line.get_color(),
                markersize=7, markerfacecolor="none")
    ax.plot([], [], "ko", markerfacecolor="none",
            label="measured, 1 rank" if world == 1 else f"measured, 1 to {world} ranks")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("KiB of model state per rank")
    ax.set_xticks(ns)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Model state per rank, \u03a8 = {psi:,} params, fp32 Adam (bytes)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"saved {path}")


# ---------------------------------------------------------------------------------------------
# ZeRO-1, the other spelling (issue 27): minishard.ShardedOptimizer(params, AdamW, lr=...), torch's
# ZeroRedundancyOptimizer signature, over ANY replicated model (plain, DDP, stage 0). It shards
# whole parameters balanced by size; stage 1 shards equal flat slices. Measured by
# bench/sharded_optimizer_memory.py (fp32 AdamW state per rank, 4 ranks): this model 74,504 B
# on every rank (8Ψ/N + 4-byte steps; stage 1: 74,496); Embedding(4096, 64) + 4 x Linear(64),
# whose embedding exceeds Ψ/N: 2,097,156 / 65,544 / 33,804 / 33,804 B (torch's identical),
# where stage 1 holds 557,568 on each. Bytes sent per step: stage 0 + ShardedOptimizer sends
# 3 passes (all-reduce + one broadcast from each owner), stage 1 two (asserted below).
def zero1_two_spellings(rank: int, world: int) -> None:
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=0,
                           units={Block})
    opt = minishard.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    data = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    with minishard.ledger() as led:
        model(data).square().mean().backward()
        opt.step()
    held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if v.dim() > 0)  # Adam's moments (the scalar step left out)
    owned = sum(p.numel() for p, r in opt.owner.items() if r == rank)
    assert held == 8 * owned, (held, owned)
    assert led.total_bytes() == 3 * 4 * psi * (world - 1) / world, led.table()
    if rank == 0:
        print(f"\nZeRO-1 spelled as an optimizer: stage 0 + ShardedOptimizer holds {held:,} B "
              f"of Adam state on rank 0 (stage 1: {8 * psi // world:,}) and sends "
              f"{float(led.total_bytes()):,.0f} B per step (stage 1: "
              f"{2 * 4 * psi * (world - 1) / world:,.0f}). Its assertions held too.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="also save a PNG of bytes per rank against the number of "
                                       "ranks, formulas and measurements (needs matplotlib)")
    args = parser.parse_args()
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session() as (rank, world):
        main(rank, world, args.plot)
        zero1_two_spellings(rank, world)
