"""Measure the alpha-beta model of comm.all_reduce on this machine: ALPHA (seconds per message)
and BETA (seconds per byte sent), the constants costs.py gives comm.py to pick an algorithm.

    python bench/alpha_beta.py [--reps 30]

Times every all_reduce algorithm, interleaved, at 2 and 4 ranks (warm RankPools), for float32
tensors of 8 B to 4 MiB, takes the median of ``--reps`` calls each (the slowest rank's time), and
fits, by least squares over every (algorithm, ranks, size)::

    time = c + messages * ALPHA + bytes sent per rank * BETA

with messages and bytes from ``comm.all_reduce_terms`` (the table in comm's module doc).
c is the per-call overhead (Python, dispatch, the final copy), the same for every algorithm, so it
cancels when comm compares them. Prints the table, the fit, how well it predicts each point, and
the sizes where the cheapest algorithm changes.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minishard import comm, costs
from minishard.testing import RankPool

SIZES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]  # bytes


def time_all(sizes, reps):
    """On every rank: per (algorithm, size) the median over reps of the slowest rank's seconds."""
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        samples = {a: [] for a in comm.all_reduce_algorithms(dist.get_world_size())}
        for i in range(reps + 3):
            for algorithm in samples:  # interleaved: a burst of load hits all alike
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
    messages, sent = comm.all_reduce_terms(algorithm, nbytes, n)
    return float(messages), float(sent)


def crossovers(n, alpha, beta):
    """(bytes, algorithm) where the cheapest algorithm changes, scanning powers of two."""
    saved = costs.ALPHA, costs.BETA  # the model's constants live in minishard/costs.py
    costs.ALPHA, costs.BETA = alpha, beta
    try:
        out, last = [], None
        for log in range(2, 31):
            best = comm.pick_all_reduce(1 << log, n, "gloo")
            if best != last:
                out.append((1 << log, best))
                last = best
        return out
    finally:
        costs.ALPHA, costs.BETA = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for n in args.ranks:
        with RankPool(n, timeout=600) as pool:
            measured = pool.run(time_all, SIZES, args.reps)[0]
        for (algorithm, nbytes), seconds in measured.items():
            rows.append((n, algorithm, nbytes, seconds))

    A = torch.tensor([[1.0, *features(a, n, s)] for n, a, s, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    # Relative least squares (each row divided by its time): the 8 B points matter as much as
    # the 4 MiB ones, or the fit would ignore latency altogether.
    w = 1 / y
    fit = torch.linalg.lstsq(A * w[:, None], y * w).solution
    c, alpha, beta = fit.tolist()

    print(f"{'ranks':>5} {'algorithm':>9} {'bytes':>9} {'measured us':>12} {'model us':>9}")
    for (n, a, s, t), pred in zip(rows, (A @ fit).tolist()):
        print(f"{n:>5} {a:>9} {s:>9} {1e6 * t:>12.1f} {1e6 * pred:>9.1f}")
    print(f"\nfit: c = {1e6 * c:.1f} us per call, ALPHA = {1e6 * alpha:.1f} us per message, "
          f"BETA = {1e9 * beta:.3f} ns per byte ({1 / beta / 2**30:.2f} GiB/s)")
    for n in (2, 3, 4, 8):
        steps = ", then ".join(f"{a} from {s:,} B" for s, a in crossovers(n, alpha, beta))
        print(f"N = {n}: cheapest {steps}")


if __name__ == "__main__":
    main()
