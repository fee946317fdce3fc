"""A shard knows whose it is: one rank's rows never load silently on another rank.

At stages 1-3 ``model.module.state_dict()`` and ``optimizer.state_dict()`` hold DTensors of this
rank's rows (as under FSDP2). DDP's habit, ``if rank == 0: torch.save(...)`` then every rank
loads that file, would hand every rank rank 0's rows: with rows that split evenly nothing in the
shapes says so. Each rank must raise (together: one rank alone would leave the others waiting
in a collective), naming what to do; each rank loading its own file loads exactly (the oracle:
the run that was never interrupted); a replica of rank 0 (a 2-D mesh) holds rank 0's rows, so
rank 0's file is its own.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard

WHAT_TO_DO = ("full_state_dict", "save_checkpoint")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def step(model, opt, i):
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(i))[2 * r:2 * r + 2]
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def detached(sd: dict) -> dict:
    """A snapshot of a state dict the way users copy one: ``.detach().clone()`` of each tensor
    (of each optimizer state too): new DTensors, their shards' mark lost."""
    copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    if "state" in sd:
        return {"state": {i: {k: copy(v) for k, v in st.items()} for i, st in sd["state"].items()},
                "param_groups": sd["param_groups"]}
    return {k: copy(v) for k, v in sd.items()}


def save_then_load(stage, folder, whose, part, mesh_shape=None, snapshot=False):
    """Two steps, each rank saves its state dicts (``snapshot``: copies, :func:`detached`), one
    more step (the uninterrupted run), then a fresh model and optimizer load the file of rank
    ``whose(rank)`` (``part``: the model's, the optimizer's, both, or one submodule's alone)
    and take the same step. Returns ("loaded", error vs the uninterrupted run) or ("refused",
    the message)."""
    r = dist.get_rank()
    mesh = None
    if mesh_shape:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))

    def make():
        model = minishard.ZeRO(net(), stage=stage, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = make()
    step(model, opt, 0), step(model, opt, 1)
    copy = detached if snapshot else (lambda sd: sd)
    torch.save({"model": copy(model.module.state_dict()), "optim": copy(opt.state_dict())},
               os.path.join(folder, f"rank{r}.pt"))
    dist.barrier()
    step(model, opt, 2)
    want = model.full_state_dict()
    twin, twin_opt = make()
    saved = torch.load(os.path.join(folder, f"rank{whose(r)}.pt"), weights_only=False)
    try:
        if part in ("model", "both"):
            twin.module.load_state_dict(saved["model"])
        elif part == "submodule":  # the first Linear alone: its own load, its own verdict
            twin.module[0].load_state_dict({k[2:]: v for k, v in saved["model"].items()
                                            if k.startswith("0.")})
        else:
            twin.load_full_state_dict(model_state_before(saved, model))
        if part in ("optim", "both"):
            twin_opt.load_state_dict(saved["optim"])
        step(twin, twin_opt, 2)
    except RuntimeError as exc:
        return "refused", str(exc)
    got = twin.full_state_dict()
    return "loaded", max((got[k] - v).abs().max().item() for k, v in want.items())


def model_state_before(saved, model):
    """The full values of a rank's saved model state dict (DTensors gathered): the part of a
    test that loads only the optimizer from the wrong file keeps the model right."""
    return {k: v.full_tensor() for k, v in saved["model"].items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])  # 3: rows that do not split evenly
def test_rank0s_file_loaded_on_every_rank_raises_on_every_rank(pools, tmp_path, stage, world):
    for part, snapshot in (("model", False), ("optim", False), ("both", False),
                           ("submodule", False), ("model", True), ("optim", True)):
        folder = tmp_path / f"{part}{snapshot}"
        folder.mkdir()
        results = pools(world).run(save_then_load, stage, str(folder), _rank0, part, None,
                                   snapshot)
        for kind, said in results:
            assert kind == "refused", (part, results)
            assert all(way in said for way in WHAT_TO_DO) or "another rank" in said, said
        assert any("rows" in said and all(way in said for way in WHAT_TO_DO)
                   for _, said in results), (part, snapshot, results)


def _rank0(rank):
    return 0


def _own(rank):
    return rank


@pytest.mark.parametrize("stage", [1, 3])
def test_each_rank_loading_its_own_file_loads_exactly(pools, tmp_path, stage):
    for snapshot in (False, True):  # a snapshot's bytes tell whose rows they are: its own
        folder = tmp_path / f"{snapshot}"
        folder.mkdir()
        for kind, error in pools(3).run(save_then_load, stage, str(folder), _own, "both", None,
                                        snapshot):
            assert kind == "loaded" and error < 1e-6, (snapshot, kind, error)


def _first_replica(rank):
    return rank % 2  # mesh (2, 2): ranks 0, 1 shard the first replica; 2, 3 hold the same rows


def test_a_replica_loads_the_file_of_the_rank_whose_rows_it_holds(pools, tmp_path):
    for kind, error in pools(4).run(save_then_load, 2, str(tmp_path), _first_replica, "both",
                                    (2, 2)):
        assert kind == "loaded" and error < 1e-6, (kind, error)


def alike_on_rank0_then_load_rank0s(stage, folder):
    """Rank 0's rows of every parameter all zeros, the others' not (torch.chunk's rows, as a
    DTensor's Shard(0)): bytes cannot tell whose zeros they are, only the shard's mark can.
    Each rank saves ``model.module.state_dict()``; a fresh model loads rank 0's file."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = minishard.ZeRO(net(), stage=stage)
    full = model.full_state_dict()
    for value in full.values():
        value[:-(-value.shape[0] // n)] = 0
    model.load_full_state_dict(full)
    torch.save(model.module.state_dict(), os.path.join(folder, f"rank{r}.pt"))
    dist.barrier()
    twin = minishard.ZeRO(net(), stage=stage)
    try:
        twin.module.load_state_dict(torch.load(os.path.join(folder, "rank0.pt"),
                                               weights_only=False))
    except RuntimeError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize("stage", [1, 3])
def test_rows_whose_bytes_cannot_tell_are_refused_by_their_mark(pools, tmp_path, stage):
    said = pools(2).run(alike_on_rank0_then_load_rank0s, stage, str(tmp_path))
    assert "loaded" not in said, said
    assert any("rows 0:" in s and all(way in s for way in WHAT_TO_DO) for s in said), said
