"""Peak resident memory per system, each trained alone in a fresh torchrun job.

    python bench/rss.py [--model mlp|gpt] [--nproc 2]
    python bench/rss.py --wrap            (wrapping only: eager vs meta build, stage 3, 2 and 4 ranks)

Real process memory, so the stages' memory claims show up outside minishard's own accounting:
the resident set's growth from before the system is built to after its training steps, and to
its high-water mark (getrusage's max RSS) during them; max over ranks. Runs
bench/zero_vs_stock.py --only SYSTEM for every system.

``--wrap`` measures WRAPPING alone: the resident set's high-water mark while one rank builds the
model and ``minishard.ZeRO(..., stage=3)`` wraps it, minus the resident set just before (the
kernel's peak, VmHWM, is reset first through /proc/self/clear_refs), max over ranks; beside it
memory_report's exact ``peak_wrapping``, the formula shards + largest unit, and the whole model.
An eager build holds the whole model before wrapping starts; a meta build allocates nothing
until ZeRO materialises it one module at a time.
"""
import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ["floor", "torch DDP", "torch DDP+ZeRO-opt", "FSDP1 SHARD_GRAD_OP", "FSDP1 FULL_SHARD",
           "FSDP2 no-reshard", "FSDP2", "minishard stage 0", "minishard stage 1",
           "minishard stage 2", "minishard stage 3", "minishard stage 3 +prefetch",
           "minishard stage 3 +prefetch +4MiB"]


WRAP_LAYERS, WRAP_WIDTH = 8, 1024  # 8 units of Linear(1024): 4.2 MB each, 33.6 MB in all


def _resident(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


def wrap_worker(build: str) -> None:
    """One rank (under torchrun): build eagerly or on meta, wrap at stage 3, report bytes."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    import minishard
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    world = dist.get_world_size()

    def layers(width=WRAP_WIDTH):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(WRAP_LAYERS)])
    with torch.device("meta" if build == "meta" else "cpu"):
        warm = layers(8)  # the same code paths once, small: the first use of a kernel faults
    minishard.ZeRO(warm, stage=3, units={nn.Linear}, device="cpu")  # its code pages in
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident set
    before = _resident("VmRSS")
    if build == "meta":
        with torch.device("meta"):
            module = layers()
    else:
        module = layers()
    model = minishard.ZeRO(module, stage=3, units={nn.Linear}, device="cpu")
    growth = _resident("VmHWM") - before
    unit = WRAP_WIDTH * WRAP_WIDTH + WRAP_WIDTH
    shards = WRAP_LAYERS * math.ceil(unit / world) * 4
    row = torch.tensor([growth, model.memory_report()["peak_wrapping"], shards + unit * 4,
                        WRAP_LAYERS * unit * 4], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # bench code: not the library's door
    if dist.get_rank() == 0:
        print("WRAP " + " ".join(f"{v / 2**20:.2f}" for v in row.tolist()))
    dist.barrier()
    dist.destroy_process_group()


def wrap_table(env: dict) -> None:
    print(f"wrapping {WRAP_LAYERS} x Linear({WRAP_WIDTH}) at stage 3, units = each Linear (MiB, "
          "max over ranks)")
    print(f"  {'ranks':<6}{'build':<7}{'RSS growth':>12}{'accounted':>11}{'formula':>9}"
          f"{'model':>8}{'RSS/formula':>13}")
    for nproc in (2, 4):
        for build in ("eager", "meta"):
            out = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}", str(Path(__file__).resolve()), "--wrap-worker",
                 build], capture_output=True, text=True, env=env).stdout
            m = re.search(r"WRAP ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)", out)
            if not m:
                print(f"  {nproc:<6}{build:<7}{'failed':>12}")
                continue
            rss, acc, formula, model = map(float, m.groups())
            print(f"  {nproc:<6}{build:<7}{rss:>12.2f}{acc:>11.2f}{formula:>9.2f}{model:>8.2f}"
                  f"{rss / formula:>12.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--wrap", action="store_true", help="measure wrapping only (see doc)")
    parser.add_argument("--wrap-worker", choices=["eager", "meta"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.wrap_worker:
        return wrap_worker(args.wrap_worker)
    # glibc keeps freed large blocks for reuse unless the mmap threshold is fixed: then every
    # large tensor is its own mapping, returned to the OS when freed, and RSS tracks live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    if args.wrap:
        return wrap_table(env)
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
