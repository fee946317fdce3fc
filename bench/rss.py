"""Peak resident memory per system, each trained alone in a fresh torchrun job.

    python bench/rss.py [--model mlp|gpt] [--nproc 2]

Real process memory, so the stages' memory claims show up outside minishard's own accounting:
the resident set's growth from before the system is built to after its training steps, and to
its high-water mark (getrusage's max RSS) during them; max over ranks. Runs
bench/zero_vs_stock.py --only SYSTEM for every system.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ["floor", "torch DDP", "torch DDP+ZeRO-opt", "FSDP1 SHARD_GRAD_OP", "FSDP1 FULL_SHARD",
           "FSDP2 no-reshard", "FSDP2", "minishard stage 0", "minishard stage 1",
           "minishard stage 2", "minishard stage 3", "minishard stage 3 +prefetch"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    # glibc keeps freed large blocks for reuse unless the mmap threshold is fixed: then every
    # large tensor is its own mapping, returned to the OS when freed, and RSS tracks live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    print(f"model {args.model}, {args.nproc} ranks: resident memory growth per rank (MiB), "
          "after the steps and at the peak")
    for name in SYSTEMS:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={args.nproc}", str(HERE / "zero_vs_stock.py"), "--model",
             args.model, "--steps", "5", "--warmup", "2", "--only", name],
            capture_output=True, text=True, env=env).stdout
        m = re.search(r"resident growth ([\d.]+) MiB after the steps, peak growth ([\d.]+)", out)
        print(f"  {name:<30}" + (f"{m.group(1):>8}{m.group(2):>8}" if m else f"{'failed':>8}"))


if __name__ == "__main__":
    main()
