"""Tutorial 10: beyond one rank's memory -- a model no rank could hold, built, trained, saved.

    torchrun --standalone --nproc_per_node=4 tutorials/10_beyond_one_rank.py   (or 2, 3 ranks)

Each rank gets a memory BUDGET of 14 MB for the model's state. The model grows with the
number of ranks N (4 blocks per rank), so its full fp32-Adam training state, 16 bytes per
parameter (16Ψ: 4 params + 4 grads + 8 Adam moments), is N x 9.5 MB: more than one budget
from N = 2 on. Plain DDP (stage 0) needs the whole 16Ψ on every rank; it cannot run here.
Stage 3 needs 16Ψ/N per rank plus a few units in flight. The steps, each asserted:

  1. BUILD ON META. ``with torch.device("meta"):`` builds the model without allocating a byte.
     ``minishard.ZeRO(..., stage=3)`` then materialises it one module at a time: rank 0 runs
     each layer's ``reset_parameters()``, broadcasts, every rank keeps its 1/N slice. What a
     rank ALLOCATED while wrapping is measured (``minishard.Allocations`` sees every tensor
     storage made) and is at most its shards plus three units: the module being materialised
     and up to two before it, whose broadcasts gloo's two worker threads may still hold
     (rank 0 adds its NaN check, a byte an element of a tensor). (An eager build would
     first hold 4Ψ on every rank -- more than the budget at N = 4.) And the values are those
     of an eager build with the same seed, checked here on a small copy of the model.
  2. TRAIN at stage 3 with Adam; each rank's peak of model-state bytes (shards, Adam state,
     shard gradients, plus the full parameters and gradients in flight) printed beside 16Ψ/N
     and the budget; and one step's allocations measured beside ``memory_report``'s formula,
     every transient buffer named.
  3. CHECKPOINT: one file per rank, each with that rank's shards (never a gathered model);
     reloaded into a second meta-built model, equal.
  4. EXPORT with ``full_state_dict(rank0_only=True)``: rank 0 receives the model unit by unit
     and is the only one to hold the full dict (4Ψ: the file a single-process user loads);
     the other ranks return {} and allocate one staging buffer, the largest unit's gather.
  5. STAGE 0 DOES NOT FIT: the estimator (``python -m minishard.plan``) says so (and says why
     this lesson trains stage 3 at every N: at 2 ranks stage 2 would fit too and is what the
     estimator recommends; at 3 and 4 stage 3 is the only fit), and on Linux a
     child process under a hard address-space limit of one budget (``RLIMIT_AS``) tries it for
     real: it can hold a stage-3 rank's measured peak, and dies with the allocator's
     out-of-memory error when it trains the model as a stage-0 rank would.
"""
import gc
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.observe.memory import fmt_bytes, zero_bytes
from minishard.observe.plan import estimate, fmt_decimal, report

WIDTH, BLOCKS_PER_RANK, BATCH, STEPS = 384, 4, 8, 3
BUDGET = 14e6  # bytes of model state per rank (GB = 10^9, as the estimator counts)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + 0.1 * torch.tanh(self.linear(x))


def build(blocks: int) -> nn.Module:
    return nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(WIDTH, 1))


def wrap_from_meta(blocks: int, seed: int = 0) -> minishard.ZeRO:
    with torch.device("meta"):       # shapes only: no memory, no random numbers drawn
        module = build(blocks)
    torch.manual_seed(seed)          # rank 0's generator initialises; the others receive
    return minishard.ZeRO(module, stage=3, units={Block}, device="cpu")


def per_rank(value: float, group=None) -> list[float]:
    """Every rank's ``value``, in rank order (an all-gather through minishard.comm)."""
    out = torch.empty(comm.group_size(group), dtype=torch.float64)
    comm.all_gather(out, torch.tensor([float(value)], dtype=torch.float64), group)
    return out.tolist()


def batch(rank: int, world: int):
    """One fixed global batch (so the loss must fall); this rank's rows of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * world, WIDTH, generator=g)
    y = x[:, :1].sin()
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def check_equals_eager(say) -> None:
    """The promise of deferred init, on a small model: same seed, same numbers as eager."""
    model = wrap_from_meta(blocks=3, seed=7)
    torch.manual_seed(7)
    eager = build(3)
    exported = model.full_state_dict()
    assert all(torch.equal(exported[k], v) for k, v in eager.state_dict().items())
    say("Built on meta and wrapped with seed 7 == torch.manual_seed(7); build(): equal, "
        "bit for bit.\n")


def why_stage_3(world: int, fitting: list[int]) -> str:
    """Why this lesson trains stage 3 whatever the estimator recommends, at this world size."""
    if fitting == [3]:
        return textwrap.fill(f"At {world} ranks stage 3 is the only stage that fits, so the "
                             "estimator recommends it too: the stage this lesson trained.", 100)
    lowest = min(fitting)
    return textwrap.fill(
        f"At {world} ranks stages {fitting} fit, and the estimator recommends stage {lowest}, "
        "the lowest that fits (it sends 2Ψ per step, as DDP does, where stage 3 sends 3Ψ). "
        "This lesson trains stage 3 at every world size all the same: it is the stage that "
        "fits at 2, 3 and 4 ranks alike, the only one whose whole state is divided by N "
        "(16Ψ/N), and the only one that never holds the full parameters, which is what "
        "building on meta (step 1) is for.", 100)


def oom_child(budget: int, share: int) -> None:
    """Run in a child process: under a hard limit of ``budget`` bytes of NEW address space,
    hold ``share`` bytes (a stage-3 rank's peak), then train the whole model as a stage-0
    rank would (the full 16Ψ)."""
    torch.set_num_threads(1)
    tiny = nn.Linear(2, 2)           # load everything torch loads lazily, before the limit
    opt = torch.optim.Adam(tiny.parameters())
    tiny(torch.randn(1, 2)).sum().backward()
    opt.step()
    with open("/proc/self/status") as fh:
        used = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (used + budget, resource.RLIM_INFINITY))
    held = torch.ones(share // 4)    # a stage-3 rank's peak fits under the limit...
    del held
    print("stage-3 share: fits", flush=True)
    try:                             # ... the stage-0 training state does not
        model = build(int(sys.argv[4]))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(BATCH, WIDTH)).square().mean().backward()
        opt.step()
        print("stage 0: fits", flush=True)
    except RuntimeError as exc:  # torch's CPU allocator: "can't allocate memory: you tried..."
        why = re.search(r"can't allocate memory[^.]*\.", str(exc))
        print(f"stage 0: out of memory: {why.group(0) if why else str(exc)[:120]}", flush=True)


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    blocks = BLOCKS_PER_RANK * world
    per_block = WIDTH * WIDTH + WIDTH
    psi = blocks * per_block + WIDTH + 1
    full_state = sum(zero_bytes(psi, world, 0).values())        # 16Ψ
    share = sum(zero_bytes(psi, world, 3).values())             # 16Ψ/N
    say(f"Model: {blocks} x Linear({WIDTH}) + head = {psi:,} parameters. Budget per rank: "
        f"{fmt_decimal(BUDGET)}. Full fp32-Adam state 16Ψ = {fmt_decimal(full_state)}; "
        f"16Ψ/N = {fmt_decimal(share)}.\n")
    assert full_state > BUDGET > share

    # ---- 1. build on meta, wrap: one module at a time
    check_equals_eager(say)
    with minishard.Allocations() as wrapping:
        model = wrap_from_meta(blocks)
    shards = sum(f.shard_numel * 4 for u in model.units for f in u.flats)  # padded slices
    largest = max(sum(f.full_bytes for f in u.flats) for u in model.units)
    wrap_peaks = per_rank(wrapping.peak)
    kept = 1 + comm.FINISHED_KEPT_BY_BACKEND  # the module now + what gloo's threads still hold
    nan_check = WIDTH * WIDTH                 # rank 0: one bool per element of a weight
    say(f"Wrapping: most bytes allocated at once per rank "
        f"{[fmt_decimal(p) for p in wrap_peaks]}; shards + {kept} units = {fmt_decimal(shards)} "
        f"+ {kept} x {fmt_decimal(largest)}. An eager build would hold 4Ψ = "
        f"{fmt_decimal(4 * psi)} first.")
    assert max(wrap_peaks) <= shards + kept * largest + nan_check <= BUDGET

    # ---- 2. train at stage 3
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    losses, peak = [], 0
    for step in range(STEPS):
        x, y = batch(rank, world)
        with minishard.Allocations() as allocated:  # every storage the step makes
            loss = (model(x) - y).square().mean()
            loss.backward()
        opt.step()
        m = model.memory_report(opt, measured=allocated)  # shards, their grads, Adam state
        peak = max(peak, m["params"] + m["grads"] + m["optimizer"]
                   + m["peak_gathered_params"] + m["peak_full_grads"])
        opt.zero_grad()
        losses.append(sum(per_rank(loss.item())) / world)
    peaks = per_rank(peak)
    say(f"Trained {STEPS} steps at stage 3 on a fixed batch, loss {losses[0]:.4f} -> {losses[-1]:.4f}.")
    say(f"{'rank':<6}{'peak held':>12}{'16Ψ/N':>12}{'budget':>12}")
    for r, p in enumerate(peaks):
        say(f"{r:<6}{fmt_decimal(p):>12}{fmt_decimal(share):>12}{fmt_decimal(BUDGET):>12}")
    assert max(peaks) <= BUDGET and min(peaks) >= share and losses[-1] < losses[0]
    say("(peak held = shards + shard grads + Adam state = 16Ψ/N exactly, plus the full "
        "parameters and gradients of the units in flight)")
    # The module's own activations: each layer's input and output, and their gradients.
    activations = 2 * 2 * BATCH * WIDTH * 4 * (blocks + 1)
    say(f"Allocated by the last forward + backward: {fmt_decimal(m['measured_step_peak'])} "
        f"on rank 0; the formula: {fmt_decimal(m['formula_step_peak'])} + activations "
        f"{fmt_decimal(activations)}:")
    for name, nbytes in m["transients"].items():
        say(f"  {name:<22}{fmt_decimal(nbytes):>12}")
    assert m["measured_step_peak"] <= m["formula_step_peak"] + activations
    say("")

    # ---- 3. checkpoint: one file per rank, loaded into a second meta-built model
    root = os.path.join(tempfile.gettempdir(),
                        f"minishard-10-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    path = minishard.checkpoint.state.checkpoint_path(root, STEPS)
    minishard.save_checkpoint(path, model, opt, overwrite=True)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
    say(f"Checkpoint {path}: " + ", ".join(f"{f} {fmt_decimal(s)}" for f, s in sizes.items()))
    twin = wrap_from_meta(blocks, seed=1)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=3e-4)
    minishard.load_checkpoint(path, twin, twin_opt)

    # ---- 4. export on rank 0 only
    with minishard.Allocations() as exporting:
        exported = model.full_state_dict(rank0_only=True)
    reloaded = twin.full_state_dict(rank0_only=True)
    held = sum(t.numel() * t.element_size() for t in exported.values())
    say(f"Export (rank0_only): rank 0 holds {len(exported)} tensors, {fmt_decimal(held)} "
        f"(4Ψ); the other ranks {[int(n) for n in per_rank(len(exported))[1:]]} tensors. "
        "The reloaded checkpoint's export "
        "equals it.")
    if rank == 0:
        assert held == 4 * psi and set(exported) == set(reloaded)
        assert all(torch.equal(exported[k], reloaded[k]) for k in exported)
    else:
        assert exported == {} and reloaded == {}
        assert exporting.peak <= largest  # ONE staging buffer: the largest unit's gather
    say(f"The other ranks allocated {[fmt_decimal(p) for p in per_rank(exporting.peak)[1:]]} "
        f"while exporting: one staging buffer, the largest unit's {fmt_decimal(largest)}.")
    del exported, reloaded

    # ---- 5. stage 0 does not fit: the estimator, then a real out-of-memory error
    rows = {r["stage"]: r for r in estimate(psi, world, BUDGET)}
    say("\n" + report(psi, world, BUDGET) + "\n")
    assert not rows[0]["fits"] and rows[3]["fits"]
    say(why_stage_3(world, [s for s, r in rows.items() if r["fits"]]) + "\n")
    if rank == 0 and sys.platform.startswith("linux"):
        child = subprocess.run([sys.executable, __file__, "--oom-child", str(int(BUDGET)),
                                str(int(max(peaks))), str(blocks)],
                               capture_output=True, text=True, timeout=120)
        say("A child process limited to one budget of new address space (RLIMIT_AS):")
        say("  " + child.stdout.strip().replace("\n", "\n  "))
        assert "stage-3 share: fits" in child.stdout, child.stdout + child.stderr
        assert "stage 0: out of memory" in child.stdout, child.stdout + child.stderr
        say("The allocator refused: 16Ψ does not fit in one budget, 16Ψ/N does.")
    say(f"\nA {fmt_decimal(full_state)} training state trained on {world} ranks of "
        f"{fmt_decimal(BUDGET)}. All assertions held.")

    dist.barrier()  # every rank is done with the checkpoint
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--oom-child"]:
        oom_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
        with minishard.launch.session(range(2, 5), why="one rank holds this model: there is "
                                      "no wall to cross") as (rank, world):
            main(rank, world)
