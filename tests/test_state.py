"""Checkpoints (state.py): resume across world sizes and stages, crash safety, full optimizer export.

The oracle for resuming is the uninterrupted run: 4 steps straight at world size A must equal
2 steps at A, save, load at world size B (any stage), 2 more steps. Every step uses the same
global batch (from the step's seed) split evenly over whoever runs it, so world size changes
nothing but the order of floating-point sums (float64 keeps that below 1e-12).
"""
import contextlib
import os
import unittest.mock
import uuid

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st
from torch import nn

from minishard import ZeRO
from minishard.checkpoint.state import (CheckpointError, check_checkpoint, checkpoint_path,
                                        full_optimizer_state_dict, latest_checkpoint,
                                        load_checkpoint, load_full_optimizer_state_dict,
                                        original_parameter_names, save_checkpoint)
from minishard.checkpoint.files import committed
from minishard.testing import RankError

GLOBAL_BATCH = 12  # divisible by every world size 1-4
TIGHT = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # a buffer that changes

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.lin(x))


class Gate(nn.Module):
    """A unit of 3 elements: at 4 ranks one shard is empty (k=1, rank 3 holds nothing)."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return x * self.g.repeat(3)[: x.shape[-1]]


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.scale = nn.Parameter(torch.full((d,), 0.5), requires_grad=False)  # a frozen flat
        self.inp = nn.Linear(d, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.gate = Gate()
        self.out = nn.Linear(d, d)
        self.out.weight = self.inp.weight  # tied: one slot, two names

    def forward(self, x):
        return self.out(self.gate(self.blocks(torch.tanh(self.inp(x))))) * self.scale


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=0.01, foreach=True),
}


def global_batch(step, d=8):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, d, generator=gen, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, d, generator=gen, dtype=torch.float64))


def train(model, opt, steps, world=1, rank=0, d=8):
    for step in steps:
        x, y = global_batch(step, d)
        n = GLOBAL_BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def make(stage, opt_name, seed=0, d=8):
    torch.manual_seed(seed)
    model = ZeRO(Net(d).double(), stage=stage, units=(Block, Gate))
    return model, OPTIMIZERS[opt_name](model.parameters())


def ws_rank():
    return dist.get_world_size(), dist.get_rank()


# ----------------------------------------------------------------------- rank functions
def oracle_and_save(stage, opt_name, ckpt, format="minishard"):
    world, rank = ws_rank()
    model, opt = make(stage, opt_name)
    train(model, opt, range(4), world, rank)
    oracle = model.full_state_dict()
    model, opt = make(stage, opt_name)
    train(model, opt, range(2), world, rank)
    save_checkpoint(ckpt, model, opt, format=format)
    return oracle


def load_and_finish(stage, opt_name, ckpt):
    world, rank = ws_rank()
    model, opt = make(stage, opt_name, seed=99)  # other initial values: the load must replace them
    load_checkpoint(ckpt, model, opt)
    train(model, opt, range(2, 4), world, rank)
    return model.full_state_dict()


def save_steps(root, steps):
    """Train and save after each step into root/step-00000s."""
    world, rank = ws_rank()
    model, opt = make(2, "adam")
    for step in range(1, steps + 1):
        train(model, opt, [step - 1], world, rank)
        save_checkpoint(checkpoint_path(root, step), model, opt)
    return True


def try_load(ckpt, d=8, stage=2):
    """Load; return the error message (or None) of each rank instead of raising."""
    model, opt = make(stage, "adam", d=d)
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def try_save_over(ckpt, overwrite=False):
    model, opt = make(2, "adam", seed=3)
    try:
        save_checkpoint(ckpt, model, opt, overwrite=overwrite)
    except FileExistsError as exc:
        return str(exc)
    fresh_model, fresh_opt = make(2, "adam")
    load_checkpoint(ckpt, fresh_model, fresh_opt)
    a, b = fresh_model.full_state_dict(), model.full_state_dict()
    return all(torch.equal(a[k], b[k]) for k in b) or "loaded other values"


def load_recording_reads(ckpt):
    """Load, and return the files this rank opened."""
    import minishard.checkpoint.files as files
    opened, read = [], files.read_checked
    files.read_checked = lambda file, expect=None: (opened.append(os.path.basename(file)),
                                                    read(file, expect))[1]
    try:
        model, opt = make(3, "adam")
        load_checkpoint(ckpt, model, opt)
    finally:
        files.read_checked = read
    return sorted(opened)


def export_and_roundtrip(stage, other_stage, opt_name):
    """Train 2 steps; export full params + optimizer state; load them into a second model (any
    stage) through load_full_*; train both 2 more steps."""
    world, rank = ws_rank()
    model, opt = make(stage, opt_name)
    start = model.full_state_dict()
    train(model, opt, range(2), world, rank)
    sd, osd = model.full_state_dict(), full_optimizer_state_dict(model, opt)
    twin, twin_opt = make(other_stage, opt_name, seed=7)
    twin.load_full_state_dict(sd)
    load_full_optimizer_state_dict(twin, twin_opt, osd)
    train(model, opt, range(2, 4), world, rank)
    train(twin, twin_opt, range(2, 4), world, rank)
    return (start, sd, osd, model.full_state_dict(), twin.full_state_dict(),
            original_parameter_names(model))


# ---------------------------------------------------------------------------------- helpers
def assert_same_state(a, b, **tol):
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TIGHT), msg=lambda m: f"{k}: {m}")


def fresh(tmp_path):
    return str(tmp_path / uuid.uuid4().hex[:8])


# -------------------------------------------------------------------- resume across world sizes
@settings(max_examples=14)
@given(a=st.integers(1, 4), b=st.integers(1, 4), stage_a=st.integers(0, 3),
       stage_b=st.integers(0, 3), opt_name=st.sampled_from(sorted(OPTIMIZERS)))
@example(a=2, b=3, stage_a=3, stage_b=3, opt_name="adam")
@example(a=2, b=1, stage_a=1, stage_b=2, opt_name="sgd")
@example(a=4, b=3, stage_a=2, stage_b=0, opt_name="adam")
@example(a=1, b=4, stage_a=0, stage_b=3, opt_name="sgd")
def test_resume_at_another_world_size_equals_uninterrupted_run(pools, tmp_path, a, b, stage_a,
                                                               stage_b, opt_name):
    ckpt = fresh(tmp_path)
    oracle = pools(a).run(oracle_and_save, stage_a, opt_name, ckpt)[0]
    assert sorted(os.listdir(ckpt)) == sorted([f"rank{r}-of-{a}.pt" for r in range(a)] +
                                              ["meta.pt"])  # no temporary files left behind
    resumed = pools(b).run(load_and_finish, stage_b, opt_name, ckpt)
    for r in range(b):
        assert_same_state(resumed[r], oracle)


def test_each_rank_reads_only_the_files_it_needs(pools, tmp_path):
    root = fresh(tmp_path)
    pools(4).run(save_steps, root, 1)
    # every flat is cut in 4 at the save; at 2 ranks, rank 0 holds the first half of each flat
    # (saved ranks 0-1) and rank 1 the second half (saved ranks 2-3; the 3-element gate: rank 2)
    opened = pools(2).run(load_recording_reads, checkpoint_path(root, 1))
    assert opened == [["meta.pt", "rank0-of-4.pt", "rank1-of-4.pt"],
                      ["meta.pt", "rank2-of-4.pt", "rank3-of-4.pt"]]


# ------------------------------------------------------------------------------ crash safety
@pytest.fixture
def two_steps(pools, tmp_path):
    """root/step-000001 and root/step-000002, saved at world size 2 (stage 2, Adam)."""
    root = fresh(tmp_path)
    pools(2).run(save_steps, root, 2)
    assert latest_checkpoint(root) == checkpoint_path(root, 2)
    return root


def load_errors(pools, ckpt, ws=2, **kw):
    """The error message of every rank (all ranks refuse together: none may hang)."""
    errors = pools(ws).run(try_load, ckpt, **kw)
    assert all(errors), f"some ranks loaded {ckpt}: {errors}"
    return "\n".join(errors)


def truncate(file, keep=0.5):
    with open(file, "rb") as fh:
        data = fh.read()
    with open(file, "wb") as fh:
        fh.write(data[:int(len(data) * keep)])


def test_missing_meta_means_incomplete(pools, two_steps):
    newest = checkpoint_path(two_steps, 2)
    os.remove(os.path.join(newest, "meta.pt"))  # a crash after the rank files, before meta
    assert latest_checkpoint(two_steps) == checkpoint_path(two_steps, 1)
    msg = load_errors(pools, newest, ws=3)
    assert "incomplete: meta.pt is missing" in msg and "latest_checkpoint" in msg
    assert pools(3).run(try_load, latest_checkpoint(two_steps)) == [None] * 3


def test_newer_rank_files_without_meta_are_skipped(pools, two_steps):
    step3 = checkpoint_path(two_steps, 3)  # rank files of a newer step landed; meta never did
    os.makedirs(step3)
    for name in ("rank0-of-2.pt", "rank1-of-2.pt"):
        with open(os.path.join(checkpoint_path(two_steps, 2), name), "rb") as src, \
                open(os.path.join(step3, name), "wb") as dst:
            dst.write(src.read())
    os.makedirs(os.path.join(two_steps, "step-000010"))  # empty: sorted as 10 > 3 > 2, skipped
    assert latest_checkpoint(two_steps) == checkpoint_path(two_steps, 2)
    assert "meta.pt is missing" in load_errors(pools, step3)


def test_truncated_files_are_refused(pools, two_steps):
    newest = checkpoint_path(two_steps, 2)
    truncate(os.path.join(newest, "rank1-of-2.pt"))
    assert latest_checkpoint(two_steps) == checkpoint_path(two_steps, 1)
    with pytest.raises(CheckpointError, match=r"rank1-of-2\.pt has \d+ bytes but meta\.pt "
                                              r"recorded \d+: it is truncated"):
        check_checkpoint(newest)
    assert "rank1-of-2.pt has" in load_errors(pools, newest, ws=1)
    truncate(os.path.join(newest, "meta.pt"))
    assert latest_checkpoint(two_steps) == checkpoint_path(two_steps, 1)
    assert "meta.pt could not be read" in load_errors(pools, newest)


def test_corrupted_bytes_are_caught_by_sha256(pools, two_steps):
    newest = checkpoint_path(two_steps, 2)
    file = os.path.join(newest, "rank0-of-2.pt")
    with open(file, "r+b") as fh:  # same size, one byte flipped deep inside the tensor data
        fh.seek(os.path.getsize(file) - 800)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        check_checkpoint(newest)
    assert latest_checkpoint(two_steps, checksums=True) == checkpoint_path(two_steps, 1)
    # the ranks reading that file find out; the others refuse with them instead of hanging
    errors = pools(2).run(try_load, newest)
    assert "rank0-of-2.pt does not match the sha256" in errors[0]
    assert errors[1] and ("another rank could not load" in errors[1] or "sha256" in errors[1])


def test_checkpoint_of_another_model_names_the_mismatch(pools, two_steps):
    msg = load_errors(pools, checkpoint_path(two_steps, 2), d=6)
    assert "saved from a different model" in msg
    assert "inp.weight: checkpoint (8, 8), model (6, 6)" in msg


def test_world_size_in_meta_must_match_the_files(pools, two_steps):
    newest = checkpoint_path(two_steps, 2)
    meta_file = os.path.join(newest, "meta.pt")
    meta = torch.load(meta_file, weights_only=True)
    meta["world_size"] = 3
    torch.save(meta, meta_file)
    with pytest.raises(CheckpointError, match=r"meta\.pt says world size 3.*rank2-of-3\.pt"):
        check_checkpoint(newest)
    assert "says world size 3" in load_errors(pools, newest)
    # meta right, but the rank files swapped (with their sizes and sha256 in meta): each file
    # says which rank of which world size wrote it
    meta["world_size"] = 2
    for key in ("bytes", "sha256"):
        meta["files"][0][key], meta["files"][1][key] = meta["files"][1][key], meta["files"][0][key]
    torch.save(meta, meta_file)
    a, b = (os.path.join(newest, f"rank{r}-of-2.pt") for r in (0, 1))
    os.replace(a, a + ".x"), os.replace(b, a), os.replace(a + ".x", b)
    assert "rank0-of-2.pt in" in load_errors(pools, newest) and "says it is rank 1 of 2" in \
        load_errors(pools, newest)


def test_saving_over_a_complete_checkpoint_is_refused(pools, two_steps):
    errors = pools(2).run(try_save_over, checkpoint_path(two_steps, 1))
    assert all("already holds a checkpoint" in e for e in errors)
    assert latest_checkpoint(two_steps) == checkpoint_path(two_steps, 2)
    assert pools(2).run(try_save_over, checkpoint_path(two_steps, 2), overwrite=True) == [True] * 2
    assert latest_checkpoint(two_steps, checksums=True) == checkpoint_path(two_steps, 2)


class Payload:
    """Unpickling this runs _touch: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def _touch(path):
    open(path, "w").close()


def test_loads_use_weights_only(pools, two_steps, tmp_path):
    newest = checkpoint_path(two_steps, 2)
    marker = str(tmp_path / "code-ran")
    torch.save({"format": 1, "payload": Payload(marker)}, os.path.join(newest, "meta.pt"))
    with pytest.raises(CheckpointError, match=r"refusing to load .*weights_only=True"):
        check_checkpoint(newest)
    assert "refusing to load" in load_errors(pools, newest)
    assert not os.path.exists(marker)  # nothing in the file was executed


# ---------------------------------------------------------------------- full optimizer export
@settings(max_examples=10)
@given(ws=st.integers(1, 3), stage=st.integers(0, 3), other_stage=st.integers(0, 3),
       opt_name=st.sampled_from(sorted(OPTIMIZERS)))
@example(ws=3, stage=3, other_stage=1, opt_name="adam")
@example(ws=2, stage=1, other_stage=0, opt_name="sgd")
def test_full_optimizer_state_dict_resumes_a_plain_model(pools, ws, stage, other_stage, opt_name):
    start, sd, osd, final, twin_final, names = pools(ws).run(
        export_and_roundtrip, stage, other_stage, opt_name)[0]
    assert names == [n for n, _ in Net().named_parameters()]
    # the plain model, trained from the same start, holds the same optimizer state (same format)
    plain = Net().double()
    plain.load_state_dict(start)
    plain_opt = OPTIMIZERS[opt_name](plain.parameters())
    train(plain, plain_opt, range(2))
    expected = plain_opt.state_dict()
    assert expected["param_groups"] == osd["param_groups"]
    assert sorted(expected["state"]) == sorted(osd["state"])
    for i, state in expected["state"].items():
        assert sorted(state) == sorted(osd["state"][i])
        for key in state:
            torch.testing.assert_close(osd["state"][i][key], state[key], rtol=1e-9, atol=1e-12)
    # loaded from the export, a plain model continues exactly as the ZeRO model does
    resumed = Net().double()
    resumed.load_state_dict(sd)
    resumed_opt = OPTIMIZERS[opt_name](resumed.parameters())
    resumed_opt.load_state_dict(osd)
    train(resumed, resumed_opt, range(2, 4))
    assert_same_state(resumed.state_dict(), final, rtol=1e-9, atol=1e-12)
    # and the inverse: a ZeRO model loaded through load_full_optimizer_state_dict too
    assert_same_state(twin_final, final)


# ------------------------------------------------------------------------ exact round trip
def snapshot(stage, mixed, ckpt=None, load=False, format="minishard"):
    """Full params and optimizer state of a model trained 2 steps (then saved), or of a fresh
    model loaded from ``ckpt``."""
    from minishard import MixedPrecision
    world, rank = ws_rank()
    torch.manual_seed(0 if not load else 5)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    model = ZeRO(Net().float(), stage=stage, units=(Block, Gate), mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if load:
        load_checkpoint(ckpt, model, opt)
    else:
        train(model, opt, range(2), world, rank)
        save_checkpoint(ckpt, model, opt, format=format)
    return model.full_state_dict(), full_optimizer_state_dict(model, opt)


@pytest.mark.parametrize("a, b, stage_a, stage_b", [(2, 3, 2, 0), (3, 4, 0, 3), (4, 1, 3, 1)])
def test_load_of_save_is_exact_at_any_world_size_with_mixed_precision(pools, tmp_path, a, b,
                                                                      stage_a, stage_b):
    ckpt = fresh(tmp_path)
    before = pools(a).run(snapshot, stage_a, True, ckpt)[0]
    for after in pools(b).run(snapshot, stage_b, True, ckpt, load=True):
        assert sorted(after[0]) == sorted(before[0])
        assert all(torch.equal(after[0][k], before[0][k]) for k in before[0])
        assert after[1]["param_groups"] == before[1]["param_groups"]
        for i, state in before[1]["state"].items():
            assert all(torch.equal(after[1]["state"][i][k], v) for k, v in state.items())


# ------------------------------------------------------------- parameter order, the hard case
class Interleaved(nn.Module):
    """Frozen, trainable, frozen in one module: ZeRO puts w and c in one flat, b in another, so
    the order w, b, c cannot be read back from the flats: the engine records it at wrap time."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3), requires_grad=False)
        self.b = nn.Parameter(torch.ones(4))
        self.c = nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x):
        return x * self.b.sum() + self.w.sum() + self.c.sum()


def export_interleaved(param_names):
    model = ZeRO(Interleaved(), stage=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2)).sum().backward()
    opt.step()
    osd = full_optimizer_state_dict(model, opt, param_names=param_names)
    return {i: tuple(s["exp_avg"].shape) for i, s in osd["state"].items()}


def test_export_keeps_the_order_of_a_module_mixing_frozen_and_trainable(pools):
    truth = [n for n, _ in Interleaved().named_parameters()]  # w, b, c
    assert pools(2).run(export_interleaved, truth)[0] == {1: (4,)}      # b is parameter 1
    assert pools(2).run(export_interleaved, None)[0] == {1: (4,)}       # recorded at wrap time

# ------------------------------------------------- param groups by dimension, through a checkpoint
def grouped_optimizer(opt_name, module):
    """nanoGPT's groups, formed after wrapping from the module's own parameters: decay where
    ``p.dim() >= 2``, none (and another learning rate) elsewhere."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return OPTIMIZERS[opt_name]([{"params": decay},
                                 {"params": rest, "weight_decay": 0.0, "lr": 0.02}])


def grouped_save(stage, opt_name, ckpt):
    world, rank = ws_rank()
    torch.manual_seed(0)
    model = ZeRO(Net().double(), stage=stage, units=(Block, Gate))
    opt = grouped_optimizer(opt_name, model.module)
    train(model, opt, range(2), world, rank)
    save_checkpoint(ckpt, model, opt)
    return full_optimizer_state_dict(model, opt)


def grouped_resume(stage, opt_name, ckpt):
    world, rank = ws_rank()
    torch.manual_seed(5)  # other values: the load must replace them
    model = ZeRO(Net().double(), stage=stage, units=(Block, Gate))
    opt = grouped_optimizer(opt_name, model.module)
    opt.param_groups[1]["lr"] = 0.5  # and other hyperparameters: the saved ones come back
    load_checkpoint(ckpt, model, opt)
    train(model, opt, range(2, 4), world, rank)
    return model.full_state_dict(), [{k: v for k, v in g.items() if k != "params"}
                                     for g in opt.param_groups]


@settings(max_examples=8)
@given(a=st.integers(1, 4), b=st.integers(1, 4), stage_a=st.integers(0, 3),
       stage_b=st.integers(0, 3), opt_name=st.sampled_from(sorted(OPTIMIZERS)))
@example(a=3, b=2, stage_a=3, stage_b=1, opt_name="adam")
def test_param_groups_by_dim_survive_a_checkpoint_and_the_export(pools, tmp_path, a, b, stage_a,
                                                                 stage_b, opt_name):
    """Groups by dimension (their hyperparameters and which parameters each holds) saved at one
    world size and stage, resumed at another, against the plain module with the same groups on
    the global batch; the full optimizer export with groups is torch's own state dict of it."""
    ckpt = fresh(tmp_path)
    osd = pools(a).run(grouped_save, stage_a, opt_name, ckpt)[0]
    resumed = pools(b).run(grouped_resume, stage_b, opt_name, ckpt)
    torch.manual_seed(0)
    plain = Net().double()
    plain_opt = grouped_optimizer(opt_name, plain)
    train(plain, plain_opt, range(2))
    expected = plain_opt.state_dict()
    assert osd["param_groups"] == expected["param_groups"]
    for i, state in expected["state"].items():
        for key in state:
            torch.testing.assert_close(osd["state"][i][key], state[key], rtol=1e-9, atol=1e-12)
    train(plain, plain_opt, range(2, 4))
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in plain_opt.param_groups]
    for sd, groups in resumed:
        assert groups == hyper
        assert_same_state(sd, plain.state_dict(), rtol=1e-9, atol=1e-12)


def meta_fails_on_rank_0(ckpt):
    """meta.pt cannot be built on rank 0: every rank raises, none waits forever."""
    import minishard.checkpoint.state
    model, opt = make(2, "adam")
    with unittest.mock.patch.object(minishard.checkpoint.state, "_meta", side_effect=RuntimeError("disk full")):
        try:
            save_checkpoint(ckpt, model, opt)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            return type(exc).__name__, str(exc)
    return None


def test_a_failure_building_meta_on_rank_0_raises_on_every_rank(pools, tmp_path):
    ckpt = fresh(tmp_path)
    results = pools(3).run(meta_fails_on_rank_0, ckpt)
    assert results[0] == ("RuntimeError", "disk full"), results
    for r in (1, 2):
        assert results[r][0] == "CheckpointError" and "rank 0 could not write" in results[r][1]
    assert not os.path.exists(os.path.join(ckpt, "meta.pt"))  # incomplete, as it must read


def load_into_swapped_groups(stage, opt_name, ckpt):
    """Saved with [decay, no_decay]; loaded into an optimizer built as [no_decay, decay]."""
    torch.manual_seed(5)
    model = ZeRO(Net().double(), stage=stage, units=(Block, Gate))
    decay = [p for p in model.module.parameters() if p.dim() >= 2]
    rest = [p for p in model.module.parameters() if p.dim() < 2]
    opt = OPTIMIZERS[opt_name]([{"params": rest, "weight_decay": 0.0, "lr": 0.02},
                                {"params": decay}])
    before = [dict(g) for g in opt.param_groups]
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        return "refused", str(exc), [dict(g) == b for g, b in zip(opt.param_groups, before)]
    return "loaded", [(g["lr"], g["weight_decay"]) for g in opt.param_groups], []


@pytest.mark.parametrize("stage", [0, 3])
def test_groups_in_another_order_are_refused_not_swapped(pools, tmp_path, stage):
    """Compared as sets, [no_decay, decay] would load [decay, no_decay]'s settings into the
    wrong groups (biases with weight decay, weights with the biases' learning rate), silently."""
    ckpt = fresh(tmp_path)
    pools(2).run(grouped_save, stage, "sgd", ckpt)
    for outcome, said, untouched in pools(2).run(load_into_swapped_groups, stage, "sgd", ckpt):
        assert outcome == "refused", said
        assert "same param groups" in said and all(untouched)


# ------------------------------------------------------------- overwrite, crashed at any point
class Crash(BaseException):
    """The process dying at that point: no minishard code may catch it."""


def _crash(*args, **kwargs):
    raise Crash


def _crash_at(point: str):
    """Patches that kill the save at ``point`` (rank 0 does the moves)."""
    import minishard.checkpoint.dcp as dcp
    import minishard.checkpoint.directory as directory
    import minishard.checkpoint.state as state
    stack, patch = contextlib.ExitStack(), unittest.mock.patch.object
    if point == "writing":  # the rank files (minishard), the digests after DCP's files (dcp)
        stack.enter_context(patch(state, "atomic_save", _crash))
        stack.enter_context(patch(dcp, "atomic_save", _crash))
    elif point == "before the swap":
        stack.enter_context(patch(directory, "swap_in", _crash))
    elif point in ("between the renames", "moving the user's files back"):
        rename = os.rename

        def rename_then_crash(src, dst):
            # between the renames: path -> path.previous done, path.saving -> path not; moving
            # back: the user's first file moved back from path.previous, the second not
            if os.fspath(src).endswith(".saving" if point[0] == "b" else "notes"):
                raise Crash
            rename(src, dst)
        stack.enter_context(patch(state.os, "rename", rename_then_crash))
    else:
        stack.enter_context(patch(directory.shutil, "rmtree", _crash))
    return stack


def _users_files(ckpt) -> dict:
    """What the user keeps beside minishard's files in ``ckpt`` (nanoGPT keeps its ckpt.pt in
    out_dir), by name: a file, and a folder holding one."""
    found = {}
    for name in ("ckpt.pt", os.path.join("notes", "todo.txt")):
        file = os.path.join(ckpt, name)
        found[name] = open(file).read() if os.path.exists(file) else None
    return found


def _equals(model, steps: dict) -> list:
    """The steps whose full state dict ``model``'s equals exactly."""
    got = model.full_state_dict()
    return [s for s, sd in steps.items() if all(torch.equal(got[k], sd[k]) for k in sd)]


def overwrite_crashing(ckpt, point, format):
    """Save step 1 at ``ckpt`` (a directory that already holds the user's files); overwrite it
    with step 2, crashing at ``point``; load the newest checkpoint ``latest_checkpoint`` finds
    (and check it is where ``load_checkpoint(ckpt)`` reads); overwrite once more (step 3) and
    load. Returns (the steps the first load equals, those the last equals, what is left beside
    ckpt, the user's files in ckpt at the end)."""
    world, rank = ws_rank()
    opt_name = "adam" if format == "minishard" else "adam_foreach"  # for-loop and foreach
    model, opt = make(2, opt_name)
    steps, loaded = {}, []
    os.makedirs(os.path.join(ckpt, "notes"))
    for name in ("ckpt.pt", os.path.join("notes", "todo.txt")):
        with open(os.path.join(ckpt, name), "w") as fh:
            fh.write(name)
    for step in (1, 2, 3):
        train(model, opt, [step], world, rank)
        steps[step] = model.full_state_dict()
        with _crash_at(point) if step == 2 else contextlib.nullcontext():
            try:
                save_checkpoint(ckpt, model, opt, overwrite=step > 1, format=format)
            except Crash:
                pass
        if step > 1:  # what a restarted job finds
            latest = latest_checkpoint(os.path.dirname(ckpt))
            assert latest == committed(ckpt), (latest, committed(ckpt))
            twin, twin_opt = make(2, opt_name, seed=5)
            load_checkpoint(latest, twin, twin_opt)
            loaded.append(_equals(twin, steps))
    leftovers = sorted(p for p in os.listdir(os.path.dirname(ckpt))
                       if p.startswith(os.path.basename(ckpt) + "."))
    return loaded[0], loaded[1], leftovers, _users_files(ckpt)


# where the crash leaves the previous checkpoint (1) or the new one (2) as what `ckpt` holds
CRASHES = {"writing": 1, "before the swap": 1, "between the renames": 2,
           "moving the user's files back": 2, "deleting the previous": 2}


@pytest.mark.parametrize("format", ["minishard", "dcp"])
@pytest.mark.parametrize("point", list(CRASHES))
def test_an_overwrite_crashed_anywhere_leaves_one_whole_checkpoint(pools, tmp_path, point,
                                                                  format):
    """nanoGPT rewrites one checkpoint at every evaluation (``overwrite=True``), in an out_dir
    that holds its other files. A crash at any point of the rewrite leaves ``ckpt`` loading as
    the previous save or the new one, whole (equal to that step's weights), never a mix and
    never an error, and ``latest_checkpoint`` finds that one (not ``ckpt.previous``); the next
    overwrite succeeds and leaves nothing beside it; the user's files are never lost."""
    ckpt = fresh(tmp_path)
    loaded, last, leftovers, users = pools(1).run(overwrite_crashing, ckpt, point, format)[0]
    assert loaded == [CRASHES[point]] and last == [3] and leftovers == [], (loaded, last,
                                                                             leftovers)
    assert users == {"ckpt.pt": "ckpt.pt", os.path.join("notes", "todo.txt"):
                     os.path.join("notes", "todo.txt")}, users


def overwrite_failing_on_rank0(ckpt, call):
    """Rank 0's ``call``-th os.rename of an overwrite (the swap) raises OSError (a full disk, a
    permission): every rank must raise, none wait in a collective for rank 0; ``ckpt`` still
    loads (the previous save or the new one, whole)."""
    import minishard.checkpoint.state as state
    from minishard import comm
    comm.set_timeout(20)  # were rank 1 left waiting for rank 0, the test would end, named
    world, rank = ws_rank()
    model, opt = make(2, "adam")
    train(model, opt, [1], world, rank)
    save_checkpoint(ckpt, model, opt)
    train(model, opt, [2], world, rank)
    rename, calls = os.rename, []

    def failing(src, dst):
        calls.append(src)
        if rank == 0 and len(calls) == call:
            raise OSError(28, "No space left on device")
        rename(src, dst)
    with unittest.mock.patch.object(state.os, "rename", failing):
        try:
            save_checkpoint(ckpt, model, opt, overwrite=True)
            said = None
        except (OSError, CheckpointError) as exc:
            said = type(exc).__name__
    twin, twin_opt = make(2, "adam", seed=5)
    load_checkpoint(ckpt, twin, twin_opt)
    comm.set_timeout(600)
    return said


@pytest.mark.parametrize("call", [1, 2])
def test_an_overwrite_failing_on_rank0_raises_on_every_rank(pools, tmp_path, call):
    said = pools(2).run(overwrite_failing_on_rank0, fresh(tmp_path), call)
    assert said == ["OSError", "CheckpointError"], said
