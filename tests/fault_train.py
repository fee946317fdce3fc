"""A small deterministic, resumable training job for the fault-tolerance tests (tests/test_faults.py).

Not a test module (pytest does not collect it): launch it with torchrun, e.g.::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=2 \
        tests/fault_train.py --root CKPT --steps 5 --die-at 3 --die-rank 1 --out final.pt

Steps are numbered 1..N. Step s: forward/backward on the global batch of step s (a function of s
only, split evenly over the ranks), optimizer step, then ``save_checkpoint(checkpoint_path(root,
s))``. At start-up the job resumes from ``latest_checkpoint(root)`` if there is one and continues
at the next step, so an interrupted and restarted job must end bit-for-bit where an uninterrupted
one does. With ``--die-at s --die-rank r``, rank r kills itself (``os._exit(1)``: no cleanup, no
exception handling, like a lost node) at step s, after forward/backward and before that step's
checkpoint -- on the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT == "0"``).

Rank 0 prints one line per event on stdout (``attempt A: resumed from step-000002``, ``attempt A:
step S saved``, ``attempt A: done``); the tests read them. At the end every rank computes
``full_state_dict()`` (collective) and rank 0 writes it atomically to ``--out`` with torch.save.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.checkpoint.state import checkpoint_path

D, GLOBAL_BATCH = 8, 8  # the global batch divides evenly over 1, 2, 4 or 8 ranks


class Block(nn.Module):
    """One ZeRO unit: its parameters are gathered only while it computes (stage 3)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def build(seed=0):
    torch.manual_seed(seed)  # ZeRO also broadcasts rank 0's initial values
    module = nn.Sequential(Block(D), Block(D), Block(D), nn.Linear(D, 1))  # head: the root unit
    model = minishard.ZeRO(module, stage=3, units={Block})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # AFTER wrapping: over the shards
    return model, opt


def global_batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, D, generator=gen), torch.randn(GLOBAL_BATCH, 1, generator=gen)


def forward_backward(model, opt, step, rank, world):
    """This rank's share of step ``step``'s global batch: zero the gradients, forward, backward
    (the caller then steps the optimizer)."""
    n = GLOBAL_BATCH // world
    x, y = global_batch(step)
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint directory (one subdir per step)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=None, help="step at which --die-rank dies")
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--out", required=True, help="final full_state_dict(), written by rank 0")
    args = parser.parse_args(argv)
    if args.die_at is not None and not 1 <= args.die_at <= args.steps:
        parser.error(f"--die-at must be a step in 1..{args.steps}")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # set by torchrun: 0, 1, 2, ...

    def say(msg):
        if rank == 0:
            print(f"attempt {attempt}: {msg}", flush=True)

    model, opt = build()
    start = 0
    latest = minishard.latest_checkpoint(args.root)  # the newest COMPLETE checkpoint, or None
    if latest is not None:
        minishard.load_checkpoint(latest, model, opt)  # collective
        start = int(os.path.basename(latest).split("-")[1])  # "step-000002" -> 2
        say(f"resumed from {os.path.basename(latest)}")
    else:
        say("fresh start")

    for step in range(start + 1, args.steps + 1):
        forward_backward(model, opt, step, rank, world)
        if step == args.die_at and rank == args.die_rank and attempt == 0:
            print(f"rank {rank}: dying at step {step} (attempt {attempt})", flush=True)
            os._exit(1)  # no cleanup: the process is simply gone, mid-job
        opt.step()
        minishard.save_checkpoint(checkpoint_path(args.root, step), model, opt)
        say(f"step {step} saved")

    final = model.full_state_dict()  # collective: every rank gathers
    if rank == 0:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        torch.save(final, tmp)
        os.replace(tmp, args.out)  # readers see no file or the whole file
    say("done")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
