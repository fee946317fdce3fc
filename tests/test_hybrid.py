"""Hybrid sharding: ``ZeRO(..., mesh=2-D DeviceMesh)`` at 4 ranks as 2x2, 1x4 and 4x1.

What each test trusts:
  * the single-process oracle of test_zero.py / test_training.py: the plain model trained in ONE
    process on the global batch. Their rank functions run here unchanged, with ``ZeRO`` swapped
    for ``ZeRO(..., mesh=mesh)`` (``on_mesh``): parity, no_sync accumulation, clip_grad_norm_
    (the norm of the UNSHARDED model: summing the shard norms over the replicas too would count
    every element R times), mixed precision (vs FSDP1/FSDP2 and fp32), prefetch, gathered().
  * FSDP2 ``fully_shard(mesh=<the same 2-D mesh>)`` (HSDP), compared through ``full_tensor()``.
  * the ledger: per group, the formulas below, computed HERE from the unwrapped model's numels
    (test_zero.expected_buffers) and the padding rule, never read from the engine. R nodes
    (replicas) of S ranks, Ψ = trainable elements padded to S (Ψ_all: frozen ones too), fp32:

        stage 3, inside a node:  (S-1)/S·4·(2Ψ_all + Ψ)     across nodes: 2(R-1)/R·4·Ψ/S
        stages 1-2, inside:      2(S-1)/S·4·Ψ               across:       2(R-1)/R·4·Ψ/S
        stage 0: one all-reduce over all N = R·S ranks, 2(N-1)/N · 4 · ψ (unpadded)

    against full sharding over the N ranks, where every collective's group spans both nodes.
  * checkpoints: saved on 2x2 (only the first replica writes: S files), loaded on 1x4, 4x1 and on
    2 plain ranks, 2 more steps: equal to the single-process oracle's 4 steps.
  * a real two-agent torchrun launch (static --node-rank and c10d rendezvous) of tutorial 11,
    which asserts the formulas itself from the ranks torchrun put on each node.
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import unittest.mock
import uuid
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

import minishard
import test_training
import test_zero
import test_zero_oracles
from minishard import ZeRO
from minishard.checkpoint.state import load_checkpoint, save_checkpoint
from test_zero import (batch, build, expected_buffers, loss_fn, make_opt, mismatches, numel, padded,
                       rows_of, specs, unit_arg)

SHAPES = [(2, 2), (1, 4), (4, 1)]  # (replicas R, shard group size S): 4 ranks
ROOT = Path(__file__).resolve().parents[1]
_MESHES: dict = {}


def mesh_of(shape):
    """One mesh per shape per rank process: every init_device_mesh makes new process groups."""
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return _MESHES[shape]


def on_mesh(shape, fn, *args, **kwargs):
    """Run another test file's rank function with every ``ZeRO(...)`` it builds on the mesh."""
    mesh = mesh_of(shape)

    class OnMesh(ZeRO):
        def __init__(self, *a, **k):
            super().__init__(*a, mesh=mesh, **k)

    with unittest.mock.patch.object(minishard, "ZeRO", OnMesh), \
            unittest.mock.patch.dict(fn.__globals__, {"ZeRO": OnMesh}):
        return fn(*args, **kwargs)


# ============================================== 1. parity with single-process training
@given(spec=specs(), stage=st.sampled_from(test_zero.STAGES), shape=st.sampled_from(SHAPES),
       units=st.sampled_from([None, "blocks", "nested"]),
       opt_name=st.sampled_from(["sgd", "adam", "adamw"]), per_rank=st.integers(2, 3),
       prefetch=st.booleans())
def test_hybrid_matches_single_process_training(pools, spec, stage, shape, units, opt_name,
                                                per_rank, prefetch):
    results = pools(4).run(on_mesh, shape, test_zero.train_vs_oracle, spec, stage, units,
                           opt_name, per_rank, prefetch=prefetch)
    assert results == [[]] * 4, results


@settings(max_examples=10)
@given(spec=specs(), stage=st.sampled_from(test_zero.STAGES), shape=st.sampled_from(SHAPES),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_hybrid_gathered_matches_state_dict_and_writes_persist(pools, spec, stage, shape, units):
    results = pools(4).run(on_mesh, shape, test_zero.gathered_and_state_dict, spec, stage, units,
                           2)
    assert results == [[]] * 4, results


training_cfgs = st.fixed_dictionaries(dict(
    width=st.integers(3, 9), hidden=st.integers(3, 9), blocks=st.integers(2, 3),
    batch=st.integers(2, 3), tie=st.sampled_from(["none", "stem_head", "across"]),
    frozen=st.sampled_from(["none", "stem", "block"]),
    units=st.sampled_from(sorted(test_training.UNITS)), seed=st.integers(0, 2**16)))


@settings(max_examples=test_training._examples(0.4))
@given(cfg=training_cfgs, stage=st.integers(0, 3), shape=st.sampled_from(SHAPES),
       norm_type=st.sampled_from([2.0, 1.0, float("inf")]), frac=st.floats(0.05, 0.9))
def test_hybrid_clip_grad_norm_is_the_unsharded_models(pools, cfg, stage, shape, norm_type,
                                                        frac):
    """One all-reduce of one number, in the shard group only; the norm and the clipped training
    equal torch.nn.utils.clip_grad_norm_ on the plain model and the global batch."""
    norms = pools(4).run(on_mesh, shape, test_training.clip_matches_torch, cfg, stage, norm_type,
                         frac)
    assert all(n == norms[0] for n in norms)


@settings(max_examples=test_training._examples(0.4))
@given(cfg=training_cfgs, stage=st.integers(0, 3), shape=st.sampled_from([(2, 2), (1, 4)]),
       micro=st.integers(2, 3), use_no_sync=st.booleans(), set_to_none=st.booleans(),
       prefetch=st.booleans())
def test_hybrid_gradient_accumulation_equals_one_big_batch(pools, cfg, stage, shape, micro,
                                                           use_no_sync, set_to_none, prefetch):
    """no_sync: no reduction at all (neither in the shard group nor across replicas). (4x1 is
    left out: with shard groups of one rank the shard gradient IS the full one, so the memory
    claim of the rank function, full grads inside no_sync > shard grads outside, does not apply.)"""
    pools(4).run(on_mesh, shape, test_training.accumulation_matches_big_batch, cfg, stage, micro,
                 use_no_sync, set_to_none, prefetch)


@settings(max_examples=test_training._examples(0.16))
@given(cfg=training_cfgs.filter(lambda c: c["tie"] != "across" and c["frozen"] != "stem"),
       stage=st.integers(0, 3), shape=st.sampled_from(SHAPES))
def test_hybrid_bf16_matches_fsdp_and_tracks_fp32(pools, cfg, stage, shape):
    """bf16 params and reductions on the mesh vs FSDP1/FSDP2 in bf16 over the 4 ranks (the
    tolerances of test_training: bf16 sums in another order) and vs the fp32 oracle."""
    cfg = {**cfg, "units": "block"}
    pools(4).run(on_mesh, shape, test_training.mixed_precision_matches_fsdp, cfg, stage)


# ===================================================== 2. FSDP2 with the same 2-D mesh
def _fsdp2_hybrid(shape, reshard, net, opt_name, units):
    from torch.distributed.fsdp import fully_shard
    mesh = mesh_of(shape)
    is_unit = test_zero_oracles._is_unit(units)
    for m in reversed(list(net.modules())):  # innermost first, as FSDP2 requires
        if m is not net and is_unit(m):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
    opt = make_opt(opt_name, net.parameters())

    def full():  # parameters (DTensors, gathered) AND buffers, as test_zero_oracles' FSDP2
        out = {k: p.full_tensor().detach().clone() for k, p in net.named_parameters()}
        out.update({k: b.detach().clone() for k, b in net.named_buffers()})
        return out
    return net, opt, full


def vs_fsdp2_hybrid(shape, spec, stage, units, opt_name, per_rank):
    stock = {"fsdp2_hybrid": functools.partial(_fsdp2_hybrid, shape, stage == 3)}
    with unittest.mock.patch.dict(test_zero_oracles.STOCK, stock):
        return on_mesh(shape, test_zero_oracles.vs_stock, spec, stage, units, "fsdp2_hybrid",
                       opt_name, per_rank)


@settings(max_examples=10)
@given(spec=test_zero_oracles.fsdp_specs, stage=st.sampled_from([2, 3]),
       shape=st.sampled_from(SHAPES), units=st.sampled_from([None, "blocks", "nested"]),
       opt_name=st.sampled_from(["sgd", "adam", "adamw"]), per_rank=st.integers(2, 3))
@example(spec=dict(kind="mlp", widths=[5, 7, 3], bias=True, seed=3, in_dim=4, out=3, vocab=5,
                   channels=1, size=3, tie=None, frozen=None, reuse=None),
         stage=3, shape=(2, 2), units="blocks", opt_name="adam", per_rank=2)
def test_hybrid_matches_fsdp2_on_the_same_mesh(pools, spec, stage, shape, units, opt_name,
                                               per_rank):
    """Stage 3 <-> fully_shard(mesh=2-D) (HSDP), stage 2 <-> the same with
    reshard_after_forward=False; atol 1e-6, rtol 1e-5 (only the order of additions differs)."""
    results = pools(4).run(vs_fsdp2_hybrid, shape, spec, stage, units, opt_name, per_rank)
    assert results == [[]] * 4, results


# =============================================================== 3. the ledger, per group
def ledger_one_step_on(shape, spec, stage, units, per_rank):
    """test_zero.ledger_one_step's steady-state step, on the mesh (shape) or, with shape None,
    over all ranks as one group. Returns every entry's (op, numel, ranks, dim, bytes), and the
    Ledger's own per-group totals for the two groups this rank is in."""
    n, rank = dist.get_world_size(), dist.get_rank()
    led = test_zero.steady_state_ledger(spec, stage, units, per_rank,
                                        mesh=mesh_of(shape) if shape else None)
    entries = [(e.op, e.numel, e.ranks, e.dim, e.bytes_sent) for e in led.entries]
    s = shape[1] if shape else n
    row = range(rank // s * s, rank // s * s + s)        # this rank's node
    column = range(rank % s, n, s)                       # the same position on every node
    totals = {"row": led.total_bytes(group=row), "column": led.total_bytes(group=column),
              "shard": led.total_bytes(dim="shard"), "replicate": led.total_bytes(dim="replicate"),
              "all": led.total_bytes(), "by_group": led.by_group()}
    return entries, totals


def crosses_nodes(ranks, s):
    return len({r // s for r in ranks}) > 1


@settings(max_examples=20)
@given(spec=specs(), stage=st.sampled_from(test_zero.STAGES), shape=st.sampled_from(SHAPES),
       units=st.sampled_from([None, "blocks", "nested"]))
@example(spec=dict(kind="mlp", widths=[5, 7, 3], bias=True, seed=3, in_dim=4, out=3, vocab=5,
                   channels=1, size=3, tie=None, frozen=None, reuse=None),
         stage=3, shape=(2, 2), units=None)
def test_ledger_inside_and_across_nodes_is_the_hybrid_formula(pools, spec, stage, shape, units):
    r_, s_ = shape
    n = r_ * s_
    bufs = expected_buffers(spec, units)
    trainable = [k for _, rg, k in bufs if rg]
    psi = sum(padded(t, s_) for t in trainable)              # padded to the shard group
    psi_all = sum(padded(k, s_) for _, _, k in bufs)
    if stage == 0:
        everything = Fraction(2 * (n - 1) * 4 * sum(map(numel, trainable)), n)
        inside, across = (everything, 0) if r_ == 1 else (0, everything)
    else:
        gathers = 2 * psi_all if stage == 3 else psi_all  # stages 1-2: frozen ones too
        inside = Fraction((s_ - 1) * 4 * (gathers + psi), s_)
        across = Fraction(2 * (r_ - 1) * 4 * (psi // s_), r_)
    psi_n = sum(padded(t, n) for t in trainable)
    psi_all_n = sum(padded(k, n) for _, _, k in bufs)
    full = (Fraction(2 * (n - 1) * 4 * sum(map(numel, trainable)), n) if stage == 0 else
            Fraction((n - 1) * 4 * ((2 * psi_all_n if stage == 3 else psi_all_n) + psi_n), n))

    hybrid = pools(4).run(ledger_one_step_on, shape, spec, stage, units, 2)
    flat = pools(4).run(ledger_one_step_on, None, spec, stage, units, 2)
    for rank, ((entries, totals), (flat_entries, _)) in enumerate(zip(hybrid, flat)):
        got_in = sum((b for *_, ranks, _, b in entries if not crosses_nodes(ranks, s_)),
                     Fraction(0))
        got_across = sum((b for *_, ranks, _, b in entries if crosses_nodes(ranks, s_)),
                         Fraction(0))
        assert (got_in, got_across) == (inside, across), (rank, entries)
        # the Ledger's own per-group totals say the same
        node = tuple(range(rank // s_ * s_, rank // s_ * s_ + s_))
        column = tuple(range(rank % s_, n, s_))
        assert totals["all"] == inside + across
        assert sum(totals["by_group"].values()) == totals["all"]
        if stage > 0 and 1 < s_ < n:
            assert totals["row"] == totals["shard"] == inside, (rank, totals)
        if stage > 0 and 1 < r_ < n:
            assert totals["column"] == totals["replicate"] == across, (rank, totals)
        for op, _, ranks, dim, _ in entries:  # every collective ran on one of the mesh's groups
            if stage == 0:
                assert ranks == tuple(range(n)), entries
            elif op == "all_reduce":
                assert ranks == column and dim == ("replicate" if r_ < n else ""), entries
            else:
                assert ranks == node and dim == ("shard" if s_ < n else ""), entries
        # full sharding over all N ranks: every byte crosses nodes, 3Ψ(N-1)/N at stage 3
        assert all(ranks == tuple(range(n)) for *_, ranks, _, _ in flat_entries)
        assert sum((b for *_, b in flat_entries), Fraction(0)) == full
    if units is None and all(rg for _, rg, _ in bufs) and stage == 3 and r_ > 1 and s_ > 1:
        big_psi = padded([p.shape for p in build(spec).parameters()], s_)
        # the headline: 3Ψ(S-1)/S inside a node + 2(Ψ/S)(R-1)/R across nodes, vs 3Ψ(N-1)/N
        assert inside == Fraction(3 * (s_ - 1) * 4 * big_psi, s_)
        assert across == Fraction(2 * (r_ - 1) * 4 * big_psi, s_ * r_)
        assert across < full


# ============================================================= 4. checkpoints across shapes
CKPT_SPEC = dict(kind="mlp", widths=[5, 7, 7], bias=True, seed=11, in_dim=4, out=3, vocab=5,
                 channels=1, size=3, tie="blocks", tie_pair=(0, 1), frozen=("lin", 0),
                 reuse=None)
GLOBAL_ROWS = 8


def _train(model, opt, spec, steps):
    per_rank = GLOBAL_ROWS // dist.get_world_size()
    for step in steps:
        xg, yg = batch(spec, step, GLOBAL_ROWS)
        loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
        opt.step()
        opt.zero_grad()


def oracle_four_steps(spec, stage, opt_name):
    ref = build(spec)
    opt = make_opt(opt_name, ref.parameters())
    for step in range(4):
        xg, yg = batch(spec, step, GLOBAL_ROWS)
        loss_fn(ref(xg), yg).backward()
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


def save_on(shape, spec, stage, units, opt_name, ckpt, format="minishard"):
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units), mesh=mesh_of(shape))
    opt = make_opt(opt_name, model.parameters())
    _train(model, opt, spec, range(2))
    save_checkpoint(ckpt, model, opt, format=format)
    return sorted(os.listdir(ckpt))


def load_on(shape, spec, stage, units, opt_name, ckpt):
    """Load into a model built from ANOTHER seed (the load must replace every value), 2 steps."""
    mesh = mesh_of(shape) if shape else None
    model = ZeRO(build(spec, seed=spec["seed"] + 1), stage=stage, units=unit_arg(units),
                 mesh=mesh)
    opt = make_opt(opt_name, model.parameters())
    load_checkpoint(ckpt, model, opt)
    _train(model, opt, spec, range(2, 4))
    return mismatches(model.full_state_dict(), oracle_four_steps(spec, stage, opt_name),
                      f"loaded on {shape or dist.get_world_size()} stage {stage}")


@settings(max_examples=6)
@given(stage=st.integers(0, 3), stage_b=st.integers(0, 3),
       units=st.sampled_from([None, "blocks"]), opt_name=st.sampled_from(["sgd", "adam"]))
@example(stage=3, stage_b=3, units="blocks", opt_name="adam")
def test_checkpoint_saved_on_2x2_resumes_on_1x4_4x1_and_2_ranks(pools, tmp_path, stage, stage_b,
                                                                units, opt_name):
    ckpt = str(tmp_path / f"ckpt-{uuid.uuid4().hex[:8]}")
    files = pools(4).run(save_on, (2, 2), CKPT_SPEC, stage, units, opt_name, ckpt)
    # stages 1-3: the replicas hold identical shards, only the first one writes (S = 2 files);
    # stage 0 is plain DDP over all 4 ranks
    n_files = 4 if stage == 0 else 2
    assert files[0] == sorted(["meta.pt"] + [f"rank{r}-of-{n_files}.pt" for r in range(n_files)])
    for shape in [(1, 4), (4, 1)]:
        results = pools(4).run(load_on, shape, CKPT_SPEC, stage_b, units, opt_name, ckpt)
        assert results == [[]] * 4, results
    results = pools(2).run(load_on, None, CKPT_SPEC, stage_b, units, opt_name, ckpt)
    assert results == [[]] * 2, results


@pytest.mark.parametrize("stage, stage_b", [(3, 3), (1, 0), (0, 2)])
def test_dcp_checkpoint_saved_on_2x2_resumes_on_4x1_and_2_ranks(pools, tmp_path, stage, stage_b):
    """The same in torch.distributed.checkpoint's format (checkpoint/dcp.py): stages 1-3, the
    first replica writes its shard group's rows; stage 0, every rank its rows of the 4."""
    ckpt = str(tmp_path / f"ckpt-{uuid.uuid4().hex[:8]}")
    files = pools(4).run(save_on, (2, 2), CKPT_SPEC, stage, "blocks", "adam", ckpt, "dcp")[0]
    n_files = 4 if stage == 0 else 2
    assert files == sorted([".metadata", "minishard-sha256.pt"]
                           + [f"__{r}_0.distcp" for r in range(n_files)])
    results = pools(4).run(load_on, (4, 1), CKPT_SPEC, stage_b, "blocks", "adam", ckpt)
    assert results == [[]] * 4, results
    results = pools(2).run(load_on, None, CKPT_SPEC, stage_b, "blocks", "adam", ckpt)
    assert results == [[]] * 2, results


def save_unstepped(ckpt):
    """A DCP save before the first step gives the optimizer its state (as torch's
    get_optimizer_state_dict does): on every rank, or the replicas would step apart."""
    model = ZeRO(build(CKPT_SPEC), stage=3, mesh=mesh_of((2, 2)))
    opt = make_opt("adam", model.parameters())
    save_checkpoint(ckpt, model, opt, format="dcp")
    return sorted(float(state["step"]) for state in opt.state.values())


def test_a_dcp_save_before_the_first_step_leaves_the_replicas_alike(pools, tmp_path):
    steps = pools(4).run(save_unstepped, str(tmp_path / f"ckpt-{uuid.uuid4().hex[:8]}"))
    assert steps[0] and all(s == steps[0] for s in steps), steps


def save_into_a_file(ckpt):
    model = ZeRO(build(CKPT_SPEC), stage=3, mesh=mesh_of((2, 2)))
    try:
        save_checkpoint(ckpt, model, make_opt("sgd", model.parameters()))
    except (OSError, RuntimeError) as exc:
        return type(exc).__name__
    return None


def test_a_failed_save_raises_on_every_replica(pools, tmp_path):
    """The path is a plain file: the first replica's ranks fail to make the directory, and the
    other replica, which writes nothing, must raise too (not hang, not return as if saved)."""
    ckpt = tmp_path / "not-a-directory"
    ckpt.write_text("")
    assert pools(4).run(save_into_a_file, str(ckpt)) == \
        ["FileExistsError", "FileExistsError", "CheckpointError", "CheckpointError"]


# ====================================================================== 5. refused set-ups
def bad_meshes():
    from torch.distributed.device_mesh import init_device_mesh
    model = build(CKPT_SPEC)
    errors = []
    if "3d" not in _MESHES:
        _MESHES["3d"] = init_device_mesh("cpu", (2, 1, 2))
    for kwargs in (dict(mesh=mesh_of((2, 2)), process_group=dist.group.WORLD),
                   dict(mesh="2x2"), dict(mesh=_MESHES["3d"])):
        try:
            ZeRO(model, stage=3, **kwargs)
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_meshes_it_cannot_use_are_refused_on_every_rank(pools):
    """Before any collective: both mesh and process_group, not a DeviceMesh, a 3-D mesh."""
    for errors in pools(4).run(bad_meshes):
        assert "not both" in errors[0]
        assert "DeviceMesh" in errors[1]
        assert "3 dims" in errors[2] and "(replicate, shard)" in errors[2]


# ============================================================ 6. a real two-agent launch
TUTORIAL = "tutorials/11_outgrowing_one_machine.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_agents(rendezvous: str, script: str = TUTORIAL, timeout: float = 240):
    """Two torchrun agents on this machine, 2 ranks each, forming one 4-rank job, as on two
    machines. Returns both agents' (returncode, stdout, stderr)."""
    port = _free_port()
    if rendezvous == "static":
        args = [["--nnodes=2", f"--node-rank={i}", "--master-addr=127.0.0.1",
                 f"--master-port={port}"] for i in (0, 1)]
    else:
        job = f"minishard-test-{uuid.uuid4().hex[:8]}"
        args = [["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                 f"--rdzv-id={job}"]] * 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *a,
                               "--nproc-per-node=2", script], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in args]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_torchrun_agents_form_one_hybrid_job(rendezvous):
    """Tutorial 11 asserts, from the ranks torchrun put on each node, that hybrid sharding sends
    3Ψ(S-1)/S per rank inside a node and 2(Ψ/S)(R-1)/R across, and full sharding everything
    across; here: the launch works both ways, one job of 2 nodes x 2 ranks."""
    results = two_agents(rendezvous)
    for code, stdout, stderr in results:
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    printed = "".join(stdout for _, stdout, _ in results)
    assert "2 nodes x 2 ranks" in printed, printed
    assert "All assertions held." in printed, printed
