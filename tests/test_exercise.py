"""The exercise checker (``python -m minishard.exercise``) passes minishard's own code and fails
known-wrong versions, each at the example and with the hint a learner needs.

The reference solutions below are thin adapters over the library (SyncBatchNormFunction.backward,
FlatBuffer, flat.reduce_grads, ZeRO.clip_grad_norm_) or, for the ring, the algorithm of tutorial
01 with tensor_split; the known-wrong ones are the classic mistakes: SUM instead of AVG, a
missing 1/n term, local sums not all-reduced, a shard layout that cuts the concatenation of the
parameters (FSDP1's, the old one) or floors the rows per chunk, clipping without min(1, .);
and four that get the numbers right where the checker used to look (2 and 3 ranks, integer
inputs, numbers only) and break the contract: a shard layout and a slicing bug that show only
at 4 ranks, a SyncBN backward with two all-reduces, a ring whose ranks end with different bits.
Functions are module-level: the ranks import them by reference.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import minishard
from minishard import comm
from minishard.course.exercise import EXERCISES, STUBS, check, main
from minishard.zero.flat import FlatBuffer, FlatMode, reduce_grads
from minishard.zero.flat import Layout
from torch.distributed.tensor import DTensor
from minishard.syncbn import SyncBatchNormFunction

WORLDS = (2, 3, 4)
FEW = 12  # examples per world size in these tests (the CLI runs 30)


# ------------------------------------------------------------------- reference solutions
def ring_reference(tensor, rank, world, send_recv, *, copy=torch.Tensor.copy_):
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
                copy(chunks[in_i], incoming)


def syncbn_reference(dy, x, mean, invstd, weight, n, all_reduce):
    """minishard's SyncBatchNormFunction.backward, given what its forward saves (here with the
    shift x0 = 0, so c0 = mean - x0 = mean): the code every training step runs."""
    ctx = types.SimpleNamespace(
        saved_tensors=(x, weight, torch.zeros_like(mean), mean, invstd), n=n, group=None,
        tag="exercise", suffix="", bias_dtype=weight.dtype, needs_input_grad=(True,) * 3)
    return SyncBatchNormFunction.backward(ctx, dy)[:3]


def layout_reference(shapes, world, rank):
    """The engine's own layout (zero/flat.py: Layout), for this rank of ``world``."""
    layout = Layout([torch.Size(s) for s in shapes], world, rank)
    return layout.owned_rows, layout.widths, layout.shard_numel


def reduce_reference(full_grad, numel, world, rank, reduce_scatter):
    """flat.reduce_grads, the reduction stages 2 and 3 run in backward, into the user
    parameter's .grad (this rank's rows of it)."""
    param = nn.Parameter(torch.zeros(numel, dtype=full_grad.dtype))
    flat = FlatBuffer([param], mode=FlatMode.VIEW)
    flat.adopt([param])
    flat.full.grad = full_grad.clone()
    reduce_grads([flat]).wait()
    return param.grad


class _Leaf(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n, dtype=torch.float64))


def clip_reference(grads, max_norm, all_reduce):
    """ZeRO.clip_grad_norm_ on an engine whose shard gradients are these."""
    numels = [_full_numel(g, i) for i, g in enumerate(grads)]
    model = minishard.ZeRO(nn.ModuleList([_Leaf(n) for n in numels]), stage=2, units={_Leaf})
    shards = list(model.parameters())  # the user parameters: DTensors of this rank's rows
    for shard, g in zip(shards, grads):
        shard.grad = DTensor.from_local(g.clone(), shard.device_mesh, shard.placements,
                                        run_check=False, shape=shard.shape, stride=shard.stride())
    total = model.clip_grad_norm_(max_norm)
    for shard, g in zip(shards, grads):
        g.copy_(shard.grad.to_local())
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


def ring_gather_adds_difference(tensor, rank, world, send_recv):
    """The ring's schedule and bytes, but the gather phase ADDS (received - mine) instead of
    copying: the same in exact arithmetic, not in floats: ranks end with different last bits."""
    ring_reference(tensor, rank, world, send_recv,
                   copy=lambda chunk, incoming: chunk.add_(incoming - chunk))


def ring_without_gather_phase(tensor, rank, world, send_recv):
    chunks = tensor.tensor_split(world)
    for s in range(world - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % world])
        send_recv(chunks[(rank - s) % world], (rank + 1) % world, incoming, (rank - 1) % world)
        chunks[(rank - s - 1) % world].add_(incoming)


def _bn(dy, x, mean, invstd, weight, n, all_reduce, *, reduce=True, b_over_n=True,
        one_call=True):
    C = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, C] + [1] * (x.dim() - 2)
    xhat = (x - mean.view(shape)) * invstd.view(shape)
    local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
    sums = local.clone()
    if reduce and one_call:
        all_reduce(sums)
    elif reduce:  # Σdy, then Σdy·x̂: the same sums in two collectives
        all_reduce(sums[:C])
        all_reduce(sums[C:])
    A, B = sums[:C].view(shape), sums[C:].view(shape)
    k = (weight * invstd).view(shape)
    dx = k * (dy - A / n - xhat * (B / n if b_over_n else B))
    return dx, local[C:], local[:C]


def syncbn_missing_1_over_n(dy, x, mean, invstd, weight, n, all_reduce):
    return _bn(dy, x, mean, invstd, weight, n, all_reduce, b_over_n=False)


def syncbn_local_sums(dy, x, mean, invstd, weight, n, all_reduce):
    return _bn(dy, x, mean, invstd, weight, n, all_reduce, reduce=False)


def syncbn_two_all_reduces(dy, x, mean, invstd, weight, n, all_reduce):
    return _bn(dy, x, mean, invstd, weight, n, all_reduce, one_call=False)


def syncbn_written_out(dy, x, mean, invstd, weight, n, all_reduce):
    """The formula written out plainly (a learner's correct answer, not minishard's code)."""
    return _bn(dy, x, mean, invstd, weight, n, all_reduce)


def _rows_and_row_numels(shapes):
    return [s[0] if len(s) else 1 for s in shapes], [math.prod(s[1:]) for s in shapes]


def layout_written_out(shapes, world, rank, *, c_of=lambda r, n: -(-r // n), rows_of=None):
    """A learner's plain answer (ceil, clamped ranges), with knobs for the classic mistakes."""
    n_rows, row_numels = _rows_and_row_numels(shapes)
    cs = [c_of(r, world) for r in n_rows]
    rows = [(rows_of or _clamped)(r, c, rank) for r, c in zip(n_rows, cs)]
    widths = [c * m for c, m in zip(cs, row_numels)]
    return rows, widths, sum(widths)


def _clamped(n_rows, c, rank):
    return min(rank * c, n_rows), min((rank + 1) * c, n_rows)


def layout_floor_division(shapes, world, rank):
    """floor(R/N) rows a chunk: the last rows belong to nobody."""
    return layout_written_out(shapes, world, rank, c_of=lambda r, n: r // n)


def layout_cuts_concatenation(shapes, world, rank):
    """The OLD layout (FSDP1): the concatenation padded at its end and cut into N pieces of
    ceil(total/N) elements; each parameter's part of this rank's piece given in elements, the
    padding counted with the last. (Right for one 1-D parameter: there both layouts agree.)"""
    numels = [math.prod(s) for s in shapes]
    k = -(-sum(numels) // world)
    lo, rows, widths, start = rank * k, [], [], 0
    for n in numels:
        a, b = min(max(lo - start, 0), n), min(max(lo + k - start, 0), n)
        rows.append((a, b))
        widths.append(b - a)
        start += n
    widths[-1] += k - sum(widths)
    return rows, widths, k


def layout_unpadded_widths(shapes, world, rank):
    """Widths of the rows a rank holds, not padded to c rows (its k then differs by rank)."""
    rows, _, _ = layout_written_out(shapes, world, rank)
    widths = [(hi - lo) * m for (lo, hi), m in zip(rows, _rows_and_row_numels(shapes)[1])]
    return rows, widths, sum(widths)


def layout_zero_dim_as_empty(shapes, world, rank):
    """A 0-dim parameter taken as holding nothing: no rows, width 0."""
    rows, widths, _ = layout_written_out(shapes, world, rank)
    for j, s in enumerate(shapes):
        if len(s) == 0:
            rows[j], widths[j] = (0, 0), 0
    return rows, widths, sum(widths)


def layout_plus_one_rows(shapes, world, rank):
    """c = R // N + 1: right unless N divides R."""
    return layout_written_out(shapes, world, rank, c_of=lambda r, n: r // n + 1)


def layout_start_not_clamped(shapes, world, rank):
    """Clamps the end of a rank's rows but not the start: (r·c, R) past the last row."""
    return layout_written_out(shapes, world, rank,
                              rows_of=lambda r, c, rank: (rank * c, min((rank + 1) * c, r)))


def layout_remainder_on_partial_chunk(shapes, world, rank):
    """A chunk that is not full gets R % c rows: right for the chunk holding the last row, wrong
    for a rank past it, which first happens at 4 ranks (R = 5: c = 2, rank 3 gets (5, 6), 5 % 2
    = 1 row, not none)."""
    def rows_of(r, c, rank):
        lo = min(rank * c, r)
        return lo, lo + (c if (rank + 1) * c <= r else r % c)
    return layout_written_out(shapes, world, rank, rows_of=rows_of)


def reduce_slice_not_clamped(full_grad, numel, world, rank, reduce_scatter):
    """Slices the shard at numel - rank·k without clamping at 0: a negative end counts from the
    end. At 2 and 3 ranks the negative cases leave an empty piece anyway; at 4 (numel 5: k = 2,
    rank 3) it keeps an element of padding."""
    k = full_grad.numel() // world
    out = torch.empty(k, dtype=full_grad.dtype)
    reduce_scatter(out, full_grad)
    return (out / world)[:numel - rank * k]


def reduce_sum_not_avg(full_grad, numel, world, rank, reduce_scatter):
    k = full_grad.numel() // world
    out = torch.empty(k, dtype=full_grad.dtype)
    reduce_scatter(out, full_grad)
    return out[:max(0, min(k, numel - rank * k))]


def reduce_in_float32(full_grad, numel, world, rank, reduce_scatter):
    """Right values, returned in float32: the checker crashed on it ("Float did not match
    Double") instead of naming the dtype."""
    return (reduce_sum_not_avg(full_grad, numel, world, rank, reduce_scatter) / world).float()


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


def syncbn_dx_only(dy, x, mean, invstd, weight, n, all_reduce):
    """Returns dx alone: the checker must say what to return, not crash unpacking it."""
    return _bn(dy, x, mean, invstd, weight, n, all_reduce)[0]


def syncbn_in_float32(dy, x, mean, invstd, weight, n, all_reduce):
    return tuple(t.float() for t in _bn(dy, x, mean, invstd, weight, n, all_reduce))


def reduce_returns_a_list(full_grad, numel, world, rank, reduce_scatter):
    return (reduce_sum_not_avg(full_grad, numel, world, rank, reduce_scatter) / world).tolist()


def clip_returns_two_numbers(grads, max_norm, all_reduce):
    """Right clipping, but the norm returned twice: the checker must not crash on float()."""
    total = clip_reference(grads, max_norm, all_reduce)
    return torch.stack([torch.as_tensor(total)] * 2)


def ring_raises(tensor, rank, world, send_recv):
    """A learner's own exception, on every rank before any send: reported, with its traceback."""
    raise ValueError(f"my ring went wrong at {world} ranks")


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
    assert check("shard_layout", layout_written_out, pools, WORLDS, FEW) is None


@pytest.mark.parametrize("name, wrong, what, hint", [
    ("ring_all_reduce", ring_sends_everything, "same bits on every rank", "each chunk ONCE"),
    ("ring_all_reduce", ring_without_gather_phase, "the sum over ranks", "exactly once"),
    ("syncbn_backward", syncbn_missing_1_over_n, "dx", "x̂·B/n"),
    ("syncbn_backward", syncbn_local_sums, "dx", "summed over ALL ranks"),
    ("shard_layout", layout_floor_division, "(rows, widths, k)", "floor(R/N)"),
    ("shard_layout", layout_cuts_concatenation, "(rows, widths, k)", "CONCATENATION"),
    ("shard_layout", layout_start_not_clamped, "(rows, widths, k)", "NO rows"),
    ("shard_layout", layout_unpadded_widths, "(rows, widths, k)", "rows this rank HOLDS"),
    ("shard_layout", layout_zero_dim_as_empty, "(rows, widths, k)", "0-dim parameter"),
    ("shard_layout", layout_plus_one_rows, "(rows, widths, k)", "N divides R"),
    ("reduce_gradient", reduce_sum_not_avg, "averaged gradient", "SUM over ranks"),
    ("reduce_gradient", reduce_keeps_padding, "averaged gradient", "REAL elements"),
    ("reduce_gradient", reduce_in_float32, "averaged gradient", "keep its dtype"),
    ("clip_grad_norm", clip_without_min, "after clipping", "never scales UP"),
    ("clip_grad_norm", clip_local_norm, "total norm", "all_reduce that sum"),
    ("shard_layout", layout_remainder_on_partial_chunk, "(rows, widths, k)", "NO rows"),
    ("reduce_gradient", reduce_slice_not_clamped, "averaged gradient", "REAL elements"),
    ("syncbn_backward", syncbn_two_all_reduces, "collectives in your backward", "ONE all_reduce"),
    ("ring_all_reduce", ring_gather_adds_difference, "same bits on every rank", "each chunk ONCE"),
    ("syncbn_backward", syncbn_dx_only, "what you returned", "(dx, dweight, dbias)"),
    ("syncbn_backward", syncbn_in_float32, "dx", "keep its dtype"),
    ("reduce_gradient", reduce_returns_a_list, "averaged gradient", "not a list"),
    ("clip_grad_norm", clip_returns_two_numbers, "total norm", "ONE number"),
    ("ring_all_reduce", ring_raises, "your function", "your function raised"),
])
def test_checker_fails_known_wrong_versions(pools, name, wrong, what, hint):
    failure = check(name, wrong, pools, WORLDS, FEW)
    assert failure is not None, f"{wrong.__name__} passed"
    text = str(failure)
    assert what in failure.what and hint in failure.hint, text
    assert failure.rank >= 0 and failure.expected != failure.got, text
    assert "inputs:" in text and "expected:" in text and "got:" in text
    if name != "shard_layout":  # every rank's own inputs, not only the failing rank's
        assert all(f"rank {r}: " in failure.inputs for r in range(failure.world)), text


@pytest.mark.parametrize("name, wrong", [("shard_layout", layout_remainder_on_partial_chunk),
                                         ("reduce_gradient", reduce_slice_not_clamped)])
def test_some_bugs_need_four_ranks(pools, name, wrong):
    """These two pass every example at 2 and 3 ranks (the old default) and fail at 4: the first
    world size where several ranks can hold only padding."""
    assert check(name, wrong, pools, (2, 3), FEW) is None
    failure = check(name, wrong, pools, (4,), FEW)
    assert failure is not None and failure.world == 4, failure


@pytest.mark.parametrize("name, wrong, contract", [
    ("syncbn_backward", syncbn_two_all_reduces, "collectives in your backward"),
    ("ring_all_reduce", ring_gather_adds_difference, "same bits on every rank")])
def test_the_contract_catches_what_the_numbers_do_not(pools, name, wrong, contract):
    """The contract is checked after the numbers (per rank, then across ranks): failing it means
    every number of that example was within the oracle's tolerance, and every earlier example
    passed whole. Only the contract (one collective; the same bits on every rank) rejects
    these."""
    failure = check(name, wrong, pools, WORLDS, FEW)
    assert failure is not None and contract in failure.what, failure


def test_hints_come_in_steps(pools):
    """What is wrong first; the schedule only after a second failure."""
    first = check("ring_all_reduce", ring_without_gather_phase, pools, (2,), FEW)
    second = check("ring_all_reduce", ring_without_gather_phase, pools, (2,), FEW, hint_level=1)
    schedule = "(rank - s - 1) % N"
    assert first.what == second.what and "chunk" in first.hint, first
    assert schedule not in first.hint and "hint 1 of 2" in first.hint, first.hint
    assert schedule in second.hint and "hint" not in second.hint.split(schedule)[1], second.hint


def test_stubs_report_not_implemented(pools):
    failure = check("shard_layout", f"{STUBS / 'shard_layout.py'}:shard_layout", pools, (2,), 1)
    assert failure is not None and failure.got == "NotImplementedError"
    assert "fill in" in failure.hint


def test_every_hint_says_how_on_a_second_failure(pools):
    """The exercises' README promises that the next failure says how: a hint that is one string
    (here the stub's NotImplementedError) gets the exercise's recipe as its second step."""
    stub = f"{STUBS / 'shard_layout.py'}:shard_layout"
    first, second = (check("shard_layout", stub, pools, (2,), 1, hint_level=level)
                     for level in (0, 1))
    assert "fill in" in first.hint and "hint 1 of 2" in first.hint and "How:" not in first.hint
    assert second.hint.startswith("fill in") and "How: for each parameter: R = " in second.hint
    assert "hint" not in second.hint.split("How:")[1], second.hint


def test_a_learner_exception_is_reported_not_raised(pools):
    failure = check("shard_layout", _raises, pools, (2,), 1)
    assert failure is not None and "ZeroDivisionError" in failure.got


def _raises(shapes, world, rank):
    return 1 // 0


def checks_that_crash():
    """On a rank: an exercise whose own checks raise on what the solution returned (a safety net
    no real exercise should need): reported as a failure, never raised."""
    from minishard.course import exercise
    from minishard.course.oracles import EXERCISES, Exercise
    EXERCISES["_crashing"] = Exercise("_crashing", "", lambda rng, w, i: {},
                                      lambda fn, case, r, w: (fn() + 1, None),
                                      lambda case, r, w: "")
    try:
        return exercise._on_rank("_crashing", lambda: "text", {})[0]
    finally:
        del EXERCISES["_crashing"]


def test_checks_that_cannot_use_an_output_report_it(pools):
    for what, expected, got, hint in pools(2).run(checks_that_crash):
        assert what == "what your function returned" and "TypeError" in got, got
        assert "docstring" in hint


def test_cli_list_hint_steps_and_a_passing_file(tmp_path, capsys):
    """The CLI counts failures per exercise in its attempts file: the second failure shows the
    next step of the hint, a pass starts the count again."""
    assert main(["--list"]) == 0
    assert "syncbn_backward" in capsys.readouterr().out
    answer = tmp_path / "mine.py"
    state = tmp_path / "attempts.json"

    def run(real: str) -> subprocess.CompletedProcess:
        answer.write_text("def shard_layout(shapes, world, rank):\n"
                          "    rows, widths = [], []\n"
                          "    for s in shapes:\n"
                          "        R, m = s[0], 1\n"
                          "        for d in s[1:]:\n"
                          "            m *= d\n"
                          "        c = -(-R // world)\n"
                          f"        rows.append({real})\n"
                          "        widths.append(c * m)\n"
                          "    return rows, widths, sum(widths)\n")
        return subprocess.run([sys.executable, "-m", "minishard.exercise", "shard_layout",
                               str(answer), "--ranks", "2", "--examples", "5"],
                              capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1],
                              env={**os.environ, "MINISHARD_EXERCISE_STATE": str(state)})
    wrong = "(rank * c, (rank + 1) * c)"  # not clamped: wrong for a last chunk with padding
    first, second = run(wrong), run(wrong)
    assert first.returncode == second.returncode == 1, first.stdout + second.stdout
    how = "[min(r·c, R), min((r+1)·c, R))"
    assert "hint 1 of 2" in first.stdout and how not in first.stdout, first.stdout
    assert how in second.stdout, second.stdout
    proc = run("(min(rank * c, R), min((rank + 1) * c, R))")
    assert proc.returncode == 0 and "PASSED shard_layout" in proc.stdout, proc.stdout + proc.stderr
    assert "hint 1 of 2" in run(wrong).stdout  # the pass started the count again
