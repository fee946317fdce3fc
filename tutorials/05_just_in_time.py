"""Tutorial 05: gather just in time (ZeRO stage 3 / FSDP's FULL_SHARD).

    torchrun --standalone --nproc_per_node=2 tutorials/05_just_in_time.py

Stage 3 keeps only 1/N of every parameter on each rank. A unit's full weights exist only while the
unit computes: all-gathered just before its forward, freed right after, all-gathered again when
backward reaches it, freed once its gradient has been reduce-scattered. So the most full-parameter
memory a rank ever holds is about ONE unit (two with prefetch), not the whole model, and this only
works if the model is cut into several units. This script prints the timeline of one step, unit
by unit, and measures the peak of gathered bytes with one unit for the whole model versus one unit
per block. It asserts that per-block units bring the peak down to the largest unit.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.memory import bar_chart, fmt_bytes, pyplot

WIDTH, BLOCKS = 64, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.linear(x))


def one_step(units, prefetch=False):
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=3,
                           units=units, prefetch=prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, WIDTH)
    model(x).sum().backward()  # a first step records the forward order (used by prefetch)
    opt.step()
    opt.zero_grad()
    with model.record_events() as events:
        model(x).sum().backward()
    opt.step()
    return model, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="also save a PNG of the timeline (needs matplotlib)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    block_bytes = (WIDTH * WIDTH + WIDTH) * 4  # one block's full fp32 parameters (no padding here)

    whole, _ = one_step(units=None)
    per_block, events = one_step(units={Block})
    prefetched, _ = one_step(units={Block}, prefetch=True)

    say(f"One stage-3 step on rank 0 of {world}, {BLOCKS} blocks, each its own unit:\n")
    say(f"{'t (ms)':>8}  {'event':<9}{'unit':<6}{'full params held':>18}")
    t0 = events[0]["t"]
    for e in events:
        bar = "#" * round(e["gathered_bytes"] / block_bytes * 4)
        say(f"{1000 * (e['t'] - t0):8.2f}  {e['event']:<9}{e['unit']:<6}"
            f"{fmt_bytes(e['gathered_bytes']):>12}  {bar}")

    # Every unit is gathered twice (forward, backward), freed twice and reduced once.
    for kind, times in (("gather", 2), ("free", 2), ("reduce", 1)):
        for b in range(BLOCKS):
            n = sum(1 for e in events if e["event"] == kind and e["unit"] == str(b))
            assert n == times, (kind, b, n)

    peaks = {"one unit": whole.peak_gathered_bytes, "per block": per_block.peak_gathered_bytes,
             "per block + prefetch": prefetched.peak_gathered_bytes}
    say("\nPeak of gathered full parameters on this rank:")
    say(bar_chart([(k, {"gathered": v}) for k, v in peaks.items()]))
    assert peaks["one unit"] == BLOCKS * block_bytes   # everything at once
    assert peaks["per block"] == block_bytes           # one block at a time
    assert peaks["per block + prefetch"] <= 2 * block_bytes  # this one and the next
    say(f"\nPer-block units cut the peak from {fmt_bytes(peaks['one unit'])} to "
        f"{fmt_bytes(peaks['per block'])} ({BLOCKS}x); prefetch holds at most two blocks. "
        "All assertions held.")

    plt = pyplot() if args.plot and rank == 0 else None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.step([1000 * (e["t"] - t0) for e in events],
                [e["gathered_bytes"] / 1024 for e in events], where="post")
        ax.set_xlabel("ms into the step")
        ax.set_ylabel("gathered KiB")
        ax.set_title("Stage 3: full parameters held over one step (rank 0)")
        fig.tight_layout()
        fig.savefig(args.plot)
        say(f"saved {args.plot}")
    dist.barrier()  # let every rank finish before tearing the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
