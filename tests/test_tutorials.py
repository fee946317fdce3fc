"""Every tutorial (and the tour) runs under torchrun on CPU and its own assertions hold.

The tutorials assert what they teach; here we only launch them as a learner would and check
that they exit cleanly. World size 2 for all; 4 where the tutorial's claim is about 4 ranks.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
AT_FOUR = {"03_sync_batchnorm.py", "04_zero_stages.py", "06_training_loop.py"}


# On a loaded machine, torch 2.13's gloo now and then aborts a rank at interpreter exit, AFTER
# destroy_process_group() ("terminate called without an active exception"); a plain torch DDP
# script does it too (about 1 run in 15 under load here). Such a run is retried once; any other
# failure, or a second abort, fails the test.
_EXIT_ABORT = "terminate called without an active exception"


def torchrun(nproc: int, *target: str, timeout: float = 180) -> str:
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", *target],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode == 0 or _EXIT_ABORT not in proc.stderr or attempt == 2:
            break
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_every_course_tutorial_is_here():
    numbers = {name[:2] for name in TUTORIALS}
    assert {"03", "04", "05", "06"} <= numbers, TUTORIALS


@pytest.mark.parametrize("nproc, name", [(2, t) for t in TUTORIALS] +
                         [(4, t) for t in TUTORIALS if t in AT_FOUR])
def test_tutorial_runs_with_torchrun(nproc, name):
    out = torchrun(nproc, f"tutorials/{name}")
    assert out.strip(), "a tutorial should print what it shows"


def test_tour_runs_with_torchrun():
    out = torchrun(2, "-m", "minishard.tour")
    assert "every claim asserted" in out


def test_plots_render(tmp_path):  # matplotlib: the 'plot' extra, also in 'test'
    png = tmp_path / "timeline.png"
    torchrun(2, "tutorials/05_just_in_time.py", "--plot", str(png))
    assert png.stat().st_size > 1000
