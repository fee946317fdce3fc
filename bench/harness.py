"""How fast RankPool dispatches property-test examples to warm ranks.

    python bench/harness.py

Prints, per world size, the one-time start-up cost and the examples per second of a trivial
all-reduce property (one collective per example, the result checked on every rank).
"""
import time

import torch
import torch.distributed as dist

from minishard import comm
from minishard.testing import RankPool


def trivial_property(value: float) -> bool:
    t = torch.tensor([value])
    comm.all_reduce(t, "sum")
    return t.item() == value * dist.get_world_size()


def main(seconds: float = 3.0) -> None:
    print(f"{'ranks':>5}  {'start-up (s)':>12}  {'examples/s':>10}")
    for ws in (2, 4):
        with RankPool(ws) as pool:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                assert all(pool.run(trivial_property, float(n)))
                n += 1
            rate = n / (time.perf_counter() - t0)
            print(f"{ws:>5}  {pool.startup_seconds:>12.2f}  {rate:>10.0f}")


if __name__ == "__main__":
    main()
