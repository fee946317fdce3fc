"""Fault tolerance with real process deaths, not simulated ones.

1. A torchrun job (tests/fault_train.py, ZeRO-3, Adam, a checkpoint every step) loses rank 1 to
   ``os._exit(1)`` in the middle of step 3; torchrun --max-restarts restarts both ranks, the job
   resumes from the newest complete checkpoint and must end BIT-FOR-BIT where an uninterrupted run
   of the same script ends (parameters, and the last checkpoint's master values + Adam state).
2. Rank 0 is killed inside save_checkpoint after every rank file is written and just before
   meta.pt lands. The half-written directory must be skipped by latest_checkpoint and refused by
   load_checkpoint (on every rank, none hangs); the previous checkpoint loads and holds the
   previous step's parameters; resuming from it and saving into the half-written directory again
   gives the uninterrupted run's values.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minishard.checkpoint.state import (CheckpointError, check_checkpoint, checkpoint_path,
                                        latest_checkpoint, load_checkpoint, save_checkpoint)
from minishard.testing import RankError, RankPool

from fault_train import build, forward_backward  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests/fault_train.py"
STEPS = 5

# As in test_tutorials.py: under load, torch 2.13's gloo now and then aborts a rank at interpreter
# exit, AFTER destroy_process_group ("terminate called without an active exception"). A run that
# failed with that text is retried once from scratch (fresh checkpoint root); any other failure, or
# a second abort, fails the test. The deliberate death is os._exit(1) and prints no such text.
_EXIT_ABORT = "terminate called without an active exception"


def torchrun_job(tmp_path, name, *script_args, max_restarts=0, timeout=150):
    """Run fault_train.py on 2 ranks; return (stdout, root, out file) of the successful try."""
    for attempt in (1, 2):
        root, out = tmp_path / f"{name}-{attempt}", tmp_path / f"{name}-{attempt}.pt"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             f"--max-restarts={max_restarts}",
             "--monitor-interval=0.1",  # how often the agent polls its workers (seconds)
             SCRIPT, "--root", str(root), "--steps", str(STEPS), "--out", str(out), *script_args],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1",
                 # torch 2.13 + gloo + --max-restarts: by default the restarted ranks share the
                 # agent's rendezvous TCPStore with the failed attempt, read that attempt's stale
                 # gloo addresses under the same keys, and init_process_group hangs until the
                 # gloo connect timeout (rank 0 dialing the dead rank 1's old port). This makes
                 # every attempt bootstrap a fresh store (new MASTER_PORT). See
                 # tutorials/08_launching.md, section 6. Harmless for runs that never restart.
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        if proc.returncode == 0 or _EXIT_ABORT not in proc.stderr or attempt == 2:
            break
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, root, out


def rank_files(ckpt):
    return {r: torch.load(os.path.join(ckpt, f"rank{r}-of-2.pt"), weights_only=True)
            for r in range(2)}


def assert_bitwise_equal(a, b, where=""):
    """Nested dicts/lists of tensors and plain values: same structure, torch.equal tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: values differ (max |diff| {(a - b).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} vs {b}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


# ------------------------------------------------------------------ 1. a rank dies mid-training
def test_killed_rank_restarts_and_resumes_bitwise(tmp_path):
    out_i, root_i, final_i = torchrun_job(tmp_path, "interrupted", "--die-at", "3",
                                          "--die-rank", "1", max_restarts=2)
    out_u, root_u, final_u = torchrun_job(tmp_path, "straight")

    # The interrupted job really died at step 3 before that step's checkpoint, was restarted by
    # torchrun, and resumed from step 2 (the newest complete checkpoint).
    lines_i = out_i.splitlines()
    assert "rank 1: dying at step 3 (attempt 0)" in lines_i, out_i
    assert "attempt 0: step 2 saved" in lines_i and "attempt 0: step 3 saved" not in lines_i, out_i
    assert "attempt 0: done" not in lines_i, out_i
    assert "attempt 1: resumed from step-000002" in lines_i, out_i
    assert [f"attempt 1: step {s} saved" for s in range(3, STEPS + 1)] == \
        [line for line in lines_i if line.startswith("attempt 1: step")], out_i
    assert "attempt 1: done" in lines_i, out_i
    # The uninterrupted one ran every step in one attempt.
    assert out_u.splitlines() == (["attempt 0: fresh start"] +
                                  [f"attempt 0: step {s} saved" for s in range(1, STEPS + 1)] +
                                  ["attempt 0: done"]), out_u

    # Final parameters: bit-for-bit the same.
    a = torch.load(final_i, weights_only=True)
    b = torch.load(final_u, weights_only=True)
    assert sorted(a) == sorted(b) and len(a) == 8  # 3 blocks + head, weight and bias each
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max()}"

    # The last checkpoints too: every rank's master values AND Adam state (exp_avg, exp_avg_sq,
    # step). Adam's step proves the restored optimizer state was used (a fresh Adam would say 3).
    last_i, last_u = rank_files(checkpoint_path(root_i, STEPS)), rank_files(checkpoint_path(root_u,
                                                                                            STEPS))
    assert_bitwise_equal(last_i, last_u, "step-%06d" % STEPS)
    for r in range(2):
        for name, entry in last_i[r]["params"].items():
            assert float(entry["scalars"]["step"]) == STEPS, (r, name, entry["scalars"])
            assert set(entry["state"]) == {"exp_avg", "exp_avg_sq"}, (r, name)
    # ...and training moved the parameters (the comparison above is not between two no-ops).
    first = rank_files(checkpoint_path(root_u, 1))
    assert any(not torch.equal(first[0]["params"][n]["value"], e["value"])
               for n, e in last_u[0]["params"].items())
    # Every step directory of the interrupted run is complete, step 3 included (its first,
    # partial save was redone by the restarted attempt).
    for s in range(1, STEPS + 1):
        check_checkpoint(checkpoint_path(root_i, s))
    assert latest_checkpoint(root_i) == checkpoint_path(root_i, STEPS)


# ------------------------------------------------------- 2. a rank dies in the middle of a save
def _step(model, opt, step):
    forward_backward(model, opt, step, dist.get_rank(), dist.get_world_size())
    opt.step()


def save_step1_then_die_before_meta_of_step2(root, witness_dir):
    """Step 1, complete checkpoint; step 2, whose save kills rank 0 just before meta.pt lands."""
    model, opt = build()
    _step(model, opt, 1)
    save_checkpoint(checkpoint_path(root, 1), model, opt)
    after_step1 = model.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(after_step1, os.path.join(witness_dir, "after_step1.pt"))
    _step(model, opt, 2)
    if dist.get_rank() == 0:
        real_replace = os.replace

        def replace_then_die(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(dst)) == "meta.pt":  # meta.pt is complete in src
                with open(os.path.join(witness_dir, "died"), "w") as fh:
                    fh.write(f"{src} -> {dst}\n")
                os._exit(1)  # killed between "every rank file written" and "meta.pt in place"
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace_then_die  # this process is about to die: no need to restore it
    save_checkpoint(checkpoint_path(root, 2), model, opt)
    return "survived"


def try_load(ckpt):
    """Each rank's error message when loading ``ckpt``, or None if it loaded."""
    model, opt = build(seed=99)
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def resume_after_crash(root):
    """Refuse the partial step 2; load step 1; redo step 2 and save it into the same directory."""
    model, opt = build(seed=99)  # other initial values: whatever we get must come from a file
    before = model.full_state_dict()
    try:
        load_checkpoint(checkpoint_path(root, 2), model, opt)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(v, before[k]) for k, v in model.full_state_dict().items())
    meta = load_checkpoint(latest_checkpoint(root), model, opt)
    loaded = model.full_state_dict()
    _step(model, opt, 2)
    save_checkpoint(checkpoint_path(root, 2), model, opt)  # no meta.pt there: not "existing"
    return refused, unchanged, meta["world_size"], loaded, model.full_state_dict()


def straight_two_steps():
    model, opt = build()
    _step(model, opt, 1)
    _step(model, opt, 2)
    return model.full_state_dict()


def test_rank_killed_between_shard_files_and_meta(tmp_path):
    root, witness = tmp_path / "ckpt", tmp_path / "witness"
    witness.mkdir()
    step1, step2 = checkpoint_path(root, 1), checkpoint_path(root, 2)
    with RankPool(2, timeout=60) as pool:  # a pool of its own: its rank 0 is going to die
        with pytest.raises((TimeoutError, RankError)) as info:
            pool.run(save_step1_then_die_before_meta_of_step2, str(root), str(witness))
        # Rank 0 died for real (the pool noticed a dead process), or rank 1 failed first in the
        # collective whose peer vanished. Either way, rank 0 never raised an exception of its own.
        if isinstance(info.value, RankError):
            assert info.value.rank == 1, info.value
        else:
            assert "died" in str(info.value) and "minishard-rank0" in str(info.value), info.value
        assert (witness / "died").read_text().strip().endswith(os.path.join(step2, "meta.pt"))

        # On disk: both rank files of step 2 are whole and in place; meta.pt is not (its
        # temporary file is, since the crash came between writing it and renaming it).
        names = sorted(os.listdir(step2))
        assert "meta.pt" not in names and {"rank0-of-2.pt", "rank1-of-2.pt"} <= set(names), names
        assert any(n.startswith("meta.pt.tmp") for n in names), names
        assert sorted(os.listdir(step1)) == ["meta.pt", "rank0-of-2.pt", "rank1-of-2.pt"]

        # Skipped by latest_checkpoint (with and without checksums), refused by check_checkpoint.
        assert latest_checkpoint(root) == step1
        assert latest_checkpoint(root, checksums=True) == step1
        with pytest.raises(CheckpointError, match=r"is incomplete: meta\.pt is missing.*"
                                                  r"latest_checkpoint\(root\)"):
            check_checkpoint(step2)

        # Fresh ranks (the pool rebuilds itself): both refuse the partial directory, loudly and
        # without hanging, leaving the model untouched.
        errors = pool.run(try_load, step2)
        assert all(e is not None and "incomplete: meta.pt is missing" in e for e in errors), errors

        refused, unchanged, world, loaded, redone = zip(*pool.run(resume_after_crash, str(root)))
        assert all(r is not None and "incomplete: meta.pt is missing" in r for r in refused)
        assert all(unchanged) and world == (2, 2)
        straight = pool.run(straight_two_steps)

    # The previous checkpoint holds exactly step 1's parameters, on every rank...
    after_step1 = torch.load(witness / "after_step1.pt", weights_only=True)
    for r in range(2):
        assert_bitwise_equal(loaded[r], after_step1, f"rank {r} loaded")
    # ...which are not what the next step would have produced (the check can tell them apart).
    assert any(not torch.equal(after_step1[k], straight[0][k]) for k in after_step1)
    # Resuming from it and redoing step 2 equals the uninterrupted run, and the redone save
    # completed the directory the crash had left behind.
    for r in range(2):
        assert_bitwise_equal(redone[r], straight[0], f"rank {r} after resuming")
    assert latest_checkpoint(root, checksums=True) == step2
