"""Stamps: ranks that issue different gathers of the same size fail before any number is used.

The case users meet first (issue "Hangs that explain themselves"): nanoGPT evaluates under
``if ... and master_process``. At stage 3 rank 0's evaluation gathers are answered by the other
ranks' training gathers: the first forward matches (the same units in the same order), then the
others' backward gathers the units in reverse while rank 0's next forward gathers from the front.
Equal sizes, so without a stamp rank 0 computes with another unit's parameters and reports a
wrong loss (then hangs). With the stamp every rank raises ``CollectiveMismatch`` naming both
sides, before rank 0 reports any loss. The oracle is the message and where it is raised, plus a
control: the same loop evaluating on EVERY rank runs to the end.

Reductions, when ranks reduce different units of one size (a block frozen on one rank): a
reduce-scatter's stamp is in its messages' tags, so it must wait and time out at that
reduction, and the reductions that met their own must equal the plain model's gradients; an
all-reduce's (stage 0) is bits averaged beside the gradients, so both ranks must raise
``CollectiveMismatch`` at that reduction, before any gradient is delivered.
"""
import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm
from minishard.testing import RankPool
from minishard.zero import config


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def evaluate_on(who: str, stage: int) -> dict:
    """nanoGPT's loop shape: every 2nd iteration an evaluation of 2 batches, on rank 0 only
    (``who="rank 0"``) or on every rank; returns the losses reported and the error, if any."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(3)]), stage=stage,
                           units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reported = []
    try:
        for it in range(4):
            if it % 2 == 0 and (who == "every rank" or rank == 0):
                with torch.no_grad():
                    losses = [model(torch.randn(2, 8)).square().mean().item() for _ in range(2)]
                reported.append(sum(losses) / 2)  # nanoGPT prints it here
            model(torch.randn(2, 8)).square().mean().backward()
            opt.step(), opt.zero_grad()
    except comm.CollectiveMismatch as exc:
        return {"reported": reported, "error": str(exc)}
    return {"reported": reported, "error": None}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank0_only_evaluation_raises_on_every_rank_before_a_loss_is_reported(pools, world):
    outs = pools(world).run(evaluate_on, "rank 0", 3)
    for rank, out in enumerate(outs):
        assert out["error"] is not None, (rank, out)
        assert "DIFFERENT collectives" in out["error"] and "rank 0: all_gather of 0/" in \
            out["error"], out["error"]
    assert outs[0]["reported"] == [], outs[0]  # raised inside the evaluation: nothing reported


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluating_on_every_rank_runs_to_the_end(pools, stage):
    for out in pools(2).run(evaluate_on, "every rank", stage):
        assert out["error"] is None and len(out["reported"]) == 2, out


def test_a_stamp_is_bytes_of_its_description():
    """Equal descriptions give equal bytes, whole elements of any dtype; different ones differ
    in the CRC even past the 28 bytes kept for the message."""
    long = "h.10/float32+" * 4
    for itemsize in (1, 2, 4, 8):
        a = comm.stamp("0/float32", itemsize)
        assert a == comm.stamp("0/float32", itemsize) and len(a) >= comm.STAMP_BYTES
        assert len(a) % itemsize == 0 and a[4:13] == b"0/float32"
        assert comm.stamp(long + "a", itemsize) != comm.stamp(long + "b", itemsize)


def frozen_on_rank_1(stage: int, alone: bool = False) -> dict:
    """Block 1 frozen on rank 1 only: its backward reduces blocks 2 and 0, rank 0's reduces
    2, 1 and 0, all of one size. Every rank has the same input, so a right gradient is the
    plain model's. Returns what each rank's backward raised, and the largest distance of its
    gradients' rows from the plain model's (blocks 0 and 2) if it finished."""
    comm.set_timeout(3)
    bucket = config.BUCKET_BYTES
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(*[Block() for _ in range(3)])
        config.BUCKET_BYTES = 1 if alone else bucket  # alone: each unit reduced by itself
        model = minishard.ZeRO(copy.deepcopy(plain), stage=stage, units={Block})
        x = torch.randn(4, 8)
        plain(x).square().mean().backward()
        if dist.get_rank() == 1:
            model.module[1].requires_grad_(False)
        try:
            model(x).square().mean().backward()
        except (comm.CollectiveError, comm.CollectiveMismatch) as exc:
            return {"error": str(exc), "delivered": [p.grad is not None
                                                    for p in model.parameters()]}
        wrong = 0.0
        for i in (0, 2):
            for p, want in zip(model.module[i].parameters(), plain[i].parameters()):
                if stage == 0:  # the whole gradient
                    wrong = max(wrong, (p.grad - want.grad).abs().max().item())
                    continue
                chunk = p.grad.__create_chunk_list__()[0]  # this rank's rows: where, how many
                rows = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                wrong = max(wrong, (p.grad.to_local() - want.grad[rows]).abs().max().item())
        return {"error": None, "wrong": wrong}
    finally:
        comm.set_timeout(600)
        config.BUCKET_BYTES = bucket


def test_all_reduces_of_different_units_raise_on_every_rank():
    """Stage 0, each unit reduced alone: rank 0's all-reduce of block 1 meets rank 1's of
    block 0. Both raise there, naming their own; no gradient of either block was delivered."""
    with RankPool(2, timeout=60) as pool:  # its own: the ranks part with reductions unmatched
        rank0, rank1 = pool.run(frozen_on_rank_1, 0, True)
    for out, mine in ((rank0, "1"), (rank1, "0")):
        assert "DIFFERENT collectives" in (out["error"] or ""), out
        assert f"all_reduce of {mine}/float32 (model " in out["error"], out
    for out in (rank0, rank1):  # blocks 0 and 1: nothing (block 2's met its own)
        assert out["delivered"][:4] == [False] * 4, out


@pytest.mark.parametrize("stage", [2, 3])  # each unit's reduction alone (stage 1 buckets them)
def test_reductions_of_different_units_are_never_combined(stage):
    with RankPool(2, timeout=60) as pool:  # its own: a timeout leaves gloo's pairs closed
        rank0, rank1 = pool.run(frozen_on_rank_1, stage)
    # rank 0's reduction of block 1 met rank 1's of block 0 (the same size): it must wait and
    # time out there, instead of averaging the two and timing out at its next reduction (of 0)
    assert re.search(r"reduce_scatter of 1/float32 \(model \d+\)( \(from [^)]*\))?: waited 3 s",
                     rank0["error"] or ""), rank0
    assert rank1["error"] is None and rank1["wrong"] < 1e-6, rank1  # 2 and 0 met their own


# ---------------------------------------------------- two models of one architecture, told apart
def model_a_or_b(stage: int, who: str) -> dict:
    """Two models of one architecture wrapped on every rank. ``who="rank 1 runs B"``: rank 0
    trains A while rank 1 trains B (same sizes, same buffer names): every gather or all-reduce
    is stamped with its model, so every rank must raise (stage 2's reduce-scatters wait and time
    out, named). ``who="in turns"``: every rank trains A then B, twice (a legitimate program):
    both must equal one process."""
    comm.set_timeout(3)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        plains, models, opts = [], [], []
        for seed in (0, 1):
            torch.manual_seed(seed)
            plains.append(nn.Sequential(*[Block() for _ in range(3)]))
            models.append(minishard.ZeRO(copy.deepcopy(plains[-1]), stage=stage, units={Block}))
            opts.append(torch.optim.SGD(models[-1].parameters(), lr=0.1))
        x = torch.randn(2 * n, 8, generator=torch.Generator().manual_seed(7))
        order = [0, 1, 0, 1] if who == "in turns" else [rank % 2] * 2
        try:
            for i in order:
                models[i](x[2 * rank:2 * rank + 2]).square().mean().backward()
                opts[i].step(), opts[i].zero_grad()
        except (comm.CollectiveError, comm.CollectiveMismatch) as exc:
            return {"error": str(exc)}
        for i in order:
            plain_opt = torch.optim.SGD(plains[i].parameters(), lr=0.1)
            plains[i](x).square().mean().backward()
            plain_opt.step(), plain_opt.zero_grad()
        wrong = max((models[i].full_state_dict()[k] - v).abs().max().item()
                    for i in (0, 1) for k, v in plains[i].state_dict().items())
        return {"error": None, "wrong": wrong}
    finally:
        comm.set_timeout(600)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_models_of_one_architecture_are_told_apart(stage):
    """Rank 0 running model A while rank 1 runs model B raised nothing before (stage 3: outputs
    0.66 off; stage 0: A's gradient averaged with B's)."""
    with RankPool(2, timeout=60) as pool:  # its own: a timeout leaves gloo's pairs closed
        outs = pool.run(model_a_or_b, stage, "rank 1 runs B")
    for out in outs:
        assert out["error"] is not None, outs
    if stage != 2:
        assert all("DIFFERENT collectives" in out["error"] for out in outs), outs
        assert any("(model 1)" in out["error"] or "(model" in out["error"] for out in outs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_models_trained_in_turns_on_every_rank_run_as_one_process(pools, stage):
    for out in pools(2).run(model_a_or_b, stage, "in turns"):
        assert out["error"] is None and out["wrong"] < 1e-6, out


def frozen_on_one_replica(mesh_shape) -> dict:
    """A 2x2 mesh at stage 2: block 1 frozen on the second replica only (ranks 2, 3). Inside
    each replica the ranks agree; across replicas rank 0's average of block 1 meets rank 2's of
    block 0 (one size): the replicas' all-reduce is stamped, so every rank raises there."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    comm.set_timeout(5)
    try:
        torch.manual_seed(0)
        model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(3)]), stage=2,
                               units={Block}, mesh=mesh)
        if dist.get_rank() >= 2:
            model.module[1].requires_grad_(False)
        try:
            model(torch.randn(4, 8)).square().mean().backward()
        except (comm.CollectiveError, comm.CollectiveMismatch) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    finally:
        comm.set_timeout(600)


def test_the_replicas_average_is_stamped():
    with RankPool(4, timeout=90) as pool:
        outs = pool.run(frozen_on_one_replica, (2, 2))
    assert all(out["error"] and "(replicas)" in out["error"] for out in outs), outs
