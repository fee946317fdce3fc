"""DCP checkpoints both ways with FSDP2 (checkpoint/dcp.py), at different world sizes and stages.

The oracles:
  * FSDP2 itself: ``torch.distributed.checkpoint.state_dict``'s get_/set_ model and optimizer
    state dicts with ``dcp.save`` / ``dcp.load``, as torchtitan checkpoints. A directory FSDP2
    writes at 2 ranks, loaded by minishard at 3 (any stage), holds exactly FSDP2's full state
    (its full state dicts, gathered by torch); and the other way, minishard's directory loaded
    by FSDP2 holds exactly minishard's full export.
  * A single process: a plain model and AdamW loaded with that full state take one more step;
    the loaded minishard (or FSDP2) model must take the same step.
  * The uninterrupted run, as in test_state.py: 4 steps straight at world size A equal 2 steps,
    a DCP save, a load at B (any stage) and 2 more steps.
The model is test_state.py's: a tied weight, a frozen parameter, a 3-element unit (an empty
shard at 4 ranks), an integer buffer that changes every forward.
"""
import contextlib
import copy
import os
import pickle
import unittest.mock

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minishard import ZeRO
from minishard.checkpoint.state import (CheckpointError, check_checkpoint, checkpoint_path,
                                        full_optimizer_state_dict, latest_checkpoint,
                                        load_checkpoint, save_checkpoint)
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from test_state import (Block, Gate, Net, assert_same_state, fresh, load_and_finish, make,
                        oracle_and_save, snapshot, train, ws_rank)

TIGHT = dict(rtol=1e-10, atol=1e-12)


def adamw(params, lr=0.01):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


# ----------------------------------------------------------------------------- FSDP2's side
def fsdp2(seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    net = Net().double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in net.modules():
        if isinstance(m, (Block, Gate)):
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, adamw(net.parameters())


def fsdp2_full_state(net, opt):
    """FSDP2's model and optimizer as full, unsharded state dicts (torch gathers them; copies:
    a CPU buffer or ``step`` comes back as the live tensor, which training would move on)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return copy.deepcopy((get_model_state_dict(net, options=full),
                          get_optimizer_state_dict(net, opt, options=full)))


def fsdp2_train_and_save(ckpt, steps=2, layout="fsdp2"):
    """FSDP2 trains and saves through DCP, in one of three layouts: torch's state dicts under
    "model" and "optim"; the same with the optimizer flattened per parameter
    (``flatten_optimizer_state_dict``: ``param_groups.<name>.lr``); torchtitan's (its
    CheckpointManager puts the model's entries at the top level and the flattened optimizer
    under "optimizer")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    world, rank = ws_rank()
    net, opt = fsdp2(seed=0)
    train(net, opt, range(steps), world, rank)
    flat = StateDictOptions(flatten_optimizer_state_dict=layout != "fsdp2")
    model_sd, optim_sd = get_model_state_dict(net), get_optimizer_state_dict(net, opt, options=flat)
    content = ({**model_sd, "optimizer": optim_sd} if layout == "torchtitan" else
               {"model": model_sd, "optim": optim_sd})
    dcp.save(content, checkpoint_id=ckpt)
    return fsdp2_full_state(net, opt)


def fsdp2_load_and_step(ckpt, step=2):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    world, rank = ws_rank()
    net, opt = fsdp2(seed=99)  # other initial values: the load must replace them
    model_sd, optim_sd = get_state_dict(net, opt)
    content = {"model": model_sd, "optim": optim_sd}
    dcp.load(content, checkpoint_id=ckpt)
    set_state_dict(net, opt, model_state_dict=content["model"], optim_state_dict=content["optim"])
    loaded = fsdp2_full_state(net, opt)
    train(net, opt, [step], world, rank)
    return loaded, fsdp2_full_state(net, opt)[0]


# ------------------------------------------------------------------------- minishard's side
def minishard(stage, seed, lr=0.01):
    torch.manual_seed(seed)
    model = ZeRO(Net().double(), stage=stage, units=(Block, Gate))
    return model, adamw(model.parameters(), lr)


def minishard_train_and_save(ckpt, stage, steps=2):
    world, rank = ws_rank()
    model, opt = minishard(stage, seed=0)
    train(model, opt, range(steps), world, rank)
    save_checkpoint(ckpt, model, opt, format="dcp")
    return model.full_state_dict(), full_optimizer_state_dict(model, opt)


def minishard_load_and_step(ckpt, stage, step=2):
    world, rank = ws_rank()
    model, opt = minishard(stage, seed=99, lr=0.5)  # the checkpoint's lr must replace it
    meta = load_checkpoint(ckpt, model, opt)
    loaded = model.full_state_dict(), full_optimizer_state_dict(model, opt)
    train(model, opt, [step], world, rank)
    return meta["format"], loaded, model.full_state_dict()


# ---------------------------------------------------------------------- the single process
def by_index(osd_by_name):
    """torch's optimizer layout keyed by name (DCP's) -> keyed by the parameter's index in
    ``Net().named_parameters()`` (a plain optimizer's)."""
    index = {name: i for i, (name, _) in enumerate(Net().named_parameters())}
    return {"state": {index[n]: s for n, s in osd_by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in osd_by_name["param_groups"]]}


def one_more_step(model_sd, osd, step=2):
    """A plain model and AdamW in this process, loaded with the full state, one step on."""
    net = Net().double()
    net.load_state_dict(model_sd)
    opt = adamw(net.parameters())
    opt.load_state_dict(copy.deepcopy(osd))  # load_state_dict keeps the tensors: step mutates them
    train(net, opt, [step])
    return net.state_dict()


def assert_same_optimizer_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, state in a["state"].items():
        assert sorted(state) == sorted(b["state"][i])
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][i][key])), (i, key)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("stage, layout", [(0, "fsdp2"), (1, "fsdp2"), (2, "fsdp2"),
                                           (3, "fsdp2"), (3, "flattened"), (1, "torchtitan")])
def test_fsdp2_checkpoint_loads_into_minishard_at_another_world_size(pools, tmp_path, stage,
                                                                     layout):
    ckpt = fresh(tmp_path)
    model_sd, osd = pools(2).run(fsdp2_train_and_save, ckpt, 2, layout)[0]
    oracle = one_more_step(model_sd, by_index(osd))
    for fmt, (loaded_sd, loaded_osd), after in pools(3).run(minishard_load_and_step, ckpt, stage):
        assert fmt == "dcp"
        assert_same_state(loaded_sd, model_sd, rtol=0, atol=0)  # bit for bit what FSDP2 held
        assert_same_optimizer_state(loaded_osd, by_index(osd))
        assert_same_state(after, oracle)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_minishard_checkpoint_loads_into_fsdp2_at_another_world_size(pools, tmp_path, stage):
    ckpt = fresh(tmp_path)
    model_sd, osd = pools(3).run(minishard_train_and_save, ckpt, stage)[0]
    oracle = one_more_step(model_sd, osd)
    # torch's full state dicts (cpu_offload) are rank 0's only
    (loaded_sd, loaded_osd), after = pools(2).run(fsdp2_load_and_step, ckpt)[0]
    assert_same_state(loaded_sd, model_sd, rtol=0, atol=0)
    assert_same_optimizer_state(by_index(loaded_osd), osd)
    assert_same_state(after, oracle)


@pytest.mark.parametrize("stage", [0, 3])
def test_every_rank_writes_only_its_rows(pools, tmp_path, stage):
    """No rank holds or writes the whole model: in DCP's own metadata, the rows of every
    parameter and of its Adam state are written by the rank that holds them, FSDP2's Shard(0)
    cut (at stage 0 too, where every rank holds everything)."""
    from torch.distributed.checkpoint import FileSystemReader
    ckpt = fresh(tmp_path)
    model_sd, _ = pools(3).run(minishard_train_and_save, ckpt, stage)[0]
    metadata = FileSystemReader(ckpt).read_metadata()
    written = {}
    for index, info in metadata.storage_data.items():
        written.setdefault(index.fqn, []).append((info.relative_path, tuple(index.offset or ())))
    params = dict(Net().named_parameters(remove_duplicate=False))  # a tied weight: both names
    for key, chunks in written.items():
        name = key.removeprefix("model.").removeprefix("optim.state.").rsplit(".", 1)[0] \
            if key.startswith("optim.") else key.removeprefix("model.")
        if name not in params or params[name].dim() == 0 or key.endswith(".step"):
            assert [f for f, _ in chunks] == ["__0_0.distcp"], key  # scalars, buffers: rank 0
            continue
        rows, c = params[name].shape[0], -(-params[name].shape[0] // 3)
        expected = [(f"__{r}_0.distcp", r * c) for r in range(3) if r * c < rows]
        assert sorted((f, o[0]) for f, o in chunks) == expected, key


@settings(max_examples=10)
@given(a=st.integers(1, 4), b=st.integers(1, 4), stage_a=st.integers(0, 3),
       stage_b=st.integers(0, 3), opt_name=st.sampled_from(["adam", "sgd"]))
@example(a=2, b=3, stage_a=3, stage_b=3, opt_name="adam")
@example(a=4, b=1, stage_a=2, stage_b=0, opt_name="sgd")
@example(a=1, b=4, stage_a=0, stage_b=3, opt_name="adam")
def test_dcp_resume_at_another_world_size_equals_uninterrupted_run(pools, tmp_path, a, b,
                                                                   stage_a, stage_b, opt_name):
    ckpt = fresh(tmp_path)
    oracle = pools(a).run(oracle_and_save, stage_a, opt_name, ckpt, "dcp")[0]
    assert ".metadata" in os.listdir(ckpt)
    for resumed in pools(b).run(load_and_finish, stage_b, opt_name, ckpt):
        assert_same_state(resumed, oracle, **TIGHT)


@pytest.mark.parametrize("a, b, stage_a, stage_b", [(2, 3, 2, 0), (3, 4, 0, 3), (4, 1, 3, 1)])
def test_dcp_load_of_save_is_exact_with_mixed_precision(pools, tmp_path, a, b, stage_a, stage_b):
    """The fp32 masters go into the checkpoint, not the bf16 compute copies."""
    ckpt = fresh(tmp_path)
    before = pools(a).run(snapshot, stage_a, True, ckpt, format="dcp")[0]
    for after in pools(b).run(snapshot, stage_b, True, ckpt, load=True):
        assert_same_state(after[0], before[0], rtol=0, atol=0)
        assert_same_optimizer_state(after[1], before[1])


class WithScalar(nn.Module):
    """A 0-dim parameter: it cannot be cut into rows; at stages 1-3 rank 0 alone holds it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.t = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.t


def scalar_snapshot(stage, ckpt, load, with_optimizer):
    torch.manual_seed(5 if load else 0)
    model = ZeRO(WithScalar().double(), stage=stage)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if load:
        load_checkpoint(ckpt, model, opt if with_optimizer else None)
    else:
        train(model, opt, range(2), *ws_rank())
        save_checkpoint(ckpt, model, opt if with_optimizer else None, format="dcp")
    return model.full_state_dict(), full_optimizer_state_dict(model, opt)


@pytest.mark.parametrize("a, b, stage_a, stage_b, with_optimizer",
                         [(3, 2, 3, 1, True), (2, 3, 0, 3, True), (4, 1, 2, 0, False)])
def test_dcp_round_trip_of_a_0_dim_parameter_with_and_without_optimizer(
        pools, tmp_path, a, b, stage_a, stage_b, with_optimizer):
    ckpt = fresh(tmp_path)
    before = pools(a).run(scalar_snapshot, stage_a, ckpt, False, with_optimizer)[0]
    for after in pools(b).run(scalar_snapshot, stage_b, ckpt, True, with_optimizer):
        assert_same_state(after[0], before[0], rtol=0, atol=0)
        if with_optimizer:
            assert_same_optimizer_state(after[1], before[1])
        else:
            assert after[1]["state"] == {}  # nothing loaded into the optimizer
    if not with_optimizer:
        errors = pools(b).run(try_scalar_load, ckpt)
        assert all(e and "holds no optimizer state" in e for e in errors), errors


def try_scalar_load(ckpt):
    try:
        scalar_snapshot(0, ckpt, True, True)
    except CheckpointError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------- refusals
def try_load(ckpt, opt_name="adam", d=8):
    model, opt = make(2, opt_name, d=d)
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def save_dcp(ckpt, opt_name="adam", d=8, overwrite=False):
    model, opt = make(2, opt_name, d=d)
    train(model, opt, range(1), *ws_rank(), d=d)
    try:
        save_checkpoint(ckpt, model, opt, format="dcp", overwrite=overwrite)
    except FileExistsError as exc:
        return str(exc)
    return None


def test_dcp_checkpoint_of_another_model_or_optimizer_is_refused_on_every_rank(pools, tmp_path):
    ckpt = fresh(tmp_path)
    pools(2).run(save_dcp, ckpt, "adam", 6)
    errors = pools(3).run(try_load, ckpt)
    assert all(e and "different model" in e for e in errors), errors
    assert "inp.weight: checkpoint (6, 6), model (8, 8)" in "".join(errors)
    ckpt = fresh(tmp_path)
    pools(2).run(save_dcp, ckpt, "sgd")
    errors = pools(3).run(try_load, ckpt, "adam")
    assert all(e and "another kind of optimizer" in e for e in errors), errors


def test_saving_over_a_dcp_checkpoint_is_refused(pools, tmp_path):
    ckpt = fresh(tmp_path)
    assert pools(2).run(save_dcp, ckpt) == [None, None]
    assert all("already holds a checkpoint" in e for e in pools(2).run(save_dcp, ckpt))
    assert pools(2).run(save_dcp, ckpt, overwrite=True) == [None, None]


def save_minishard_then(ckpt, step, format, overwrite=False, break_rank=None):
    """Save after ``step`` steps in ``format``; ``break_rank`` cannot write its data file."""
    model, opt = make(2, "adam")
    train(model, opt, range(step), *ws_rank())
    full = unittest.mock.patch.object(FileSystem, "create_stream", side_effect=OSError("disk full"))
    try:
        with full if ws_rank()[1] == break_rank else contextlib.nullcontext():
            save_checkpoint(ckpt, model, opt, format=format, overwrite=overwrite)
    except (FileExistsError, CheckpointError) as exc:
        return type(exc).__name__
    return None


def test_a_checkpoint_is_never_a_mix_of_two_saves(pools, tmp_path):
    """A directory holding a checkpoint of either format refuses a save of either format; with
    overwrite, a save that fails on one rank leaves the previous checkpoint whole (it loads),
    never half old and half new (the new one is written beside it: [Note: overwrite])."""
    ckpt = fresh(tmp_path)
    assert pools(2).run(save_minishard_then, ckpt, 1, "dcp") == [None, None]
    assert pools(2).run(save_minishard_then, ckpt, 2, "minishard") == ["FileExistsError"] * 2
    assert pools(2).run(save_minishard_then, ckpt, 2, "dcp", True, 1) == ["CheckpointError"] * 2
    assert check_checkpoint(ckpt)["format"] == "dcp"
    with pytest.raises(CheckpointError, match="incomplete|missing"):
        check_checkpoint(ckpt + ".saving")
    assert pools(2).run(try_load, ckpt) == [None, None]


def test_latest_checkpoint_knows_dcp_directories_and_skips_damaged_ones(pools, tmp_path):
    root = fresh(tmp_path)
    for step, fmt in [(1, "minishard"), (2, "dcp"), (3, "dcp")]:
        pools(2).run(save_minishard_then, checkpoint_path(root, step), step, fmt)
    assert latest_checkpoint(root) == checkpoint_path(root, 3)
    data = os.path.join(checkpoint_path(root, 3), "__1_0.distcp")
    with open(data, "r+b") as fh:
        fh.truncate(os.path.getsize(data) // 2)
    assert latest_checkpoint(root) == checkpoint_path(root, 2)
    errors = pools(3).run(try_load, checkpoint_path(root, 3))
    assert all(e and "__1_0.distcp is missing or shorter" in e for e in errors), errors


def minishard_save_unstepped(ckpt):
    model, opt = minishard(3, seed=0)
    save_checkpoint(ckpt, model, opt, format="dcp")
    return True


def test_an_optimizer_that_never_stepped_saves_what_fsdp2_loads(pools, tmp_path):
    """As torch's get_optimizer_state_dict does, its state is made first (step 1, zeros)."""
    ckpt = fresh(tmp_path)
    pools(3).run(minishard_save_unstepped, ckpt)
    (_, loaded_osd), _ = pools(2).run(fsdp2_load_and_step, ckpt)[0]
    for name, state in loaded_osd["state"].items():
        assert state["step"].item() == 1, name
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any(), name


def decay_groups(named, reverse=False):
    """nanoGPT's configure_optimizers: decay the matrices, not the vectors."""
    named = list(named)
    groups = [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    return groups[::-1] if reverse else groups


def fsdp2_grouped_save(ckpt):
    """FSDP2 with named parameter groups (torch records their names) and an LR scheduler
    (which adds initial_lr to every group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    net, _ = fsdp2(seed=0)
    opt = torch.optim.AdamW(decay_groups(net.named_parameters()), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        train(net, opt, [step], *ws_rank())
        sched.step()
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    return per_name(net, opt)


def per_name(model, opt):
    """{name: (its group's settings, its state as full tensors)}, whoever holds it."""
    from torch.distributed.tensor import DTensor
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for p in group["params"]:
            state = {k: v.full_tensor() if isinstance(v, DTensor) else v
                     for k, v in opt.state[p].items()}
            out[names[id(p)].removeprefix("module.")] = (hyper, state)
    return out


def minishard_grouped_load(ckpt, stage):
    model, _ = minishard(stage, seed=5)
    opt = torch.optim.AdamW(decay_groups(model.module.named_parameters(), reverse=True), lr=0.5)
    load_checkpoint(ckpt, model, opt)
    full = full_optimizer_state_dict(model, opt)  # numbered in the optimizer's order, as torch
    names = {id(p): n for n, p in model.module.named_parameters()}
    order = [names[id(p)] for group in opt.param_groups for p in group["params"]]
    return {n: (hyper, full["state"].get(order.index(n), {}))
            for n, (hyper, _) in per_name(model.module, opt).items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_settings_are_matched_by_parameter_name(pools, tmp_path, stage):
    """Groups in another order, recorded names, a scheduler's initial_lr: loaded as torch's
    set_optimizer_state_dict loads them, each parameter with its own group's settings."""
    ckpt = fresh(tmp_path)
    saved = pools(2).run(fsdp2_grouped_save, ckpt)[0]
    for loaded in pools(3).run(minishard_grouped_load, ckpt, stage):
        assert sorted(loaded) == sorted(saved)
        for name, (group, state) in saved.items():
            assert loaded[name][0] == group, name  # lr 0.0025 and initial_lr 0.01, not 0.5
            assert sorted(loaded[name][1]) == sorted(state), name
            for key, value in state.items():
                assert torch.equal(loaded[name][1][key], value), (name, key)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/minishard-dcp-pwned",))


def test_loading_a_dcp_checkpoint_never_runs_code_from_it(pools, tmp_path):
    ckpt = fresh(tmp_path)
    pools(2).run(save_dcp, ckpt)
    with open(os.path.join(ckpt, ".metadata"), "wb") as fh:
        pickle.dump(Payload(), fh)
    errors = pools(2).run(try_load, ckpt)
    assert all(e and "refusing to load posix.system" in e for e in errors), errors
    assert not os.path.exists("/tmp/minishard-dcp-pwned")


def test_unknown_format_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="format must be 'minishard' or 'dcp'"):
        save_checkpoint("/nonexistent", object(), format="pt")


def test_a_byte_changed_in_a_dcp_data_file_is_caught(pools, tmp_path):
    """DCP records no checksums: a data file corrupted in place (same size) loaded silently.
    minishard writes the sha256 of every data file beside its DCP saves (a file torch's readers
    ignore) and checks them before loading: every rank raises, one names the file."""
    ckpt = fresh(tmp_path)
    assert pools(2).run(save_minishard_then, ckpt, 1, "dcp") == [None, None]
    assert check_checkpoint(ckpt) == {"format": "dcp", "sha256": True}
    assert all(e is None for e in pools(3).run(try_load, ckpt))  # intact: loads
    data = os.path.join(ckpt, "__1_0.distcp")
    with open(data, "r+b") as fh:
        fh.seek(os.path.getsize(data) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="__1_0.distcp does not match the sha256"):
        check_checkpoint(ckpt)
    assert check_checkpoint(ckpt, checksums=False) == {"format": "dcp", "sha256": False}
    errors = pools(3).run(try_load, ckpt)
    assert all(errors), errors
    assert any("__1_0.distcp does not match the sha256" in e for e in errors), errors


def test_a_foreign_dcp_checkpoint_has_no_digests_and_loads(pools, tmp_path):
    """FSDP2 (torch's dcp.save) writes no digests: its checkpoint is checked for sizes only,
    says so, and loads."""
    ckpt = fresh(tmp_path)
    pools(2).run(fsdp2_train_and_save, ckpt)
    assert check_checkpoint(ckpt) == {"format": "dcp", "sha256": False}
    assert all(e is None for e in pools(3).run(try_load, ckpt))


def test_overwriting_a_dcp_checkpoint_writes_fresh_digests(pools, tmp_path):
    ckpt = fresh(tmp_path)
    assert pools(2).run(save_minishard_then, ckpt, 1, "dcp") == [None, None]
    assert pools(2).run(save_minishard_then, ckpt, 2, "dcp", True) == [None, None]
    assert check_checkpoint(ckpt) == {"format": "dcp", "sha256": True}
    assert all(e is None for e in pools(2).run(try_load, ckpt))
