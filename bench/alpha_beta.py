"""Measure the alpha-beta model of comm.all_reduce on this machine: ALPHA (seconds per round) and
BETA (seconds per byte sent), the constants comm.py uses to pick an algorithm.

    python bench/alpha_beta.py [--reps 30]

Times both all_reduce algorithms, interleaved, at 2 and 4 ranks (warm RankPools), for float32
tensors of 8 B to 4 MiB, takes the median of ``--reps`` calls each (the slowest rank's time), and
fits, by least squares over every (algorithm, ranks, size)::

    time = c + rounds * ALPHA + bytes sent per rank * BETA
    ring:   rounds 2(N-1), bytes 2(N-1)/N * S          direct: rounds 1, bytes (N-1) * S

c is the per-call overhead (Python, dispatch, the final copy), the same for both algorithms, so it
cancels when comm compares them. Prints the table, the fit, how well it predicts each point, and
the crossover size below which the direct exchange is cheaper.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minishard import comm
from minishard.testing import RankPool

SIZES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]  # bytes


def time_both(sizes, reps):
    """On every rank: per (algorithm, size) the median over reps of the slowest rank's seconds."""
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        samples = {"ring": [], "direct": []}
        for i in range(reps + 3):
            for algorithm in samples:  # interleaved: a burst of load hits both alike
                dist.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(t, algorithm=algorithm)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= 3:
                    samples[algorithm].append(dt.item())
        for algorithm, s in samples.items():
            out[(algorithm, nbytes)] = statistics.median(s)
    return out


def features(algorithm, n, nbytes):
    if algorithm == "ring":
        return 2 * (n - 1), float(comm.ring_bytes("all_reduce", nbytes, n))
    return 1, float(comm.direct_bytes(nbytes, n))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for n in args.ranks:
        with RankPool(n, timeout=600) as pool:
            measured = pool.run(time_both, SIZES, args.reps)[0]
        for (algorithm, nbytes), seconds in measured.items():
            rows.append((n, algorithm, nbytes, seconds))

    A = torch.tensor([[1.0, *features(a, n, s)] for n, a, s, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    # Relative least squares (each row divided by its time): the 8 B points matter as much as
    # the 4 MiB ones, or the fit would ignore latency altogether.
    w = 1 / y
    c, alpha, beta = torch.linalg.lstsq(A * w[:, None], y * w).solution.tolist()

    print(f"{'ranks':>5} {'algorithm':>9} {'bytes':>9} {'measured us':>12} {'model us':>9}")
    for (n, a, s, t), pred in zip(rows, (A @ torch.tensor([c, alpha, beta],
                                                          dtype=torch.float64)).tolist()):
        print(f"{n:>5} {a:>9} {s:>9} {1e6 * t:>12.1f} {1e6 * pred:>9.1f}")
    print(f"\nfit: c = {1e6 * c:.1f} us per call, ALPHA = {1e6 * alpha:.1f} us per round, "
          f"BETA = {1e9 * beta:.3f} ns per byte ({1 / beta / 2**30:.2f} GiB/s)")
    for n in (3, 4, 8):
        star = (2 * n - 3) * n / ((n - 1) * (n - 2)) * alpha / beta
        print(f"crossover at N = {n}: direct is cheaper below S* = {star / 1024:.1f} KiB")
    print("at N = 2 the direct exchange sends the same bytes in one round fewer: always cheaper")


if __name__ == "__main__":
    main()
