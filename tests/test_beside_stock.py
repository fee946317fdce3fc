"""Tutorial 12 (minishard beside DDP, ZeroRedundancyOptimizer, FSDP1 and FSDP2): it runs at 2 and
3 ranks (3: the flat buffers are padded) with every pair equal, and its table of spellings
covers every minishard option. tests/test_tutorials.py leaves these two runs to this file."""
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "tutorials" / "12_beside_the_stock_tools.py"
_EXIT_ABORT = "terminate called without an active exception"  # see tests/test_tutorials.py
_PEER_GONE = "Connection closed by peer"  # a rank gone at teardown, after the lesson finished


def torchrun(nproc: int) -> str:
    """The lesson under torchrun. A run whose lesson finished ("All assertions held.") but
    whose teardown failed (gloo's exit abort; measured once in about 20 runs at 3 ranks: a rank
    gone before the closing barrier) is retried once, and the retry REPORTED as a warning."""
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", str(LESSON)],
            cwd=ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        teardown = ("All assertions held." in proc.stdout
                    and (_EXIT_ABORT in proc.stderr or _PEER_GONE in proc.stderr))
        if proc.returncode == 0 or not teardown or attempt == 2:
            break
        warnings.warn(f"torchrun {nproc} {LESSON.name}: the lesson finished but a rank failed "
                      "at teardown; retried once (see tests/test_tutorials.py)")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_stage_equals_its_stock_equivalent(nproc):
    out = torchrun(nproc)
    rows = re.findall(r"^stage (\d)\s+(.+?)\s+(\S+e[-+]\d+)\s+(\S+e[-+]\d+)\s+(\S+e[-+]\d+)$",
                      out, re.MULTILINE)
    assert [(s, name) for s, name, *_ in rows] == [
        ("0", "DDP"), ("1", "DDP + ZeroRedundancyOptimizer"), ("2", "FSDP1 SHARD_GRAD_OP"),
        ("2", "FSDP2 reshard_after_forward=False"), ("3", "FSDP1 FULL_SHARD"),
        ("3", "FSDP2 fully_shard")], out
    assert all(float(d) < 1e-6 for *_, a, b, c in rows for d in (a, b, c)), out
    assert out.rstrip().endswith("All assertions held."), out


def test_the_table_spells_every_option():
    spec = importlib.util.spec_from_file_location("lesson12", LESSON)
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    table = lesson.options_table()
    options = [line for line in table.splitlines() if not line.startswith(" ")]
    for option in ("stage=0", "stage=1", "stage=2", "stage=3", "units=", "mixed_precision=",
                   "prefetch=", "no_sync", "clip_grad_norm_", "gathered", "full_state_dict",
                   "process_group=", "mesh=", "replicate=", "persist_below="):
        assert any(option in line for line in options), option
    for block in table.split("\n")[0::4]:  # every option has its three stock spellings
        i = table.splitlines().index(block)
        assert [line.split()[0] for line in table.splitlines()[i + 1:i + 4]] == \
            ["FSDP1", "FSDP2", "DeepSpeed"], block
