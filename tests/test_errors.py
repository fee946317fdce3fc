"""The bad-input catalogue: every case gets a clear error that names the problem (never a hang,
never silent wrong numbers). Each test checks the MESSAGE, not only the exception type."""
import gc
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.testing import RankError, RankPool


# ------------------------------------------------------------------------- rank functions
def syncbn_forward(shape, dtype_name="float32", channels=3):
    bn = minishard.SyncBatchNorm(channels)
    return bn(torch.zeros(shape, dtype=getattr(torch, dtype_name))).shape


def syncbn_single_value_globally():
    bn = minishard.SyncBatchNorm(2)
    n = 1 if dist.get_rank() == 0 else 0  # one sample on rank 0, none elsewhere
    return bn(torch.randn(n, 2))


def syncbn_group_without_me():
    group = dist.new_group([0])  # collective: every rank creates it
    if dist.get_rank() == 1:
        minishard.SyncBatchNorm(2, process_group=group)(torch.randn(4, 2))
    return True


def wrap_twice():
    model = minishard.ZeRO(nn.Linear(3, 3), stage=2)
    minishard.ZeRO(model.module, stage=2)


def deepcopy_then_the_advice(stage):
    """copy.deepcopy of the wrapper is refused; the way the message gives makes a plain copy."""
    import copy
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), stage=stage,
                           units={nn.Linear})
    try:
        copy.deepcopy(model)
        message = None
    except TypeError as exc:
        message = str(exc)
    sd = model.full_state_dict()
    ema = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ema.load_state_dict(sd)
    with model.gathered():
        same = all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(),
                                                     model.module.state_dict().values()))
    return message, same


def forward_inside_gathered(stage):
    """A forward inside ``gathered()`` is refused (at stage 3 it freed the block's parameters
    and the exit then read them: a storage error); afterwards the model trains as one process:
    SGD on out.sum() moves the bias by lr times the global batch size."""
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), stage=stage,
                           units={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with model.gathered():
            model(torch.randn(2, 3))
        message = None
    except RuntimeError as exc:
        message = str(exc)
    before = model.full_state_dict()["1.bias"]
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return message, (before - model.full_state_dict()["1.bias"] - 0.1 * 2).abs().max().item()


def optimizer_before_wrapping():
    """Built before wrapping over parameters the engine cannot keep: meta tensors (deferred
    init) are replaced by real ones, which it steps (plain SGD: w - lr * the mean gradient of
    out.sum(), that is x's column sums for the weight and the batch size for the bias)."""
    with torch.device("meta"):
        module = nn.Linear(3, 3)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)   # nanoGPT's order: before wrapping
    model = minishard.ZeRO(module, stage=3, device="cpu")
    before = model.full_state_dict()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))  # every rank the same
    model(x).sum().backward()
    opt.step()
    after = model.full_state_dict()
    want = {"weight": before["weight"] - 0.1 * x.sum(0).expand(3, 3), "bias": before["bias"] - 0.2}
    return max((after[k] - v).abs().max().item() for k, v in want.items())


def optimizer_of_a_dropped_model():
    """Parameters kept in a list from before wrapping, the model dropped at once, then an
    optimizer built over the list: the successors went with the model (an optimizer alive at
    the wrap holds the successors themselves, so it never meets this)."""
    with torch.device("meta"):
        module = nn.Linear(3, 3)
    kept = list(module.parameters())
    minishard.ZeRO(module, stage=3, device="cpu")  # dropped at once, with its module
    del module
    gc.collect()
    torch.optim.SGD(kept, lr=0.1).step()


def stages_differ():
    minishard.ZeRO(nn.Linear(3, 3), stage=dist.get_rank() % 2 + 1)


def unknown_stage():
    minishard.ZeRO(nn.Linear(3, 3), stage=4)


def load_wrong_state_dict(kind):
    model = minishard.ZeRO(nn.Linear(3, 2), stage=3)
    sd = model.full_state_dict()
    if kind == "missing":
        del sd["bias"]
    else:
        sd["weight"] = torch.zeros(4, 4)
    model.load_full_state_dict(sd)


def save(path, width):
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)), stage=3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    minishard.save_checkpoint(path, model, opt)


def load(path, width):
    model = minishard.ZeRO(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)), stage=3)
    minishard.load_checkpoint(path, model, torch.optim.Adam(model.parameters()))


def two_linears(seed, stage):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    return net if stage is None else minishard.ZeRO(net, stage=stage, units={nn.Linear})


def save_shards(path, stage):
    """What a user saving ``model.state_dict()`` on each rank writes: DTensors of its rows."""
    torch.save(two_linears(0, stage).state_dict(), os.path.join(path, f"rank{dist.get_rank()}.pt"))


def load_shards(path, stage):
    """Every rank loads a saving rank's file (rank 0's and 1's alternate); returns its error
    message, or how far the loaded model is from the saved one."""
    model = two_linears(1, stage)
    try:
        model.load_state_dict(torch.load(os.path.join(path, f"rank{dist.get_rank() % 2}.pt")))
    except RuntimeError as exc:
        return str(exc)
    got = model.full_state_dict()
    return max((got[k] - v).abs().max().item() for k, v in two_linears(0, None).state_dict().items())


def load_transposed(stage, from_rank0):
    """A full state dict whose first weight is (4, 6) for Linear(4, 6)'s (6, 4): the same
    element count, so only the shape can tell. Plain torch refuses it; so must every load."""
    model = two_linears(0, stage)
    plain = two_linears(0, None).state_dict()
    plain["0.weight"] = plain["0.weight"].reshape(4, 6).clone()
    try:
        model.load_full_state_dict(plain, from_rank0=from_rank0)
    except ValueError as exc:
        return str(exc)
    return None


def debug_mismatched_shapes():
    comm.set_debug(True, timeout=5)
    try:
        comm.all_reduce(torch.ones(3 + dist.get_rank()), tag=f"layer{dist.get_rank()}")
    finally:
        comm.set_debug(False)


def debug_rank_skips_syncbn():
    comm.set_debug(True, timeout=3)
    try:
        if dist.get_rank() == 0:
            minishard.SyncBatchNorm(4)(torch.randn(3, 4))
        minishard.SyncBatchNorm(5)(torch.randn(3, 5))
    finally:
        comm.set_debug(False)


class TwoBlocks(nn.Module):
    """Runs its blocks in an order that depends on the rank: the bug the debug check catches."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3, bias=False)

    def forward(self, x):
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(first(x))


def debug_units_in_rank_dependent_order():
    model = minishard.ZeRO(TwoBlocks(), stage=3, units={nn.Linear})
    comm.set_debug(True, timeout=5)
    try:
        model(torch.randn(2, 3))
    finally:
        comm.set_debug(False)


# ----------------------------------------------------------------------------------- SyncBN
@pytest.mark.parametrize("shape, dtype, match", [
    ((4, 5), "float32", r"expected 3 channels in dim 1 of the input, got shape \(4, 5\)"),
    ((4,), "float32", r"expected at least 2D input \(got 1D input"),
    ((4, 3), "int64", r"expected a floating point input, got torch.int64"),
], ids=["wrong-channels", "fewer-than-2-dims", "non-float"])
def test_syncbn_local_input_errors(pools, shape, dtype, match):
    with pytest.raises(RankError, match=match):
        pools(2).run(syncbn_forward, shape, dtype)


def test_syncbn_one_value_per_channel_globally(pools):
    with pytest.raises(RankError, match="Expected more than 1 value per channel when training"):
        pools(2).run(syncbn_single_value_globally)


def test_syncbn_process_group_without_this_rank(pools):
    with pytest.raises(RankError, match=r"rank 1 raised: .*not a member of the process group"):
        pools(2).run(syncbn_group_without_me)


# ----------------------------------------------------------------------------------- engine
def test_wrapping_twice(pools):
    with pytest.raises(RankError, match="already wrapped by minishard.ZeRO"):
        pools(2).run(wrap_twice)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepcopy_is_refused_with_the_way_to_copy(pools, stage):
    for message, same in pools(2).run(deepcopy_then_the_advice, stage):
        assert message and "copy.deepcopy of a minishard.ZeRO model" in message
        assert "model.full_state_dict()" in message and same


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_forward_inside_gathered_is_refused(pools, stage):
    for message, off in pools(2).run(forward_inside_gathered, stage):
        assert message and "inside `with model.gathered():` is not supported" in message
        assert off < 1e-6, off


def test_optimizer_over_replaced_parameters_steps_their_successors(pools):
    assert max(pools(2).run(optimizer_before_wrapping)) < 1e-6
    with pytest.raises(RankError, match="holds a parameter of a module that minishard.ZeRO "
                                        "wrapped, and that engine is gone"):
        pools(2).run(optimizer_of_a_dropped_model)


def test_ranks_with_different_stages(pools):
    with pytest.raises(RankError, match=r"ranks disagree on the configuration \(stage"):
        pools(2).run(stages_differ)


def test_unknown_stage(pools):
    with pytest.raises(RankError, match="stage must be 0, 1, 2 or 3, got 4"):
        pools(1).run(unknown_stage)


@pytest.mark.parametrize("kind, match", [("missing", r"missing keys \['bias'\]"),
                                         ("shape", r"weight has shape \(4, 4\), the model expects \(2, 3\)")])
def test_load_full_state_dict_of_another_model(pools, kind, match):
    with pytest.raises(RankError, match=match):
        pools(2).run(load_wrong_state_dict, kind)


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-000001")
    with RankPool(2) as pool:
        pool.run(save, path, 4)
    return path


def test_checkpoint_of_another_model(pools, saved):
    with pytest.raises(RankError, match=r"checkpoint \(4, 4\), model \(5, 5\)"):
        pools(2).run(load, saved, 5)


def test_truncated_checkpoint_file(pools, saved, tmp_path):
    import shutil
    copy = tmp_path / "step-000001"
    shutil.copytree(saved, copy)
    shard = copy / "rank1-of-2.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RankError, match="rank1-of-2.pt.*(truncated|bytes)"):
        pools(2).run(load, str(copy), 4)


def test_checkpoint_without_meta_is_incomplete(pools, saved, tmp_path):
    import shutil
    copy = tmp_path / "step-000001"
    shutil.copytree(saved, copy)
    os.remove(copy / "meta.pt")
    with pytest.raises(RankError, match="incomplete: meta.pt is missing"):
        pools(2).run(load, str(copy), 4)


def test_a_torch_save_file_is_not_a_checkpoint(pools, tmp_path):
    torch.save({"model": nn.Linear(4, 4).state_dict(), "iter_num": 3}, tmp_path / "ckpt.pt")
    with pytest.raises(RankError, match="ckpt.pt is a file, not a checkpoint directory: .* "
                                        "loads with torch.load and load_state_dict"):
        pools(2).run(load, str(tmp_path / "ckpt.pt"), 4)


def test_checkpoint_world_size_metadata_mismatch(pools, saved, tmp_path):
    import shutil
    copy = tmp_path / "step-000001"
    shutil.copytree(saved, copy)
    meta = torch.load(copy / "meta.pt", weights_only=True)
    meta["world_size"] = 3
    torch.save(meta, copy / "meta.pt")
    with pytest.raises(RankError, match="world size|world_size|3"):
        pools(2).run(load, str(copy), 4)


def test_dtensor_shards_load_only_as_they_were_cut(pools, tmp_path):
    pools(2).run(save_shards, str(tmp_path), 3)
    assert pools(2).run(load_shards, str(tmp_path), 1) == [0.0, 0.0]  # stage 1 cuts as 3 does
    for world, stage, held in ((2, 0, r"a whole tensor of shape \(6, 4\) \(stage 0\)"),
                               (3, 3, r"a DTensor of shape \(6, 4\) cut over ranks \[0, 1, 2\]")):
        for message in pools(world).run(load_shards, str(tmp_path), stage):  # every rank says it
            assert re.search(r"'module.0.weight' holds a DTensor of shape \(6, 4\) cut over "
                             r"ranks \[0, 1\] \(S\(0\)\), but this model holds it as " + held,
                             message), message
            assert "minishard.save_checkpoint" in message and "full_state_dict()" in message


@pytest.mark.parametrize("stage", [0, 3])
def test_a_full_tensor_of_another_shape_is_refused_like_torch_refuses_it(pools, stage):
    with pytest.raises(RuntimeError, match="size mismatch"):  # the oracle: plain torch
        plain = two_linears(0, None)
        plain.load_state_dict({**plain.state_dict(),
                               "0.weight": plain.state_dict()["0.weight"].reshape(4, 6)})
    for from_rank0 in (False, True):
        for message in pools(2).run(load_transposed, stage, from_rank0):
            assert message and "0.weight has shape (4, 6), the model expects (6, 4)" in message


def save_in_torch_order(tmp):
    model = minishard.ZeRO(nn.Linear(3, 3), stage=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for call in (lambda: minishard.save_checkpoint(model, tmp, opt),
                 lambda: minishard.load_checkpoint(model, tmp, opt)):
        try:
            call()
        except TypeError as exc:
            out.append(str(exc))
    return out


def test_the_path_comes_first_and_the_error_says_so(pools, tmp_path):
    for said in pools(2).run(save_in_torch_order, str(tmp_path)):
        assert len(said) == 2 and "save_checkpoint(path, model, optimizer)" in said[0] \
            and "load_checkpoint(path, model, optimizer)" in said[1], said
    assert not os.listdir(tmp_path)  # nothing written


# ---------------------------------------------------------------------- harness and debug
def test_rankpool_refuses_unpicklable_function(pools):
    with pytest.raises(TypeError, match="pass a module-level function"):
        pools(1).run(lambda: None)


def test_debug_mode_names_both_sides_of_a_mismatch(pools):
    with pytest.raises(RankError, match=r"DIFFERENT collectives:\n  rank 0: all_reduce shape=\(3,\) "
                                        r"float32 from layer0\n  rank 1: all_reduce shape=\(4,\)"):
        pools(2).run(debug_mismatched_shapes)


def test_debug_mode_turns_a_skipped_syncbn_into_an_error(pools):
    with pytest.raises(RankError, match=r"(?s)rank \d raised: .*DIFFERENT collectives:.*"
                                        r"SyncBatchNorm\(4\) forward.*SyncBatchNorm\(5\) forward"):
        pools(2).run(debug_rank_skips_syncbn)


def test_debug_mode_catches_units_run_in_a_different_order(pools):
    with pytest.raises(RankError, match=r"(?s)DIFFERENT collectives:.*rank 0: all_gather .* from a/"
                                        r".*rank 1: all_gather .* from b/"):
        pools(2).run(debug_units_in_rank_dependent_order)
