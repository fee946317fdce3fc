"""Tutorial 15: when it hangs. Break a training loop in each known way; read what the doctor says.

    torchrun --standalone --nproc_per_node=2 tutorials/15_when_it_hangs.py

(Any number of ranks: rank 0 launches one small job per broken loop, 2 to 4 ranks each, with
torchrun, as you would; the other ranks wait for it.) A job hangs when the ranks stop issuing
the same collectives in the same order. After ``MINISHARD_TIMEOUT`` seconds a rank raises
``CollectiveError`` ("rank 0, all_gather of 0/float32 (from train.py:41): waited 3 s ..."):
WHERE it waited, not WHY. The why is in the other ranks. Every rank keeps a flight record (its
last 1024 collectives: op, buffers, group, the engine's phase, the backward pass, the line of
YOUR script) and writes it to ``$MINISHARD_FLIGHT_DIR`` when a collective fails, on SIGTERM,
Ctrl-C or ``kill -USR1`` (even while it waits inside one), and at exit. Then

    python -m minishard.doctor $MINISHARD_FLIGHT_DIR

lines the records up, collective by collective on each group, finds where the ranks stopped
agreeing, and reads the evidence that led there. Each cause says what it requires:

  a line only some ranks issued collectives from:     forward gathers: a forward on some ranks
    only (evaluation under `if rank == 0`); torch's, for a DTensor: a torch tool's collective
    on some ranks only (a norm logged on rank 0); a checkpoint's: a save on some ranks only
  ranks a backward pass apart: the extra pass reduced nothing: no_sync on some ranks only;
    it reduced: a backward on some ranks only (a batch skipped on one rank)
  one pass, reductions of different buffers            a parameter frozen on some ranks only
  a stream ends, its rank exited in step               uneven inputs without Join
  no record, the others' connections closed           a rank died (os._exit, OOM, a crash)

It names a cause only when exactly one fits. Otherwise its first line says "not sure", where
each rank is (the line, the pass) and the candidates: the records cannot tell them apart, you
can (is there a no_sync, or a requires_grad_, on one rank only?). A job that ended normally
says so, and what differed. Every report below is asserted: the cause or candidates, the line.
"""
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import minishard
from minishard.observe import doctor
from minishard.observe.dry_run import dry_run

LIMIT = 3.0  # MINISHARD_TIMEOUT for the broken jobs (default 600 s)


def broken_loop(cause: str, stage: int) -> None:
    """Three training steps of a small model, ``cause`` injected at step 1 on one rank."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)]
    if cause.startswith("syncbn"):  # SyncBatchNorms built alone are numbered in build order,
        if rank == 0:               # and rank 0 built one more first: #1 there, #0 here
            minishard.SyncBatchNorm(8)
        layers[1] = minishard.SyncBatchNorm(8)
    model = minishard.ZeRO(nn.Sequential(*layers), stage=stage, units={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = os.path.join(os.environ["MINISHARD_FLIGHT_DIR"], "ckpt")
    if cause == "join":  # first an epoch of uneven inputs under Join, as it should be
        with Join([model], optimizer=opt):
            for _ in range(2 + rank):
                model(torch.randn(2, 8)).sum().backward()
                opt.step(), opt.zero_grad()
    for step in range(2 if cause == "uneven" and rank == 1 else 3):
        evaluates = step == 1 and cause in ("eval", "syncbn_eval", "join") or \
            step == 0 and cause == "eval_first"  # nanoGPT's order: evaluate, then train
        if evaluates and rank == 0:
            with torch.no_grad():
                model(torch.randn(2, 8))  # CAUSE eval
        if step == 1 and cause == "save" and rank == 0:
            minishard.save_checkpoint(ckpt, model, opt)  # CAUSE save
        if step == 1 and cause == "frozen" and rank == 1:
            model.module[2].requires_grad_(False)
        if step == 1 and cause == "died" and rank == 1:
            os._exit(3)
        if cause == "micro" and rank == 1 or cause == "eval_first":
            with model.no_sync():  # one micro-batch more, accumulated (micro: on rank 1 only)
                model(torch.randn(2, 8)).sum().backward()
        skips_sync = cause == "no_sync" and rank == 0 and step == 0
        with model.no_sync() if skips_sync else nullcontext():
            loss = model(torch.randn(2, 8)).sum()  # FORWARD
            if step == 1 and cause == "skip" and rank == 1:
                continue  # a loss spike, say: this rank skips its backward and step
            loss.backward()  # TRAIN
        if step == 1 and cause == "norm" and rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # CAUSE norm
        opt.step()
        opt.zero_grad()


# cause -> (stage, ranks, what the doctor calls it, the lines it may name): stages 0-3, 2-4
# ranks. A cause that issues no collective itself (no_sync, a freeze, leaving early, dying) is
# named by the line whose collective the ranks then disagreed on: the training step's.
STEP = ("# FORWARD", "# TRAIN")
CASES = {
    "eval": (3, 3, "a forward on some ranks only", ("# CAUSE eval",)),
    "norm": (2, 2, "a torch tool's collective on some ranks only", ("# CAUSE norm",)),
    "save": (3, 2, "a save or full_state_dict on some ranks only", ("# CAUSE save",)),
    "uneven": (2, 2, "uneven inputs without Join", STEP),
    "no_sync": (0, 2, "no_sync on some ranks only", STEP),
    "skip": (3, 2, "a backward on some ranks only", STEP),
    "frozen": (2, 3, "a parameter frozen on some ranks only", STEP),
    "died": (1, 4, "a rank died", STEP),
}


HEALTHY = ("micro", "syncbn")  # loops that differ between ranks and do not hang

# Where the records cannot tell two causes apart, the doctor says "not sure" and names both:
# at stage 3 a rank that skipped its pass's reductions (no_sync) and one whose unit is frozen
# both go on gathering in backward where the other rank reduces; at stage 0, where a forward
# issues nothing, a rank that skipped a backward and one that had a batch fewer both end one
# reduction short. Which one is in your code?
BOTH_AT_3 = ("no_sync on some ranks only", "a parameter frozen on some ranks only")
BOTH_AT_0 = ("a backward on some ranks only", "uneven inputs without Join")
UNSURE = {("no_sync", 3): BOTH_AT_3, ("frozen", 3): BOTH_AT_3,
          ("skip", 0): BOTH_AT_0, ("uneven", 0): BOTH_AT_0}


def line_of(marker: str) -> str:
    with open(__file__) as f:
        number = next(i for i, s in enumerate(f, 1) if s.rstrip().endswith(marker))
    return f"{os.path.basename(__file__)}:{number}"


def run(cause: str, stage: int, world: int, flight_dir: str, launch=("--standalone",),
        planned: bool = False, env: dict | None = None) -> list[str]:
    """The broken job, launched as you would (torchrun, MINISHARD_TIMEOUT, MINISHARD_FLIGHT_DIR)
    and ended by itself; then the doctor's report. ``planned``: each rank first runs a dry run
    of 4 ranks (as ``python -m minishard.plan --check`` does)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items()  # not this lesson's torchrun's
           if not k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(MINISHARD_TIMEOUT=str(LIMIT), MINISHARD_FLIGHT_DIR=flight_dir, OMP_NUM_THREADS="1")
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch,
                        f"--nproc_per_node={world}", __file__, "--broken", cause, str(stage),
                        *["--dry-run"] * planned], env=env, capture_output=True,
                       timeout=LIMIT + 120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{cause}: a rank was left waiting (the job never ended)") from None
    report = doctor.diagnose(flight_dir)
    records = [json.loads(p.read_text()) for p in Path(flight_dir).glob("rank*.json")]
    job = max(records, key=lambda r: r["written"])["job"]  # this launch's (another's: aside)
    records = [r for r in records if r["job"] == job]
    up = min(r["armed"] for r in records)  # the clock starts when the ranks are up
    assert max(r["written"] for r in records) - up < LIMIT + 30, "a rank was left waiting"
    assert cause in HEALTHY or any(r["why"].startswith("failed: minishard") for r in records)
    return report


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        # The control: rank 1 accumulates one micro-batch more under no_sync each step (stage
        # 0, as DDP). Its ranks differ (backward passes), every collective agrees: no hang.
        report = run("micro", 0, 2, f"{root}/healthy")
        print("healthy loop, stage 0, 2 ranks:\n  " + "\n  ".join(report) + "\n")
        assert report[0].startswith("ended normally") and "backward passes" in report[0], report
        for cause, (stage, world, named, markers) in CASES.items():
            report = run(cause, stage, world, f"{root}/{cause}")
            print(f"{cause}, stage {stage}, {world} ranks:\n  " + "\n  ".join(report) + "\n")
            assert report[0].startswith(named + ":"), report
            assert any(line_of(m) in report[0] for m in markers), report
            assert report[-1] == f"fix: {doctor.CAUSES[named][1]}", report
        # An uncertain diagnosis: no_sync again, at stage 3. Read its first line: where each
        # rank is, and the two causes that leave these records; then look for either in your
        # code (here: model.no_sync() on rank 0 only).
        report = run("no_sync", 3, 2, f"{root}/unsure")
        print("no_sync, stage 3, 2 ranks:\n  " + "\n  ".join(report) + "\n")
        assert report[0].startswith("not sure: ") and line_of("# TRAIN") in report[0], report
        assert all(c in report[0] for c in UNSURE["no_sync", 3]), report
    print("All assertions held.")


def broken_job(cause: str, stage: int, planned: bool) -> None:
    """One rank of a broken job (torchrun starts it): an error ends it, as it would end yours."""
    if planned:  # a dry run first, as the planner's: nothing of it may reach the flight record
        with dry_run(world=4, rank=int(os.environ["RANK"])):
            model = minishard.ZeRO(nn.Sequential(nn.Linear(8, 8)), stage=stage)
            model(torch.randn(2, 8)).sum().backward()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    broken_loop(cause, stage)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--broken"]:
        broken_job(sys.argv[2], int(sys.argv[3]), "--dry-run" in sys.argv)
    else:
        with minishard.launch.session(timeout=900) as (rank, world):
            if rank == 0:  # the others wait for it at the end
                main()
