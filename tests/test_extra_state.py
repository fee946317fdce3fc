"""``save_checkpoint(..., extra={...})``: the training loop's own state (nanoGPT's ``iter_num`` and
``best_val_loss``, every rank's RNG state) saved beside the model and returned to each rank by
``load_checkpoint``, in both formats, at any world size, on a 2-D mesh.

The oracle is what each rank passed: a value built from its rank alone (``passed(r)``), and the
random numbers that rank drew right after seeding, which the restored RNG state must draw again.
"""
import os
import shutil
import uuid

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

from minishard.checkpoint.files import check_checkpoint, latest_checkpoint
from minishard.checkpoint.state import CheckpointError, load_checkpoint, save_checkpoint
from minishard.testing import RankError
from test_hybrid import mesh_of
from test_state import make


def passed(r: int) -> dict:
    """What rank r saves: plain values, nested containers, and its RNG state after seeding."""
    torch.manual_seed(100 + r)
    return {"iter_num": 7, "best_val_loss": 1.25 + r, "rank": r, "tags": ["a", ("b", r)],
            "rng": torch.get_rng_state()}


def drawn_after_seeding(r: int) -> torch.Tensor:
    torch.manual_seed(100 + r)
    return torch.rand(5)


def save_with_extra(ckpt, stage, format, give=True, mesh_shape=None):
    model, opt = make(stage, "adam") if mesh_shape is None else make_on_mesh(stage, mesh_shape)
    rank = dist.get_rank()
    save_checkpoint(ckpt, model, opt, extra=passed(rank) if give else None, format=format,
                    overwrite=os.path.exists(ckpt))
    return True


def make_on_mesh(stage, shape):
    from torch import nn
    from minishard import ZeRO
    from test_state import Block, Gate, Net, OPTIMIZERS
    torch.manual_seed(0)
    model = ZeRO(Net().double(), stage=stage, units=(Block, Gate), mesh=mesh_of(shape))
    assert isinstance(model.module, nn.Module)
    return model, OPTIMIZERS["adam"](model.parameters())


def load_extra(ckpt, stage, mesh_shape=None):
    """Load; return this rank's extra (its RNG state replaced by the numbers it draws) and
    every rank's extras."""
    model, opt = make(stage, "adam", seed=5) if mesh_shape is None else \
        make_on_mesh(stage, mesh_shape)
    meta = load_checkpoint(ckpt, model, opt)
    mine = meta["extra"]
    if mine is not None:  # a copy: meta["extras"] holds the same dict
        mine = dict(mine)
        torch.set_rng_state(mine.pop("rng"))
        mine["drawn"] = torch.rand(5)
    return mine, meta["extras"]


def expected(r: int) -> dict:
    out = passed(r)
    del out["rng"]
    return {**out, "drawn": drawn_after_seeding(r)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def fresh(tmp_path):
    return str(tmp_path / uuid.uuid4().hex[:8])


@settings(max_examples=10)
@given(a=st.integers(1, 4), b=st.integers(1, 4), stage_a=st.integers(0, 3),
       stage_b=st.integers(0, 3), format=st.sampled_from(["minishard", "dcp"]))
@example(a=3, b=2, stage_a=3, stage_b=1, format="dcp")
@example(a=2, b=4, stage_a=2, stage_b=3, format="minishard")
def test_each_rank_gets_back_what_it_saved(pools, tmp_path, a, b, stage_a, stage_b, format):
    ckpt = fresh(tmp_path)
    pools(a).run(save_with_extra, ckpt, stage_a, format)
    got = pools(b).run(load_extra, ckpt, stage_b)
    for r, (mine, extras) in enumerate(got):
        assert same(mine, expected(r)) if r < a else mine is None, (r, mine)
        assert len(extras) == a and all(same(e, passed(s)) for s, e in enumerate(extras))


@pytest.mark.parametrize("format", ["minishard", "dcp"])
def test_every_rank_of_a_mesh_gets_its_own(pools, tmp_path, format):
    """Only the first replica writes the model's files; extra.pt still holds all four ranks'."""
    ckpt = fresh(tmp_path)
    pools(4).run(save_with_extra, ckpt, 3, format, mesh_shape=(2, 2))
    got = pools(4).run(load_extra, ckpt, 1, mesh_shape=(2, 2))
    assert all(same(mine, expected(r)) for r, (mine, _) in enumerate(got))


@pytest.mark.parametrize("format", ["minishard", "dcp"])
def test_no_extra_saves_none_and_leaves_no_stale_file(pools, tmp_path, format):
    ckpt = fresh(tmp_path)
    pools(2).run(save_with_extra, ckpt, 2, format)
    assert "extra.pt" in os.listdir(ckpt)
    pools(2).run(save_with_extra, ckpt, 2, format, give=False)  # overwrite, without extra
    assert "extra.pt" not in os.listdir(ckpt)
    assert pools(2).run(load_extra, ckpt, 2) == [(None, None)] * 2


class Opaque:
    """A value torch.load(weights_only=True) refuses to rebuild."""


def save_refused(ckpt):
    model, opt = make(2, "adam")
    extra = {"iter_num": 3, "thing": Opaque() if dist.get_rank() == 1 else 0}
    try:
        save_checkpoint(ckpt, model, opt, extra=extra)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_an_extra_that_cannot_be_read_back_is_refused_on_every_rank(pools, tmp_path):
    ckpt = fresh(tmp_path)
    errors = pools(2).run(save_refused, ckpt, timeout=60)
    assert all(errors), errors
    assert "weights_only" in errors[1] and "another rank" in errors[0]
    assert not os.path.exists(ckpt) or os.listdir(ckpt) == []  # nothing written


def damage(file: str, how: str) -> None:
    """One flipped byte in the middle (same size: only a checksum sees it), the end cut off, or
    the file gone."""
    if how == "delete":
        os.remove(file)
        return
    with open(file, "r+b") as fh:
        if how == "truncate":
            fh.truncate(os.path.getsize(file) - 3)
            return
        fh.seek(os.path.getsize(file) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("format", ["minishard", "dcp"])
def test_a_damaged_extra_file_is_refused(pools, tmp_path, format):
    """A flipped byte in extra.pt: load_checkpoint and check_checkpoint refuse it, in both formats
    (DCP's own metadata records no checksum; minishard's digests beside it cover extra.pt)."""
    ckpt = fresh(tmp_path)
    pools(2).run(save_with_extra, ckpt, 2, format)
    damage(os.path.join(ckpt, "extra.pt"), "flip")
    with pytest.raises(RankError, match="sha256"):
        pools(2).run(load_extra, ckpt, 2)
    with pytest.raises(CheckpointError, match="extra.pt"):
        check_checkpoint(ckpt)


@pytest.mark.parametrize("format", ["minishard", "dcp"])
def test_a_resume_loop_falls_back_past_a_damaged_extra_file(pools, tmp_path, format):
    """latest_checkpoint skips the newest checkpoint when its extra.pt is damaged (sizes are
    checked always, sha256 with checksums=True), so a resume loop picks the one before."""
    saved = tmp_path / uuid.uuid4().hex[:8]
    for step in (1, 2):
        pools(2).run(save_with_extra, str(saved / f"step-{step}"), 2, format)
    assert latest_checkpoint(saved, checksums=True) == str(saved / "step-2")
    for how in ("flip", "truncate", "delete"):
        root = tmp_path / how
        shutil.copytree(saved, root)
        damage(str(root / "step-2" / "extra.pt"), how)
        assert latest_checkpoint(root, checksums=how == "flip") == str(root / "step-1"), how
        with pytest.raises(CheckpointError, match="extra.pt"):
            check_checkpoint(root / "step-2", checksums=how == "flip")
