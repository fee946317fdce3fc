"""The cost of synchronising BatchNorm: minishard.SyncBatchNorm vs plain BatchNorm2d, per layer.

    torchrun --standalone --nproc_per_node=2 bench/syncbn.py [--channels 64] [--steps 50]

Prints the median forward+backward time of one layer (plain BatchNorm2d: no communication;
minishard.SyncBatchNorm: one all-reduce each way), the latency of the same two collectives
(comm picks their algorithm: on gloo the fewest messages), all interleaved step by step, and the
target: SyncBatchNorm <= 2 x BatchNorm2d + the latency of its collectives.

That latency is measured where the collectives run: "BatchNorm2d + its 2 collectives" is plain
BatchNorm2d with the same two all-reduces issued at the same points (after the forward, before the
backward), and the latency is its time minus BatchNorm2d's. The same collectives issued back to
back with no computation ("alone") are shown too: on 2 shared cores they measure 1.5-2x faster
than right after a computation, so they would understate what any layer pays for them.

The control, "2x BatchNorm2d + its 2 collectives", is two BatchNorm2d layers in a row with the
same two all-reduces around them: a layer whose arithmetic is exactly the target's allowance. It
measures the target itself, where the sum is made, instead of adding up terms measured apart.
With more ranks than cores the terms do not add up: the more computation lies between two
synchronisations, the further the ranks drift apart and the longer each waits for the slowest;
at 4 ranks on 2 cores the control itself misses the additive target in most runs (RESULTS.md).

Also the bytes each rank sends per layer per step, next to what stock torch.nn.SyncBatchNorm's
design sends: it all-gathers every rank's (mean, invstd, count) in forward, (2C+1)·N values, and
all-reduces 2C values in backward. minishard sends 2C+1 and 2C (fp64 statistics: see
syncbn.py): (N-1)·S bytes each by direct exchange, log2 N·S by recursive doubling.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.comm import ring_bytes


class CollectivesAlone:
    """The two all-reduces one SyncBatchNorm layer issues per step, and nothing else."""

    def __init__(self, C: int) -> None:
        self.fwd = torch.zeros(2 * C + 1, dtype=torch.float64)
        self.bwd = torch.zeros(2 * C, dtype=torch.float64)

    def step(self) -> None:
        comm.all_reduce(self.fwd, algorithm="auto")
        comm.all_reduce(self.bwd, algorithm="auto")

    def around(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` with the forward collective after it and the backward one before its
        backward: where SyncBatchNorm issues them."""
        y = layer(x)
        comm.all_reduce(self.fwd, algorithm="auto")
        y.register_hook(lambda grad: comm.all_reduce(self.bwd, algorithm="auto"))
        return y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    C = args.channels
    x = torch.randn(args.batch, C, args.size, args.size, requires_grad=True)
    layers = {"BatchNorm2d (no sync)": nn.BatchNorm2d(C),
              "minishard.SyncBatchNorm": minishard.SyncBatchNorm(C)}
    alone = CollectivesAlone(C)
    with_collectives = "BatchNorm2d + its 2 collectives"
    control = "2x BatchNorm2d + its 2 collectives"
    twice = nn.Sequential(nn.BatchNorm2d(C), nn.BatchNorm2d(C))
    times = {name: [] for name in [*layers, with_collectives, control, "its 2 collectives alone"]}
    sent = {}
    for i in range(args.steps + 5):
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            with minishard.ledger() as led:
                if name in layers:
                    layers[name](x).square().mean().backward()
                elif name == with_collectives:
                    alone.around(layers["BatchNorm2d (no sync)"], x).square().mean().backward()
                elif name == control:
                    alone.around(twice, x).square().mean().backward()
                else:
                    alone.step()
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
                sent[name] = float(led.total_bytes())
                algorithms = sorted({e.algorithm for e in led.entries})
    stock_fp32 = ring_bytes("all_gather", (2 * C + 1) * world * 4, world) + \
        ring_bytes("all_reduce", 2 * C * 4, world)
    if rank == 0:
        print(f"{world} ranks, input {tuple(x.shape)} per rank, {args.steps} interleaved steps\n")
        print(f"{'layer':<34}{'fwd+bwd ms':>11}{'bytes sent/step':>17}")
        base = statistics.median(times["BatchNorm2d (no sync)"])
        for name in times:
            med = statistics.median(times[name])
            print(f"{name:<34}{1000 * med:>11.3f}{sent[name]:>17.0f}   ({med / base:.2f}x)")
        print(f"{'stock SyncBatchNorm design':<34}{'(GPU only)':>11}{float(stock_fp32):>17.0f}"
              f"   all_gather (2C+1)·N fp32 + all_reduce 2C fp32")
        sync = statistics.median(times["minishard.SyncBatchNorm"])
        coll = statistics.median(times[with_collectives]) - base
        print(f"\ncollectives: {', '.join(algorithms)}, latency where they run "
              f"{1000 * coll:.3f} ms. Target SyncBatchNorm <= 2 x BatchNorm2d + that = "
              f"{1000 * (2 * base + coll):.3f} ms: {1000 * sync:.3f} ms, "
              f"{'met' if sync <= 2 * base + coll else 'MISSED'}; "
              f"(SyncBatchNorm - collectives) / BatchNorm2d = {(sync - coll) / base:.2f}")
        at_allowance = statistics.median(times[control])
        print(f"control, {control}: {1000 * at_allowance:.3f} ms, "
              f"(control - collectives) / BatchNorm2d = {(at_allowance - coll) / base:.2f}; "
              f"SyncBatchNorm / control = {sync / at_allowance:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
