"""Tutorial 02: data parallelism, i.e. DDP built from one all-reduce.

    torchrun --standalone --nproc_per_node=2 tutorials/02_data_parallel.py
    torchrun --standalone --nproc_per_node=4 tutorials/02_data_parallel.py

Two ways to use N devices for one model:

  * MODEL parallelism splits the MODEL: each rank holds some of the layers (pipeline) or a slice of
    every weight matrix (tensor parallel), and activations travel between ranks on every layer.
    It is how you fit a model that is too big for one device; the model code has to change.
  * DATA parallelism splits the BATCH: every rank holds the whole model and computes on its own
    B/N samples; the ranks only have to agree on the gradient before each step. The model code
    does not change. That is DDP, and (with sharded storage) ZeRO and FSDP: everything minishard
    does is data parallelism.

Why it is exact: with a loss that is the MEAN over the batch and equal slices, the gradient of the
global batch is the average of the per-rank gradients,

    grad L(B) = grad (1/B) sum_i l_i = (1/N) sum_r grad (1/(B/N)) sum_{i in slice r} l_i
              = (1/N) sum_r grad L(slice r)

so one all_reduce(avg) of the gradients, then an identical optimizer step on every rank, trains
exactly the model one process would train on the whole batch. This script does it by hand through
minishard.comm, then shows what goes wrong if the gradients are SUMMED instead of averaged, then
runs the same training with minishard.ZeRO(stage=0) and with torch's DistributedDataParallel,
and asserts that all of them equal the one-process reference.
"""
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard
from minishard import comm

PER_RANK, STEPS, LR = 4, 3, 0.1
TOL = dict(rtol=1e-5, atol=1e-6)  # only the order of float additions differs between the ways


def make_model() -> nn.Module:
    """Same seed: the same initial weights on every rank (DDP and ZeRO would broadcast rank 0's
    anyway; the by-hand version relies on the seed)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank draws the SAME global batches (same seed) and keeps its own slice; a real job
    uses a DistributedSampler, but this way every rank can also compute the reference."""
    gen = torch.Generator().manual_seed(1)
    B = PER_RANK * world
    return [(torch.randn(B, 8, generator=gen), torch.randn(B, 1, generator=gen))
            for _ in range(STEPS)]


def train_one_process(batches, lr: float) -> tuple[nn.Module, list[float]]:
    """The reference: ONE process, the WHOLE batch, mean loss, plain SGD."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def train_by_hand(batches, rank: int, op: str, ledgers=None) -> nn.Module:
    """DDP from scratch: local forward/backward on this rank's slice, all_reduce every gradient
    with ``op`` ("avg" is right, "sum" is the bug), then the same SGD step on every rank."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()   # the mean over THIS rank's slice
        with minishard.ledger() as led:
            for p in model.parameters():                   # one collective per tensor
                comm.all_reduce(p.grad, op, tag="by hand")
        if ledgers is not None:
            ledgers.append(led)
        opt.step()  # identical grads + identical params -> identical params after the step
    return model


def max_diff(a: nn.Module, b_state: dict) -> float:
    return max((p - b_state[k]).abs().max().item() for k, p in a.state_dict().items())


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    batches = global_batches(world)
    say(f"{world} ranks x {PER_RANK} samples = global batch of {PER_RANK * world}; "
        f"{STEPS} SGD steps, lr {LR}\n")

    reference, ref_losses = train_one_process(batches, LR)
    ref = reference.state_dict()

    # --------------------------------------------------------- 1. DDP by hand: average the grads
    ledgers = []
    by_hand = train_by_hand(batches, rank, "avg", ledgers)
    for k, p in by_hand.state_dict().items():
        torch.testing.assert_close(p, ref[k], **TOL, msg=k)
    say("1. By hand: grads on my slice -> all_reduce(avg) -> step.")
    say(f"   max |by hand - one process on the global batch| = {max_diff(by_hand, ref):.1e} "
        "(every parameter, every rank: asserted)")
    psi = sum(p.numel() for p in by_hand.parameters())
    led = ledgers[-1]
    assert led.count("all_reduce") == len(list(by_hand.parameters()))
    # The ring model, fp32 gradients; a Fraction, since 2(N-1)/N x 4 psi need not be a whole
    # number for one rank (the ledger keeps exact fractions too).
    assert led.total_bytes() == Fraction(2 * (world - 1) * 4 * psi, world)
    say(f"   per step each rank issued {led.count()} all-reduces (one per parameter tensor) and "
        f"sent {float(led.total_bytes()):g} bytes\n   = 2(N-1)/N x {psi} params x 4 bytes.\n")

    # ---------------------------------------------------- 2. the classic bug: SUM, not average
    # Summing gives N times the global-batch gradient. With SGD the step is lr * grad, so that is
    # exactly SGD with lr x N: the run does not crash, it just trains with the wrong learning rate
    # (and diverges sooner). (Adam would barely notice: it divides by the gradient's own scale.)
    summed = train_by_hand(batches, rank, "sum")
    lr_times_n, big_lr_losses = train_one_process(batches, LR * world)
    wrong = max_diff(summed, ref)
    for k, p in summed.state_dict().items():
        torch.testing.assert_close(p, lr_times_n.state_dict()[k], **TOL, msg=k)
    say("2. The bug: all_reduce(SUM) instead of the average.")
    if world == 1:  # the sum over one rank IS the average: the bug hides until the job scales
        assert wrong == 0.0, wrong
        say("   with 1 rank the sum over ranks IS the average (asserted: max |summed - reference|"
            " = 0):\n   this bug only shows once you add ranks. Run with 2 or more to see it.\n")
    else:
        assert wrong > 1e-3, wrong
        say(f"   max |summed - reference|              = {wrong:.3f}   "
            "(diverged: asserted > 1e-3)")
        say(f"   max |summed - one process with lr x {world}| = "
            f"{max_diff(summed, lr_times_n.state_dict()):.1e} (the same run: asserted)")
        say(f"   global-batch loss per step, reference vs lr x {world} (= summed): " + ",  ".join(
            f"{a:.4f} vs {b:.4f}" for a, b in zip(ref_losses, big_lr_losses)) + "\n")

    # ----------------------------------------------- 3. the same with minishard.ZeRO and torch DDP
    # ZeRO(stage=0) is this DDP: each rank keeps everything, gradients are all-reduced (averaged)
    # at the end of backward. torch's DDP does the same with bucketed all-reduces, overlapped
    # with backward. Both broadcast rank 0's initial weights when they are built.
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    zero = minishard.ZeRO(make_model(), stage=0)
    ddp = DDP(make_model())
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (zero, ddp)]  # AFTER wrapping
    for step, (x, y) in enumerate(batches):
        for model, opt in zip((zero, ddp), opts):
            opt.zero_grad()
            if model is zero and step == STEPS - 1:
                with minishard.ledger() as zero_led:
                    F.mse_loss(model(x[mine]), y[mine]).backward()
            else:
                F.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
    zero_state = zero.full_state_dict()          # the unwrapped model's names, full tensors
    for k in ref:
        torch.testing.assert_close(zero_state[k], ref[k], **TOL, msg=k)
        torch.testing.assert_close(ddp.module.state_dict()[k], ref[k], **TOL, msg=k)
    # Same bytes as by hand, in ONE collective: stage 0 keeps the parameters (so the gradients)
    # in one flat buffer per unit, and all-reduces it whole. Fewer, bigger messages: what DDP's
    # gradient buckets are for.
    assert zero_led.count("all_reduce") == 1 and zero_led.total_bytes() == led.total_bytes()
    say("3. Same training, three implementations, all equal to one process on the global batch:")
    say(f"   by hand                      max diff {max_diff(by_hand, ref):.1e}")
    say(f"   minishard.ZeRO(stage=0)      max diff "
        f"{max((zero_state[k] - ref[k]).abs().max().item() for k in ref):.1e}   "
        f"({zero_led.count()} all-reduce of the flat gradient per step, same bytes)")
    say(f"   torch DistributedDataParallel max diff {max_diff(ddp.module, ref):.1e}")
    say("\nAll assertions held.")


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session() as (rank, world):
        main(rank, world)
