"""The exercise checker (``python -m minishard.exercise``) passes minishard's own code and fails
known-wrong versions, each at the example and with the hint a learner needs.

The reference solutions below are thin adapters over the library (SyncBatchNormFunction,
FlatBuffer, flat.reduce_grads, ZeRO.clip_grad_norm_) or, for the ring, the algorithm of tutorial
01 with tensor_split; the known-wrong ones are the classic mistakes: SUM instead of AVG, a
missing 1/n term, local sums not all-reduced, wrong shard offsets, clipping without min(1, .).
Functions are module-level: the ranks import them by reference.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import minishard
from minishard import comm
from minishard.exercise import EXERCISES, STUBS, check, main
from minishard.flat import FlatBuffer, reduce_grads
from minishard.syncbn import SyncBatchNormFunction

WORLDS = (2, 3)
FEW = 12  # examples per world size in these tests (the CLI runs 30)


# ------------------------------------------------------------------- reference solutions
def ring_reference(tensor, rank, world, send_recv):
    """Tutorial 01's ring, with tensor_split so a short tensor still has N chunks."""
    chunks = tensor.tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in ("reduce", "gather"):
        for s in range(world - 1):
            out_i = (rank - s) % world if phase == "reduce" else (rank + 1 - s) % world
            in_i = (rank - s - 1) % world if phase == "reduce" else (rank - s) % world
            incoming = torch.empty_like(chunks[in_i])
            send_recv(chunks[out_i], right, incoming, left)
            if phase == "reduce":
                chunks[in_i].add_(incoming)
            else:
                chunks[in_i].copy_(incoming)


def syncbn_reference(dy, x, mean, invstd, weight, n, all_reduce):
    """minishard's SyncBatchNormFunction: its forward (which all-reduces the statistics itself)
    and its backward, through autograd."""
    x = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = torch.zeros_like(weight, requires_grad=True)
    y = SyncBatchNormFunction.apply(x, w, b, None, None, 1e-5, 0.0, None, "exercise")
    return torch.autograd.grad(y, (x, w, b), dy)


def layout_reference(numels, world, rank):
    """FlatBuffer's own layout (its world and rank are the pool's: the same as given)."""
    flat = FlatBuffer([torch.zeros(n) for n in numels], mode="own")
    assert (flat.world, flat.rank) == (world, rank)
    return flat.padded_numel, flat.shard_start, flat.shard_real


def reduce_reference(full_grad, numel, world, rank, reduce_scatter):
    """flat.reduce_grads, the reduction stages 2 and 3 run in backward."""
    flat = FlatBuffer([torch.zeros(numel, dtype=full_grad.dtype, requires_grad=True)],
                      mode="view")
    flat.full.grad = full_grad.clone()
    reduce_grads([flat]).wait()
    return flat.shard.grad


class _Leaf(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n, dtype=torch.float64))


def clip_reference(grads, max_norm, all_reduce):
    """ZeRO.clip_grad_norm_ on an engine whose shard gradients are these."""
    numels = [_full_numel(g, i) for i, g in enumerate(grads)]
    model = minishard.ZeRO(nn.ModuleList([_Leaf(n) for n in numels]), stage=2, units={_Leaf})
    shards = [f.shard for u in model.units for f in u.flats]
    for shard, g in zip(shards, grads):
        shard.grad = g.clone()
    total = model.clip_grad_norm_(max_norm)
    for shard, g in zip(shards, grads):
        g.copy_(shard.grad)
    return total.double()


def _full_numel(shard_grad, i):
    """Every rank's shard size of parameter i, all-gathered: the full numel."""
    sizes = torch.zeros(comm.group_size(), dtype=torch.int64)
    sizes[comm.group_rank()] = shard_grad.numel()
    comm.all_reduce(sizes, "sum")
    return int(sizes.sum())


# ---------------------------------------------------------------------- known-wrong ones
def ring_sends_everything(tensor, rank, world, send_recv):
    """Right sum, wrong cost: passes the WHOLE tensor around the ring N-1 times."""
    passing = tensor.clone()
    for _ in range(world - 1):
        incoming = torch.empty_like(passing)
        send_recv(passing, (rank + 1) % world, incoming, (rank - 1) % world)
        tensor.add_(incoming)
        passing = incoming


def ring_without_gather_phase(tensor, rank, world, send_recv):
    chunks = tensor.tensor_split(world)
    for s in range(world - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % world])
        send_recv(chunks[(rank - s) % world], (rank + 1) % world, incoming, (rank - 1) % world)
        chunks[(rank - s - 1) % world].add_(incoming)


def _bn(dy, x, mean, invstd, weight, n, all_reduce, *, reduce=True, b_over_n=True):
    C = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, C] + [1] * (x.dim() - 2)
    xhat = (x - mean.view(shape)) * invstd.view(shape)
    local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
    sums = local.clone()
    if reduce:
        all_reduce(sums)
    A, B = sums[:C].view(shape), sums[C:].view(shape)
    k = (weight * invstd).view(shape)
    dx = k * (dy - A / n - xhat * (B / n if b_over_n else B))
    return dx, local[C:], local[:C]


def syncbn_missing_1_over_n(dy, x, mean, invstd, weight, n, all_reduce):
    return _bn(dy, x, mean, invstd, weight, n, all_reduce, b_over_n=False)


def syncbn_local_sums(dy, x, mean, invstd, weight, n, all_reduce):
    return _bn(dy, x, mean, invstd, weight, n, all_reduce, reduce=False)


def syncbn_written_out(dy, x, mean, invstd, weight, n, all_reduce):
    """The formula written out plainly (a learner's correct answer, not minishard's code)."""
    return _bn(dy, x, mean, invstd, weight, n, all_reduce)


def layout_floor_division(numels, world, rank):
    k = sum(numels) // world  # forgets the padding: the last elements belong to nobody
    return k * world, rank * k, k


def layout_wrong_offsets(numels, world, rank):
    total = sum(numels)
    k = -(-total // world)
    start = rank * total // world  # spreads the REAL elements: not where the equal pieces start
    return k * world, start, max(0, min(k, total - start))


def reduce_sum_not_avg(full_grad, numel, world, rank, reduce_scatter):
    k = full_grad.numel() // world
    out = torch.empty(k, dtype=full_grad.dtype)
    reduce_scatter(out, full_grad)
    return out[:max(0, min(k, numel - rank * k))]


def reduce_keeps_padding(full_grad, numel, world, rank, reduce_scatter):
    out = torch.empty(full_grad.numel() // world, dtype=full_grad.dtype)
    reduce_scatter(out, full_grad)
    return out / world


def clip_without_min(grads, max_norm, all_reduce):
    local = sum((g.square().sum() for g in grads), torch.zeros((), dtype=torch.float64))
    total = local.reshape(1).clone()
    all_reduce(total)
    total = total.sqrt()[0]
    for g in grads:
        g.mul_(max_norm / (total + 1e-6))  # scales UP too when the norm is already small
    return total


def clip_local_norm(grads, max_norm, all_reduce):
    total = torch.cat([g.reshape(-1) for g in grads]).norm()  # this rank's shards only
    for g in grads:
        g.mul_(min(1.0, max_norm / (float(total) + 1e-6)))
    return total


# ---------------------------------------------------------------------------------- tests
REFERENCES = {"ring_all_reduce": ring_reference, "syncbn_backward": syncbn_reference,
              "shard_layout": layout_reference, "reduce_gradient": reduce_reference,
              "clip_grad_norm": clip_reference}


def test_every_exercise_has_a_stub_and_a_reference():
    assert set(REFERENCES) == set(EXERCISES)
    for name in EXERCISES:
        stub = (STUBS / f"{name}.py").read_text()
        assert f"def {name}(" in stub and "NotImplementedError" in stub, name


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_checker_passes_minishards_own_code(pools, name):
    assert check(name, REFERENCES[name], pools, WORLDS, FEW) is None


def test_checker_passes_a_plain_written_out_answer(pools):
    assert check("syncbn_backward", syncbn_written_out, pools, WORLDS, FEW) is None


@pytest.mark.parametrize("name, wrong, what, hint", [
    ("ring_all_reduce", ring_sends_everything, "bytes this rank sent", "2(N-1)/N"),
    ("ring_all_reduce", ring_without_gather_phase, "the sum over ranks", "gather phase"),
    ("syncbn_backward", syncbn_missing_1_over_n, "dx", "x̂·B/n"),
    ("syncbn_backward", syncbn_local_sums, "dx", "summed over ALL ranks"),
    ("shard_layout", layout_floor_division, "(padded_numel", "pad the total"),
    ("shard_layout", layout_wrong_offsets, "(padded_numel", "rank r starts at r·k"),
    ("reduce_gradient", reduce_sum_not_avg, "averaged gradient", "SUM over ranks"),
    ("reduce_gradient", reduce_keeps_padding, "averaged gradient", "REAL elements"),
    ("clip_grad_norm", clip_without_min, "after clipping", "never scales UP"),
    ("clip_grad_norm", clip_local_norm, "total norm", "all_reduce that sum"),
])
def test_checker_fails_known_wrong_versions(pools, name, wrong, what, hint):
    failure = check(name, wrong, pools, WORLDS, FEW)
    assert failure is not None, f"{wrong.__name__} passed"
    text = str(failure)
    assert what in failure.what and hint in failure.hint, text
    assert failure.rank >= 0 and failure.expected != failure.got, text
    assert "inputs:" in text and "expected:" in text and "got:" in text


def test_stubs_report_not_implemented(pools):
    failure = check("shard_layout", f"{STUBS / 'shard_layout.py'}:shard_layout", pools, (2,), 1)
    assert failure is not None and failure.got == "NotImplementedError"
    assert "fill in" in failure.hint


def test_a_learner_exception_is_reported_not_raised(pools):
    failure = check("shard_layout", _raises, pools, (2,), 1)
    assert failure is not None and "ZeroDivisionError" in failure.got


def _raises(numels, world, rank):
    return 1 // 0


def test_cli_list_and_a_passing_file(tmp_path, capsys):
    assert main(["--list"]) == 0
    assert "syncbn_backward" in capsys.readouterr().out
    answer = tmp_path / "mine.py"
    answer.write_text("def shard_layout(numels, world, rank):\n"
                      "    total = sum(numels)\n"
                      "    k = -(-total // world)\n"
                      "    return k * world, rank * k, max(0, min(k, total - rank * k))\n")
    proc = subprocess.run([sys.executable, "-m", "minishard.exercise", "shard_layout",
                           str(answer), "--ranks", "2", "--examples", "5"],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and "PASSED shard_layout" in proc.stdout, proc.stdout + proc.stderr
