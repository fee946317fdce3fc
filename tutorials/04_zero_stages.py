"""Tutorial 04: the memory wall, and how ZeRO's stages climb over it.

    torchrun --standalone --nproc_per_node=2 tutorials/04_zero_stages.py
    torchrun --standalone --nproc_per_node=4 tutorials/04_zero_stages.py

Plain data parallelism (DDP) keeps a full copy of everything on every rank: parameters, gradients
and optimizer state. With fp32 Adam that is 4 + 4 + 8 = 16 bytes per parameter, on EVERY rank, so
adding ranks never lets you train a bigger model. ZeRO removes the copies one kind at a time:

    stage 1  shard the optimizer state      (each rank updates only its 1/N slice of the params)
    stage 2  ... and the gradients          (reduce-scatter: each rank receives only its slice)
    stage 3  ... and the parameters         (all-gather each unit just before it computes)

This script trains the same model with each stage, MEASURES what each rank holds (tensor storage,
not estimates) and how many bytes each rank sends per step (minishard's comm ledger), and asserts
that both equal the formulas. Stage 3 pays for its memory with one extra all-gather per step:
3Ψ of traffic instead of 2Ψ.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.memory import bar_chart, fmt_bytes, zero_bytes, pyplot

WIDTH, BLOCKS, BATCH = 96, 4, 8  # 96*96 + 96 = 9312 params per block: divisible by 2 and 4, no padding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def train_and_measure(stage: int, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=stage,
                           units={Block})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="also save a PNG of the per-rank memory (needs matplotlib)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)   # parameters in the model
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"Model: {BLOCKS} x Linear({WIDTH}) = {psi:,} parameters, fp32 Adam, {world} ranks.\n")

    results = {stage: train_and_measure(stage, rank, world) for stage in range(4)}

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
        grads = m["peak_full_grads"] if stage == 1 else m["grads"]
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
    plt = pyplot() if args.plot and rank == 0 else None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3))
        left = [0.0] * len(rows)
        for part in ("params", "grads", "optimizer"):
            vals = [d[part] / 2**20 for _, d in rows]
            ax.barh([label for label, _ in rows], vals, left=left, label=part)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("MiB per rank")
        ax.set_title(f"Model state per rank, {world} ranks, fp32 Adam")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        say(f"saved {args.plot}")
    dist.barrier()  # let every rank finish before tearing the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
