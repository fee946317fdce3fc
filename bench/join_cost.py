"""What torch's Join costs DDP + minishard.ShardedOptimizer, on zero_vs_stock.py's MLP:

    torchrun --standalone --nproc_per_node=2 bench/join_cost.py

Blocks of 10 steps alternate, 6 rounds: without Join; under ``Join([ddp, opt], model=ddp)`` with
even batches (nobody joins: DDP's flag all-reduce and the optimizer's, a byte per rank and per
parameter, each step); and on the last rank while the others have joined (they are sent the
gradients of what they own and the optimizer's options). Rank ``world - 1`` prints medians.
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_vs_stock import build  # noqa: E402  (the same model as the A/B)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model, _, make_batch = build("mlp")
    ddp = DDP(model)
    opt = minishard.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-4)
    x = make_batch(torch.Generator().manual_seed(rank))
    times = {"without Join": [], "Join, nobody joined": [], "Join, the others joined": []}

    def steps(name: str, count: int, barrier: bool = True) -> None:
        for _ in range(count):
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            opt.step()
            times[name].append(time.perf_counter() - t0)

    for _ in range(6):
        steps("without Join", 10)
        with Join([ddp, opt], model=ddp):
            steps("Join, nobody joined", 10)
        with Join([ddp, opt], model=ddp):
            steps("Join, the others joined", 10 if rank == last else 0, barrier=False)
    if rank == last:
        for name, ts in times.items():
            print(f"{name:<26} median {1000 * statistics.median(ts[10:]):6.1f} ms/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
