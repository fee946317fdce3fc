"""Tutorial 03: SyncBatchNorm, or BatchNorm statistics over the GLOBAL batch.

    torchrun --standalone --nproc_per_node=2 tutorials/03_sync_batchnorm.py
    torchrun --standalone --nproc_per_node=4 tutorials/03_sync_batchnorm.py

Data parallelism splits one batch of B samples over N ranks: each rank sees B/N of them. For most
layers that changes nothing, because DDP averages gradients and the sum of per-rank pieces is the
whole. BatchNorm is different: in its FORWARD pass it normalises with the mean and variance of the
batch it sees. Under DDP each rank normalises with the statistics of its own B/N samples, so with
small per-rank batches (common with large images, detection, segmentation) the model computes
something different, and noisier, than the model you meant to train on the batch of B.

SyncBatchNorm fixes the forward: every rank contributes per-channel [sum, sum of squares, count] to
ONE all_reduce, and normalises with the global mean and variance. The backward needs one more
all_reduce (two per-channel sums; both are derived at the end of this file). This script:

  1. shows the problem: each rank's per-channel batch mean vs the global one;
  2. converts a model with minishard.convert_sync_batchnorm BEFORE wrapping it in DDP;
  3. asserts that N ranks with SyncBatchNorm compute exactly what ONE process computes with plain
     BatchNorm on the whole batch: the outputs, and the parameters after a few SGD steps;
  4. prints what that costs per BN layer, from minishard's communication ledger.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard
from minishard import comm

PER_RANK = 2   # samples per rank: small on purpose, that is when BatchNorm statistics suffer
STEPS = 3


def make_model() -> nn.Module:
    """A small conv net with three BatchNorm layers (2d, 2d, 1d). Same seed: same weights on every
    rank and in the one-process reference."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4))


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    B = PER_RANK * world
    say(f"{world} ranks x {PER_RANK} samples = global batch of {B}\n")

    # Every rank draws the SAME global batch from the same seed and keeps its own slice. (A real job
    # would use a DistributedSampler; this way each rank can also compute the reference itself.)
    # Like photos, each image gets its own brightness per colour channel (the (B, 3, 1, 1) term):
    # a couple of images are a poor sample of the whole batch's statistics.
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(B, 3, 8, 8, generator=gen) + 2 * torch.randn(B, 3, 1, 1, generator=gen),
                torch.randn(B, 4, generator=gen)) for _ in range(STEPS)]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    # ---------------------------------------------------------------- 1. the small-batch problem
    # What the first BatchNorm sees: the first conv's output. Its per-channel mean over the samples
    # THIS rank holds, vs over the global batch.
    features = make_model()[0](batches[0][0]).detach()          # (B, 8, 8, 8), the whole batch
    global_mean = features.mean(dim=(0, 2, 3))
    local_mean = features[mine].mean(dim=(0, 2, 3))
    # Collect every rank's local mean on every rank (through minishard's one door to collectives).
    all_local = torch.empty(world, global_mean.numel())
    comm.all_gather(all_local.view(-1), local_mean, tag="tutorial")
    say("1. Per-channel mean of the first BatchNorm's input (first 4 of 8 channels):")
    say(f"   global batch : {fmt(global_mean[:4])}")
    for r in range(world):
        gap = (all_local[r] - global_mean).abs().max().item()
        say(f"   rank {r}       : {fmt(all_local[r][:4])}   max |rank - global| = {gap:.3f}")
    say("   Plain BatchNorm under DDP normalises each rank with ITS row, not the global one.\n")

    # ----------------------------------------------------------------------- 2. convert, then DDP
    reference = make_model()   # ONE process, plain BatchNorm, the whole batch: what we want
    plain = DDP(make_model())  # DDP without conversion: per-rank statistics (for contrast)
    # Convert BEFORE wrapping: DDP registers the module's parameters when it is built. The
    # converted layers keep the very same Parameter and buffer objects.
    synced = DDP(minishard.convert_sync_batchnorm(make_model()))
    say("2. Converted before DDP:", ", ".join(
        f"layer {name} -> {type(m).__name__}" for name, m in synced.module.named_modules()
        if isinstance(m, minishard.SyncBatchNorm)))
    say("   Outputs on this rank's samples vs the one-process reference on the whole batch:")

    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            for m in (reference, plain, synced)]
    for step, (x, target) in enumerate(batches):
        for opt in opts:
            opt.zero_grad()
        # The reference's loss is the mean over the global batch. Each DDP rank takes the mean over
        # its slice; DDP averages the gradients over the N equal slices: the same gradient.
        out_ref = reference(x)
        F.mse_loss(out_ref, target).backward()
        out_plain = plain(x[mine])
        F.mse_loss(out_plain, target[mine]).backward()
        out_sync = synced(x[mine])
        F.mse_loss(out_sync, target[mine]).backward()
        for opt in opts:
            opt.step()

        # ---------------------------------------------------------------- 3. the equality we want
        torch.testing.assert_close(out_sync, out_ref[mine], rtol=1e-4, atol=1e-5)
        say(f"   step {step}: |SyncBatchNorm - reference| = "
            f"{(out_sync - out_ref[mine]).abs().max().item():.1e}   "
            f"|plain BatchNorm - reference| = {(out_plain - out_ref[mine]).abs().max().item():.2f}")

    for (name, p_ref), p_sync in zip(reference.named_parameters(), synced.module.parameters()):
        torch.testing.assert_close(p_sync, p_ref, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b_ref), b_sync in zip(reference.named_buffers(), synced.module.buffers()):
        torch.testing.assert_close(b_sync, b_ref, rtol=1e-4, atol=1e-5, msg=name)  # running stats
    say(f"\n3. After {STEPS} SGD steps every parameter and running statistic on every rank equals\n"
        "   single-process BatchNorm training on the global batch (asserted).\n")

    # ------------------------------------------------------------------------- 4. what it costs
    # One forward + backward with the ledger on: every collective this rank issues is recorded.
    # (DDP's own gradient all_reduce goes through torch directly, so only SyncBatchNorm shows up.)
    x, target = batches[0]
    with minishard.ledger() as led:
        F.mse_loss(synced(x[mine]), target[mine]).backward()
    bns = [m for m in synced.module.modules() if isinstance(m, minishard.SyncBatchNorm)]
    # Per BN layer with C channels: forward [sum, sum of squares] per channel + the count = 2C+1
    # numbers; backward [sum dy, sum dy*x_hat] per channel = 2C. Float64, so the variance survives
    # inputs whose mean dwarfs their spread (see "The derivation" at the end of this file).
    expected = sorted([2 * m.num_features + 1 for m in bns] + [2 * m.num_features for m in bns])
    assert sorted(e.numel for e in led.entries) == expected, led.table()
    assert all(e.op == "all_reduce" for e in led.entries)
    say("4. Communication of one forward + backward, per BN layer (bytes sent by each rank):")
    say("   " + led.table().replace("\n", "\n   "))
    say("   O(C) numbers per layer whatever the batch or world size (stock torch.nn.SyncBatchNorm\n"
        "   all-gathers per-rank statistics instead: O(C x N)). In eval mode: nothing at all.")
    synced.eval()
    with minishard.ledger() as led, torch.no_grad():
        synced(x[mine])
    assert led.count() == 0
    say("\nAll assertions held.")


def fmt(t: torch.Tensor) -> str:
    return "[" + " ".join(f"{v:+.3f}" for v in t.tolist()) + "]"


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session(
            world_sizes=minishard.launch.at_least(2),
            why="with one rank the local batch IS the global batch") as (rank, world):
        main(rank, world)


# ================================================================================================
# The derivation: why ONE all_reduce forward (two when the sums cancel) and ONE backward
# (the formulas minishard/syncbn.py runs; its module docstring has them as one picture)
# ================================================================================================
#
# Notation: x is this rank's input (N_r, C, *), n the GLOBAL number of values per channel (sum
# over ranks of N_r times the spatial size), every sum Σ runs over all ranks and all dims but C.
#
# Forward: one all_reduce of 2C+1 numbers (two when the sums cancel)
# ------------------------------------------------------------------
# Each rank first computes its LOCAL statistics per channel with a stable method, in float32 for
# float16/bfloat16/float32 inputs, in float64 for float64 ones (the "compute dtype", rounding
# unit u_in): the shifted-data method. x0 = its mean rounded to the compute dtype, t = x - x0.
# When the mean dwarfs the spread, x - x0 is exact (Sterbenz) and of the size of the spread;
# mean(t) is x0's rounding error, far below the spread, so Σt² - n_r·mean(t)² cancels nothing,
# and x0 + mean(t) keeps the digits the rounded mean x0 lost:
#
#     n_r = values per channel on rank r,  m_r = x0 + mean(t)  (float64),  M2_r = Σt² - n_r·mean(t)²
#
# Sums can be added across ranks; means and variances cannot (not with unequal batch sizes). The
# textbook combination (Chan, Golub & LeVeque) of two groups a, b is exact:
#
#     n = n_a + n_b    mean = (n_a m_a + n_b m_b)/n    M2 = M2_a + M2_b + n_a n_b/n·(m_a - m_b)²
#
# and for N groups, with every rank's term written as a SUM so one all_reduce adds them:
#
#     local [n_r·m_r,  M2_r + n_r·m_r²,  n_r]  --all_reduce(SUM)-->  global [S, Q, n]   (float64)
#     mean = S/n        M2 = Q - S·mean  (= Σ M2_r + Σ n_r (m_r - mean)²)
#     var  = M2/n       invstd = 1/sqrt(var + eps)
#     y    = (x - mean)·invstd·w + b                      (w, b: weight and bias, per channel)
#     running_mean <- (1-m)·running_mean + m·mean
#     running_var  <- (1-m)·running_var  + m·var·n/(n-1)  (the unbiased variance, as stock does)
#
# Stock torch.nn.SyncBatchNorm all-gathers each rank's (mean, invstd, count) instead: O(C·N)
# bytes where we send O(C), whatever the world size.
#
# When the sums cancel: a second all_reduce, shifted by the now-known mean
# ------------------------------------------------------------------------
# Q - S·mean subtracts two numbers of size n·mean² to get one of size n·var. With u = 2⁻⁵³
# (float64 rounding), every float64 operation above errs by a factor (1 + δ), |δ| <= u; to first
# order in u:
#
#     q_r = M2_r + n_r·m_r²        3 roundings of non-negative terms      |err| <= 3u·q_r
#     Q   = Σ q_r                  N-1 additions of non-negative terms    |err| <= (N+2)u·Q
#     S   = Σ n_r·m_r              1 product + N-1 additions              |err| <= N·u·Σ|n_r m_r|
#     S·mean = S²/n                2 roundings + twice S's error
#                                                 |err| <= 2u·S²/n + 2N·u·Σ|n_r m_r|·|S|/n
#     Q - S·mean                   1 rounding                             |err| <= u·Q
#
# By Cauchy-Schwarz (Σ n_r|m_r|)² <= n·Σ n_r m_r² <= n·Q, so S²/n <= Q and Σ|n_r m_r|·|S|/n <= Q:
#
#     |fl(M2) - M2| <= (3N + 5)·u·Q
#
# Every rank holds the same all-reduced S, Q, n, so every rank evaluates the same test and takes
# the same branch (no rank can be left waiting in a collective the others skip):
#
#     (3N + 5)·u·Q  <=  u_in·M2   ->  done: the float64 rounding is below one rounding unit u_in
#                                    of the local statistics' dtype (2⁻²⁴ for float32: what the
#                                    local M2_r already carries); true unless |mean|/std > ~5e3
#     otherwise, in ANY channel  ->  every rank sends its statistics shifted by the pass-1 mean:
#
#     local [n_r·d_r,  M2_r + n_r·d_r²]  with d_r = m_r - mean  --all_reduce(SUM)-->  [D, E]
#     mean' = mean + D/n        M2 = E - D²/n
#     (exact: Σ n_r (m_r - mean')² = Σ n_r d_r² - D²/n)
#
# Now every term is non-negative and of the size of the spread, not of the mean:
# |err| <= (N+5)·u·M2 (D/n is pass 1's rounding of the mean, so D²/n is negligible). A float64
# input is its own compute dtype, u_in = u, and the test can never pass ((3N+5)·Q > M2): float64
# inputs always pass twice. Float32 and half-precision inputs pass once unless |mean|/std exceeds
# about 5e3-8e3. What is left is the error of the local statistics themselves, that of a single
# process.
#
# Backward: one all_reduce of 2C numbers
# --------------------------------------
# Write x̂ = (x - mean)·invstd and g = dL/dx̂ = w·dy. Every x̂_j depends on every x_i in the global
# batch through mean and invstd. With dmean/dx_i = 1/n and, for σ = 1/invstd = sqrt(var + eps),
# dσ/dx_i = x̂_i/n (differentiate var = (1/n)Σ(x_j - mean)²; the Σ(x_j - mean) = 0 term drops
# out):
#
#     dx̂_j/dx_i = invstd·(δ_ij - 1/n - x̂_i·x̂_j/n)
#
#     dL/dx_i = Σ_j g_j·dx̂_j/dx_i = invstd·(g_i - Σ_j g_j/n - x̂_i·Σ_j g_j·x̂_j/n)
#             = w·invstd·(dy_i - A/n - x̂_i·B/n),      A = Σ dy,  B = Σ dy·x̂  (global sums)
#
# So each rank needs only two per-channel global sums: local [Σdy, Σdy·x̂] --all_reduce(SUM)-->
# [A, B], with Σdy·x̂ = (Σdy·t - (mean - x0)·Σdy)·invstd: the elementwise sums in float32 or
# better (dy·(x - mean) is not normalised: in float16 it would overflow) and sent in float64.
# The parameter gradients dL/dw = Σ dy·x̂ and dL/db = Σ dy stay LOCAL sums over this rank's
# samples, exactly as stock: DDP (or the ZeRO engine) averages parameter gradients across ranks
# afterwards, and summing them here too would count them twice.
#
# Latency: every collective here is a few KiB, so comm picks its algorithm by the alpha-beta model
# (``algorithm="auto"``): on gloo the one with the fewest messages, recursive doubling (log2 N)
# when N is a power of two, else a direct exchange (N-1), instead of the ring's 2(N-1). Both give
# every rank the same bits (the model: minishard/costs.py).
