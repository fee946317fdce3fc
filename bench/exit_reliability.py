"""How often does a lesson that passed still end in a failed run? Count non-zero exits.

    python bench/exit_reliability.py                  (50 runs at 3 ranks: the lessons in turn)
    python bench/exit_reliability.py --runs 20 --nproc 2 --only 03_sync_batchnorm.py

torch 2.13's gloo now and then aborts a rank at interpreter exit ("terminate called without an
active exception", pytorch#190489) after the script has printed its result; torchrun then
reports the run FAILED. minishard.launch.session ends every lesson so that this should not
happen (see its docstring). This script runs the lessons (tutorials/NN_*.py, in turn) under
torchrun the way a learner does, and reports every non-zero exit: which lesson, its status,
whether the lesson had finished ("All assertions held."), and whether the exit abort was the
cause. Target: 0. It does not take the shared CPU lock itself: run it under the lock.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_ABORT = "terminate called without an active exception"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs in total (default 50)")
    parser.add_argument("--nproc", type=int, default=3, help="ranks per run (default 3)")
    parser.add_argument("--only", help="one lesson's file name instead of all in turn")
    args = parser.parse_args()
    lessons = [args.only] if args.only else sorted(
        p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    failures, seconds = [], collections.defaultdict(list)
    start = time.perf_counter()
    for i in range(args.runs):
        name = lessons[i % len(lessons)]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={args.nproc}", f"tutorials/{name}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        seconds[name].append(time.perf_counter() - t0)
        if proc.returncode != 0:
            failures.append((i, name, proc.returncode, "All assertions held." in proc.stdout,
                             EXIT_ABORT in proc.stderr))
            print(f"run {i + 1}: {name} exited {proc.returncode}\n{proc.stderr[-1500:]}",
                  flush=True)
    total = time.perf_counter() - start
    print(f"\n{args.runs} runs at {args.nproc} ranks ({', '.join(lessons)} in turn), "
          f"{total:.0f} s: {len(failures)} non-zero exits")
    for i, name, rc, finished, aborted in failures:
        print(f"  run {i + 1:>3}  {name:<28} exit {rc}  lesson finished: {finished}  "
              f"exit abort: {aborted}")
    print("\nseconds per run (mean):", ", ".join(
        f"{name[:2]} {sum(v) / len(v):.1f}" for name, v in seconds.items()))


if __name__ == "__main__":
    main()
