"""The memory wall, held: what a rank really ALLOCATES, bounded by the formulas plus the named
transient buffers (minishard.Allocations sees every storage made by a torch operator).

What each bound trusts (never the engine's own meters):
  * the sizes come from the model's shapes and the layout rule (ceil(rows / N) rows a rank),
    computed here;
  * a training step: ``model.step_transients()`` names each buffer; its sum plus the module's
    own activations (measured on the UNWRAPPED module in plain torch: its forward's peak, twice
    for backward's gradients of them) bounds the step's peak;
  * a rank-0 export and a load from rank 0: two units' full tensors on the other ranks;
  * a meta-device wrap: this rank's shards plus three units (the module materialised and up
    to two before it, still held by gloo's two worker threads);
  * checkpoint saves and loads: one copy of this rank's rows (parameters and optimizer state,
    counted from the torch objects) plus one unit.
And, outside the process's own accounting, the resident set of a fresh torchrun job
(test_resident_memory_is_flat): what the operating system says, glibc's caching included.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

import minishard
from minishard import Allocations, MixedPrecision, ZeRO

WORLD_SIZES = (1, 2, 3, 4)
ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


class Net(nn.Module):
    """A root unit of its own (``inp``) and blocks."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.inp(x))


def unit_bytes(modules, world: int | None) -> int:
    """A unit's full fp32 buffer by the layout rule: each parameter padded to N chunks of rows
    (``world`` None: unpadded)."""
    n = world or 1
    return 4 * sum(math.ceil((p.shape[0] if p.dim() else 1) / n) * n * math.prod(p.shape[1:])
                   for m in modules for p in m.parameters(recurse=False))


def largest_unit(net: Net, world: int | None) -> int:
    """The root unit is ``inp`` (Net has no parameters of its own); each Block is one."""
    return max([unit_bytes(b.modules(), world) for b in net.blocks]
               + [unit_bytes([net, net.inp], world)])


def rank_state_bytes(model, optimizer) -> int:
    """This rank's rows of every parameter and of its optimizer state (``step`` included)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                for v in s.values() if torch.is_tensor(v))
    return params + state


def metadata_bytes(model, optimizer) -> int:
    """A checkpoint's own small tensors (names, row ranges, sizes; DCP's pickled plans, which
    every rank gathers from every rank): 8 KiB plus 2 KiB a saved tensor, per rank."""
    tensors = len(list(model.parameters())) + sum(
        sum(torch.is_tensor(v) for v in st.values()) for st in optimizer.state.values())
    return (8192 + 2048 * tensors) * dist.get_world_size()


def _mp(name):
    return {"none": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16),
            "bf16+fp32 reduce": MixedPrecision(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)}[name]


# -------------------------------------------------------------------- what it counts
def _dtensor_counted(rows: int) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    d = distribute_tensor(torch.randn(rows, 8), init_device_mesh("cpu", (dist.get_world_size(),)),
                          [Shard(0)])
    with Allocations() as alloc:
        state = torch.zeros_like(d)  # Adam's first step on a stage 1-3 parameter
    return alloc.peak, state.to_local().untyped_storage().nbytes()


@pytest.mark.parametrize("ws", [2, 3])
def test_a_dtensor_counts_the_rows_this_rank_holds(pools, ws):
    """A DTensor's own storage claims its global size; the memory is the local tensor's (this
    rank's rows: 11 rows over 3 ranks are 4, 4 and 3)."""
    for rank, (counted, local) in enumerate(pools(ws).run(_dtensor_counted, 11)):
        assert counted == local == 4 * 8 * (-(-11 // ws) if rank < ws - 1 else
                                            11 - (ws - 1) * -(-11 // ws)), (rank, counted, local)


# ------------------------------------------------------------------------- a training step
def _step_peak(width, depth, rows, stage, prefetch, bucket, mp, persist=0, find_unused=False):
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = Net(width, depth)
    x = torch.randn(rows[rank], width)
    with Allocations() as activations:  # the module's own, in plain torch (fp32: no smaller)
        plain(x).sum()
    model = ZeRO(Net(width, depth), stage=stage, units={Block}, prefetch=prefetch,
                 bucket_bytes=bucket, mixed_precision=_mp(mp), persist_below=persist,
                 find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    peaks = []
    for _ in range(3):
        with Allocations() as alloc:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        peaks.append(alloc.peak)
    report = model.memory_report(opt, measured=alloc)
    return max(peaks[1:]), report["formula_step_peak"], 2 * activations.peak, report, \
        alloc.describe_peak()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@given(width=st.integers(8, 40), depth=st.integers(1, 4), data=st.data(),
       stage=st.sampled_from([0, 1, 2, 3]), prefetch=st.booleans(),
       bucket=st.sampled_from([0, 20_000]), mp=st.sampled_from(["none", "bf16",
                                                               "bf16+fp32 reduce"]),
       persist=st.sampled_from([0, 64]),  # 64: the biases (width <= 40) replicated
       find_unused=st.booleans())
def test_a_training_step_allocates_no_more_than_the_formula(pools, ws, width, depth, data,
                                                            stage, prefetch, bucket, mp, persist,
                                                            find_unused):
    rows = data.draw(st.lists(st.integers(0, 3), min_size=ws, max_size=ws))
    if sum(rows) == 0:
        rows[0] = 1
    find_unused = find_unused and stage < 3  # (refused at stage 3)
    for rank, (peak, formula, activations, report, where) in enumerate(
            pools(ws).run(_step_peak, width, depth, rows, stage, prefetch, bucket, mp, persist,
                          find_unused)):
        assert peak <= formula + activations, (
            f"rank {rank}: a step allocated {peak} B, the formula says {formula} B "
            f"({report['transients']}) + activations {activations} B\n{where}")


def _formulas():
    return [ZeRO(Net(16, 2), stage=s, units={Block}).step_transients() for s in range(4)]


def _full_gradient_terms(find_unused):
    models = [ZeRO(Net(16, 2), stage=s, units={Block}, bucket_bytes=bucket,
                   find_unused_parameters=find_unused and s < 3)
              for s in range(4) for bucket in (0, 4096)]
    return [m.step_transients().get("full gradients", 0) for m in models]


@pytest.mark.parametrize("find_unused", [False, True])
def test_the_step_formula_counts_the_full_gradients_each_stage_keeps(pools, find_unused):
    """The formula's "full gradients" term, from the other side than the measurement (which
    only bounds it from above): every full gradient (Ψ, padded at stages 1-3) at stages 0-1
    and under find_unused_parameters at stage 2, which waits for the end of backward; at
    stages 2-3 otherwise only what a bucket gathers before it is reduced."""
    net, world = Net(16, 2), 2
    units = [[net, net.inp]] + [list(b.modules()) for b in net.blocks]
    stamps = 4 * minishard.comm.SUM_STAMP_NUMEL * len(units)  # each of stage 0's ends so
    psi = {0: sum(unit_bytes(u, None) for u in units) + stamps,
           1: sum(unit_bytes(u, world) for u in units)}
    expected = [psi[min(stage, 1)] if stage < 2 or (find_unused and stage == 2) else bucket
                for stage in range(4) for bucket in (0, 4096)]
    for got in pools(world).run(_full_gradient_terms, find_unused):
        assert got == expected, (got, expected)


def test_the_step_formula_names_its_buffers(pools):
    at = pools(2).run(_formulas)[0]
    assert "gathered parameters" in at[3] and "gathered parameters" not in at[2]
    assert "full gradients" in at[1] and "reductions in flight" in at[0]
    assert all(v >= 0 for parts in at for v in parts.values())


# --------------------------------------------------------------------------- state dicts
def _export_peak(width, depth, stage):
    torch.manual_seed(0)
    model = ZeRO(Net(width, depth), stage=stage, units={Block})
    with Allocations() as alloc:
        sd = model.full_state_dict(rank0_only=True)
    model_bytes = sum(p.numel() for p in Net(width, depth).parameters()) * 4
    return alloc.peak, model_bytes, len(sd), alloc.describe_peak()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@given(width=st.integers(4, 48), depth=st.integers(1, 5), stage=st.sampled_from([0, 1, 2, 3]))
def test_rank0_only_export_holds_two_units_on_the_other_ranks(pools, ws, width, depth, stage):
    """[full_state.full_state_dict] the other ranks hold at most two units' full tensors: the
    staging rows of one gather, and of the one before while gloo's thread lets go of them."""
    unit = largest_unit(Net(width, depth), ws)
    for rank, (peak, model_bytes, keys, where) in enumerate(
            pools(ws).run(_export_peak, width, depth, stage)):
        if rank == 0:
            assert keys > 0 and peak <= model_bytes + 2 * unit, where
        else:
            assert keys == 0 and peak <= 2 * unit, (
                f"rank {rank}: exporting allocated {peak} B, two units are {2 * unit} B\n{where}")


def _load_from_rank0_peak(width, depth, stage):
    torch.manual_seed(0)
    plain = Net(width, depth)
    model = ZeRO(Net(width, depth), stage=stage, units={Block})
    sd = plain.state_dict() if dist.get_rank() == 0 else None
    with Allocations() as alloc:
        model.load_full_state_dict(sd, from_rank0=True)
    got = model.full_state_dict()
    same = all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
    return alloc.peak, same, alloc.describe_peak()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@given(width=st.integers(4, 48), depth=st.integers(1, 5), stage=st.sampled_from([0, 1, 2, 3]))
def test_load_from_rank0_holds_one_staging_buffer_and_the_regathers(pools, ws, width, depth,
                                                                     stage):
    """One staging buffer for every unit's broadcast; stages 1-2 then re-gather unit by unit,
    each gather's rows alive while gloo's two threads may still hold earlier ones."""
    unit = largest_unit(Net(width, depth), ws)
    bound = (1 + minishard.comm.FINISHED_KEPT_BY_BACKEND) * unit
    for rank, (peak, same, where) in enumerate(
            pools(ws).run(_load_from_rank0_peak, width, depth, stage)):
        assert same, f"rank {rank}: the loaded model is not rank 0's state dict"
        assert peak <= bound, f"rank {rank}: {peak} B > {bound} B\n{where}"


# ------------------------------------------------------------------------------ meta wrap
def _meta_wrap_peak(width, depth, stage):
    with Allocations() as alloc:
        with torch.device("meta"):
            module = Net(width, depth)
        model = ZeRO(module, stage=stage, units={Block}, device="cpu")
    kept = sum(f.held_bytes() for u in model.units for f in u.flats)  # checked below
    mine = sum(p.numel() * p.element_size() for p in model.parameters())
    return alloc.peak, kept, mine, alloc.describe_peak()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@given(width=st.integers(4, 48), depth=st.integers(1, 5), stage=st.sampled_from([0, 1, 2, 3]))
def test_meta_wrap_holds_what_the_stage_keeps_plus_three_units(pools, ws, width, depth, stage):
    net = Net(width, depth)
    unit = largest_unit(net, ws)
    shards = sum(math.ceil((p.shape[0] if p.dim() else 1) / ws) * math.prod(p.shape[1:]) * 4
                 for p in net.parameters())
    full = sum(unit_bytes(b.modules(), ws) for b in net.blocks) + unit_bytes([net.inp], ws)
    stamps = 4 * minishard.comm.SUM_STAMP_NUMEL * (1 + depth)  # stage 0's: a buffer's end
    keeps = shards if stage == 3 else full + (stamps if stage == 0 else 0)  # 0-2: full buffers
    nan_check = width * width  # rank 0 checks each initialised tensor for NaN: a bool each
    units = 1 + minishard.comm.FINISHED_KEPT_BY_BACKEND  # materialising + what gloo holds
    for rank, (peak, kept, mine, where) in enumerate(
            pools(ws).run(_meta_wrap_peak, width, depth, stage)):
        assert kept <= keeps
        assert peak <= keeps + units * unit + nan_check, (
            f"rank {rank}: a meta wrap allocated {peak} B; keeps {keeps} B + {units} units "
            f"{units * unit} B\n{where}")


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint_peaks(path, width, depth, stage, fmt):
    torch.manual_seed(0)
    model = ZeRO(Net(width, depth), stage=stage, units={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    state = rank_state_bytes(model, opt) + metadata_bytes(model, opt)
    kwargs = {"format": "dcp"} if fmt == "dcp" else {}
    with Allocations() as saving:
        minishard.save_checkpoint(path, model, opt, **kwargs)
    before = model.full_state_dict()
    with Allocations() as loading:
        minishard.load_checkpoint(path, model, opt)
    after = model.full_state_dict()
    same = all(torch.equal(before[k], after[k]) for k in before)
    return saving.peak, loading.peak, state, same, saving.describe_peak(), loading.describe_peak()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("fmt", ["minishard", "dcp"])
@given(width=st.integers(16, 64), depth=st.integers(1, 4), stage=st.sampled_from([0, 1, 2, 3]))
def test_checkpoints_hold_one_copy_of_the_ranks_rows(pools, tmp_path_factory, ws, fmt, width,
                                                     depth, stage):
    path = str(tmp_path_factory.mktemp("ckpt") / "step")
    unit = largest_unit(Net(width, depth), ws)
    # Stage 0 holds every row, saved across every rank's file: minishard's format reads them
    # all and joins them (a second copy); otherwise a rank's rows come from one file, and DCP
    # reads each piece straight into place.
    copies = 2 if fmt == "minishard" and stage == 0 and ws > 1 else 1
    for rank, (save, load, state, same, where_save, where_load) in enumerate(
            pools(ws).run(_checkpoint_peaks, path, width, depth, stage, fmt)):
        assert same
        bound = state + unit
        assert save <= bound, f"rank {rank}: saving {save} B > {bound}\n{where_save}"
        # + stages 1-2 re-gather each unit after a load: its staging, and the finished
        # gathers gloo's threads still hold (comm.FINISHED_KEPT_BY_BACKEND)
        bound = copies * state + (1 + minishard.comm.FINISHED_KEPT_BY_BACKEND) * unit
        assert load <= bound, f"rank {rank}: loading {load} B > {bound}\n{where_load}"


# -------------------------------------------------------------------- the tracker itself
def test_the_tracker_sees_allocations_resizes_and_frees():
    older = torch.zeros(1000)
    with Allocations() as alloc:
        a = torch.zeros(1000)                       # +4000
        view = a.view(10, 100)                      # a view: nothing
        b = a + 1                                   # +4000: peak 8000
        del b                                       # -4000
        a.untyped_storage().resize_(0)              # -4000
        a.untyped_storage().resize_(8000)           # +8000: peak 8000 again
        older.untyped_storage().resize_(0)          # an older storage freed: -4000
    assert (alloc.peak, alloc.now) == (8000, 4000), (alloc.peak, alloc.now)
    assert view.untyped_storage().nbytes() == 8000
    assert "zeros" in alloc.describe_peak() and "test_memory_wall.py" in alloc.describe_peak()


# ------------------------------------------------------- resident memory (the outside check)
def test_resident_memory_is_flat():
    """bench/rss.py --walls: three fresh 3-rank jobs at stage 3 (16 and 32 units of one
    Linear(512), 1 MiB each; a meta build of 16), with the allocator as users have it. The
    resident set of the ranks other than 0 grows by at most 3 units while exporting, at either
    size (one staging buffer, and what the allocator rounds), and every rank's by at most its
    shard plus 3 units while wrapping the meta model (the module materialised, the one before
    that gloo's thread still holds, and the allocator's rounding)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    blocks, ranks = 16, 3
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rss.py"), "--walls", "--nproc",
                          str(ranks), "--blocks", str(blocks)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {m[0]: float(m[1]) for m in re.findall(r"^WALL (\S+) ([\d.]+)$", out.stdout, re.M)}
    assert set(found) == {"export", "export_doubled", "meta"}, out.stdout
    in_units = {"export": found["export"] * blocks,
                "export_doubled": found["export_doubled"] * 2 * blocks,
                "meta": found["meta"] * blocks}
    assert in_units["export"] <= 3 and in_units["export_doubled"] <= 3, in_units
    assert in_units["meta"] <= blocks / ranks + 3, in_units


# ----------------------------------------------------- reductions in flight, seen from comm
class _InFlight:
    """A comm observer (the hook trace.py uses): reduce-scatters issued and not yet waited."""

    def __init__(self) -> None:
        self.open: dict[int, bool] = {}  # id(first work) of each unfinished reduce-scatter
        self.most, self._last_op = 0, None

    def issued(self, entry) -> None:
        self._last_op = entry.op

    def started(self, works) -> None:
        if self._last_op == "reduce_scatter" and works:
            self.open[id(works[0])] = True
            self.most = max(self.most, len(self.open))

    def waited(self, works, start, end) -> None:
        for work in works:
            self.open.pop(id(work), None)


def _most_reductions_in_flight(stage):
    model = ZeRO(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]), stage=stage,
                 units={nn.Linear})
    watch = _InFlight()
    minishard.comm.set_observer(watch)
    try:
        model(torch.randn(2, 8)).sum().backward()
    finally:
        minishard.comm.set_observer(None)
    return watch.most


@pytest.mark.parametrize("stage", [2, 3])
def test_at_most_two_reductions_hold_their_buffers(pools, stage):
    """Stages 2-3 wait for the oldest reduction BEFORE launching another: never more than
    MAX_REDUCTIONS_IN_FLIGHT send and receive buffers alive at once (six units reduce here)."""
    from minishard.zero.schedule import MAX_REDUCTIONS_IN_FLIGHT
    for most in pools(2).run(_most_reductions_in_flight, stage):
        assert most == MAX_REDUCTIONS_IN_FLIGHT, most


def test_the_tracker_watches_its_own_thread_and_restores_resize_in_any_order():
    """(Found by review.) Two threads' trackers that close out of order: each counts only its
    own thread's resizes, and ``untyped_storage().resize_`` is torch's own again afterwards."""
    import threading
    original = torch.UntypedStorage.resize_
    a_in, b_in, a_out, got = threading.Event(), threading.Event(), threading.Event(), {}

    def a():
        with Allocations() as alloc:
            got["a"] = alloc
            a_in.set()
            b_in.wait()
        a_out.set()

    def b():
        a_in.wait()
        with Allocations() as alloc:
            s = torch.empty(1000).untyped_storage()
            s.resize_(2000)
            del s
            got["b"] = alloc
            b_in.set()
            a_out.wait()
    threads = [threading.Thread(target=f) for f in (a, b)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got["a"].now == 0 and got["a"].peak == 0
    assert got["b"].peak == 4000  # 1000 float32, then resized to 2000 bytes
    assert torch.UntypedStorage.resize_ is original


def test_the_tracker_sees_tensors_made_from_python_data():
    with Allocations() as alloc:
        t = torch.tensor([1.0] * 1024)
    assert alloc.peak == 4096 and t.numel() == 1024
