"""Tutorial 15: when it hangs. Break a training loop in each known way; let the doctor say which.

    torchrun --standalone --nproc_per_node=1 tutorials/15_when_it_hangs.py

(One rank on the command line: the lesson starts its own ranks, 2 to 4, one small job per broken
loop, with minishard.testing.RankPool, and must outlive each broken job.)

A data-parallel job hangs when the ranks stop issuing the same collectives in the same order:
one rank waits in a collective that another never calls. What you see is a frozen job, or after
``MINISHARD_TIMEOUT`` seconds a ``CollectiveError`` ("rank 0, all_gather of 0/float32: waited
3 s ..."): WHERE this rank waited, not WHY. The why is in the other ranks. So every rank keeps a
flight record (the last 1024 collectives: op, buffers, the engine's phase and unit, the backward
pass, the line of YOUR script that led to it) and writes it to ``$MINISHARD_FLIGHT_DIR`` when a
collective fails. Then

    python -m minishard.doctor $MINISHARD_FLIGHT_DIR

lines the ranks' records up, collective by collective on each group, and reads the first place
they disagree. What it finds there tells the causes apart:

  same collective, one rank from another line         a forward on some ranks only (evaluation
                                                      under `if rank == 0`)
  one rank's record ends, that rank exited            uneven inputs without Join
  a checkpoint's collective against a training one    a save decided on some ranks only
  the same reduction, one backward pass apart         no_sync on some ranks only
  reductions of different buffers in one backward     a parameter frozen on some ranks only
  no record at all                                    a rank died (os._exit, OOM, a crash)

A rank gloo aborts (it detects a size mismatch in its own thread, where no Python runs) writes
no record; faulthandler's ``rank<r>.fault`` shows where its Python was, and the doctor reads it.
Every diagnosis below is asserted: the cause, and the line of this file it names.
"""
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.observe import doctor
from minishard.testing import RankPool

LIMIT = 3.0  # MINISHARD_TIMEOUT for the broken jobs (default 600 s)


def broken_loop(cause: str, stage: int, flight_dir: str) -> dict:
    """Three training steps of a small model, ``cause`` injected at step 1 on one rank."""
    os.environ["MINISHARD_FLIGHT_DIR"] = flight_dir
    comm.set_timeout(LIMIT)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
                           stage=stage, units={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(2 if cause == "uneven" and rank == 1 else 3):
            if step == 1 and cause == "eval" and rank == 0:
                with torch.no_grad():
                    model(torch.randn(2, 8))  # CAUSE eval
            if step == 1 and cause == "save" and rank == 0:
                minishard.save_checkpoint(f"{flight_dir}/ckpt", model, opt)  # CAUSE save
            if step == 1 and cause == "frozen" and rank == 1:
                model.module[2].requires_grad_(False)
            if step == 1 and cause == "died" and rank == 1:
                os._exit(3)
            with model.no_sync() if cause == "no_sync" and rank == 0 and step == 0 \
                    else torch.enable_grad():
                model(torch.randn(2, 8)).sum().backward()  # TRAIN
            opt.step()
            opt.zero_grad()
    except (comm.CollectiveError, comm.CollectiveMismatch) as exc:
        return str(exc)
    minishard.dump_flight_record(why="exit")  # what leaving the script does (atexit)
    return None


# cause -> (stage, ranks, what the doctor calls it, the line it names): stages 0-3, 2-4 ranks.
# A cause that issues no collective itself (no_sync, a freeze, leaving early, dying) is named by
# the line whose collective the ranks then disagreed on: the training step's.
CASES = {
    "eval": (3, 3, "a forward on some ranks only", "# CAUSE eval"),
    "uneven": (2, 2, "uneven inputs without Join", "# TRAIN"),
    "save": (3, 2, "a save or full_state_dict on some ranks only", "# CAUSE save"),
    "no_sync": (0, 2, "no_sync on some ranks only", "# TRAIN"),
    "frozen": (2, 3, "a parameter frozen on some ranks only", "# TRAIN"),
    "died": (1, 4, "a rank died", "# TRAIN"),
}


def line_of(marker: str) -> str:
    with open(__file__) as f:
        number = next(i for i, s in enumerate(f, 1) if s.rstrip().endswith(marker))
    return f"{os.path.basename(__file__)}:{number}"


def run(cause: str, stage: int, world: int, flight_dir: str) -> list[str]:
    """The broken job, ended; then the doctor's report."""
    start = time.monotonic()
    with RankPool(world, timeout=60, error_grace=LIMIT + 5) as pool:  # the others' words
        try:
            errors = pool.run(broken_loop, cause, stage, flight_dir)
            assert cause == "none" or any(errors), errors  # the job failed...
            assert all(e is None or "minishard" in e for e in errors), errors  # ...in our words
        except TimeoutError as exc:  # a rank gone (os._exit, or aborted by gloo), not waiting
            assert "rank processes died" in str(exc), exc
    assert time.monotonic() - start < LIMIT + 30, "a rank was left waiting"
    return doctor.diagnose(flight_dir)


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        report = run("none", 3, 2, f"{root}/healthy")  # the control: nothing to find
        assert report[0].startswith("no divergence"), report
        print(f"healthy loop, stage 3, 2 ranks:\n  {report[0][:100]}...\n")
        for cause, (stage, world, named, marker) in CASES.items():
            report = run(cause, stage, world, f"{root}/{cause}")
            print(f"{cause}, stage {stage}, {world} ranks:\n  " + "\n  ".join(report) + "\n")
            assert report[0].startswith(named + ":") and line_of(marker) in report[0], report
            assert report[-1] == f"fix: {doctor.CAUSES[named]}", report
    print("All assertions held.")


if __name__ == "__main__":
    with minishard.launch.session(world_sizes={1}, why="it starts its own ranks, 2 to 4, "
                                  "one job per broken loop"):
        main()
