"""Peak resident memory per system, each trained alone in a fresh torchrun job.

    python bench/rss.py [--model mlp|gpt] [--nproc 2]
    python bench/rss.py --wrap            (wrapping only: eager vs meta build, stage 3, 2 and 4 ranks)
    python bench/rss.py --walls [--nproc 3] [--blocks 16] [--width 512]
                                          (the memory wall: a rank-0 export, twice the model, a meta wrap)

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


def _growth(fn) -> int:
    """Resident-set growth while ``fn()`` runs: the kernel's high-water mark (VmHWM, reset first
    through /proc/self/clear_refs) minus the resident set just before."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _resident("VmRSS")
    fn()
    return _resident("VmHWM") - before


def walls_worker(phase: str, blocks: int, width: int) -> None:
    """One rank (under torchrun, a fresh job per phase: freed memory a process keeps would hide
    the next phase's growth) of the memory wall's two promises at stage 3, as a fraction of the
    model's fp32 bytes, max over the ranks the promise is about:

      export   full_state_dict(rank0_only=True): growth of the ranks other than 0
      meta     wrapping a model built on the meta device: growth of every rank
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    import minishard
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def layers(n, w=width):
        return nn.Sequential(*[nn.Linear(w, w) for _ in range(n)])
    with torch.device("meta" if phase == "meta" else "cpu"):
        warm, module = layers(2, 8), layers(blocks)
    minishard.ZeRO(warm, stage=3, units={nn.Linear}, device="cpu").full_state_dict(
        rank0_only=True)  # the code paths once, small: pages of code and kernels
    if phase == "export":
        model = minishard.ZeRO(module, stage=3, units={nn.Linear})
        dist.barrier()
        grown = 0 if rank == 0 else _growth(lambda: model.full_state_dict(rank0_only=True))
        if rank == 0:
            model.full_state_dict(rank0_only=True)
    else:
        dist.barrier()
        grown = _growth(lambda: minishard.ZeRO(module, stage=3, units={nn.Linear}, device="cpu"))
    row = torch.tensor([grown / (blocks * (width * width + width) * 4)], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # bench code: not the library's door
    if rank == 0:
        print(f"WALL {phase} {row.item():.3f}")
    dist.barrier()
    dist.destroy_process_group()


def walls(nproc: int, blocks: int, width: int) -> None:
    """The three fresh jobs; prints ``WALL export|export_doubled|meta FRACTION``."""
    for name, phase, n in (("export", "export", blocks), ("export_doubled", "export", 2 * blocks),
                           ("meta", "meta", blocks)):
        for attempt in (1, 2):  # a job whose ranks measured but one failed at gloo's exit: again
            job = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}", str(Path(__file__).resolve()), "--walls-worker",
                 phase, "--blocks", str(n), "--width", str(width)],
                capture_output=True, text=True)
            found = re.search(r"WALL \S+ ([\d.]+)", job.stdout)
            if job.returncode == 0 or not found or attempt == 2:
                break
            print(f"rss.py: the {name} job measured, then a rank failed at exit; run again",
                  file=sys.stderr)
        if job.returncode != 0:
            raise SystemExit(f"rss.py: the {name} job failed:\n{job.stdout[-2000:]}"
                             f"{job.stderr[-3000:]}")
        print(f"WALL {name} {found.group(1)}", flush=True)


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
    parser.add_argument("--nproc", type=int, default=None, help="ranks (2; --walls: 3)")
    parser.add_argument("--wrap", action="store_true", help="measure wrapping only (see doc)")
    parser.add_argument("--wrap-worker", choices=["eager", "meta"], help=argparse.SUPPRESS)
    parser.add_argument("--walls", action="store_true", help="the memory wall (see doc)")
    parser.add_argument("--walls-worker", choices=["export", "meta"], help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    if args.wrap_worker:
        return wrap_worker(args.wrap_worker)
    if args.walls_worker:
        return walls_worker(args.walls_worker, args.blocks, args.width)
    if args.walls:  # the allocator as users have it: no MALLOC_ settings
        return walls(args.nproc or 3, args.blocks, args.width)
    # glibc keeps freed large blocks for reuse unless the mmap threshold is fixed: then every
    # large tensor is its own mapping, returned to the OS when freed, and RSS tracks live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    if args.wrap:
        return wrap_table(env)
    args.nproc = args.nproc or 2
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
