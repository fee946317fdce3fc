"""Tutorial 03 runs under torchrun and its own assertions hold (SyncBatchNorm + DDP on N ranks ==
BatchNorm on the global batch in one process; one all_reduce each way per BN layer)."""
import os
import subprocess
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "03_sync_batchnorm.py"


def test_tutorial_03_runs_with_torchrun_on_two_ranks():
    # World size 2 only: each rank imports torch, which takes most of the time; the tutorial's
    # assertions do not depend on the world size (run it with --nproc_per_node=4 by hand).
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(TUTORIAL)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "equals" in proc.stdout and "SyncBatchNorm(16) 4 backward" in proc.stdout
