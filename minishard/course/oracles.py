"""The five exercises of ``python -m minishard.exercise``: how each draws its examples, runs the
learner's function on a rank, and judges it by an INDEPENDENT oracle (stock torch on the global
batch, plain sums and slices, never minishard's own code). The checker that runs them on warm
ranks, prints failures and steps through hints is exercise.py.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["EXERCISES", "Exercise", "show"]



@dataclasses.dataclass(frozen=True)
class Exercise:
    name: str
    summary: str
    cases: Callable[[random.Random, int, int], dict]   # (rng, world, index) -> one example
    # on a rank: ([(what, got, expected, hint[, rtol, atol]), ...], what the ranks must share)
    run: Callable[[Callable, dict, int, int], tuple[list, object]]
    describe: Callable[[dict, int, int], str]  # (example, rank, world) -> that rank's inputs
    # (example, world, every rank's shared values) -> None or (rank, what, expected, got, hint)
    together: Callable[[dict, int, list], tuple | None] = lambda case, world, shared: None


def show(t) -> str:
    """A tensor as its shape, its dtype unless float64 (the exercises'), and first values."""
    if isinstance(t, torch.Tensor):
        flat = t.detach().reshape(-1).tolist()
        body = ", ".join(f"{v:.6g}" for v in flat[:8]) + (", ..." if len(flat) > 8 else "")
        dtype = "" if t.dtype == torch.float64 else f" {str(t.dtype).replace('torch.', '')}"
        return f"tensor{tuple(t.shape)}{dtype} [{body}]"
    return repr(t)


def _same_bits(world: int, values: list, what: str, hint) -> tuple | None:
    """The first rank whose value differs from rank 0's in any bit, as a ``together`` result."""
    for rank in range(1, world):
        a, b = values[0], values[rank]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b)):
            gap = ""
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
                    a.shape == b.shape and a.numel():
                gap = f"  (max |difference| {(a - b).abs().max().item():.3g})"
            return (rank, what, f"rank 0's bits: {show(a)}", f"{show(b)}{gap}", hint)
    return None


def _data(seed: int, rank: int, shape) -> torch.Tensor:
    """Rank ``rank``'s tensor for an example: every rank can make every rank's (the oracles do)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _small_first(rng: random.Random, world: int, index: int, big: int) -> int:
    """A total size: 0, 1, 2, ... 2N+1 in the first examples (every way a tail of ranks can hold
    only padding shows up by 2N+1), then random up to ``big``."""
    return index if index <= 2 * world + 1 else rng.randint(0, big)


def _layout(total: int, world: int, rank: int) -> tuple[int, int, int]:
    """ONE 1-D parameter of ``total`` elements cut into ``world`` pieces, computed the plain way:
    pad with placeholders until every rank's piece has the same length, cut, find ours.
    (padded, start, real). (Several parameters: each is cut on its own, see shard_layout.)"""
    padded = total
    while padded % world:
        padded += 1
    labels = list(range(total)) + [None] * (padded - total)
    piece = len(labels) // world
    mine = labels[rank * piece:(rank + 1) * piece]
    return padded, rank * piece, sum(v is not None for v in mine)


# --------------------------------------------------------------------- 1. ring all-reduce
def _ring_cases(rng: random.Random, world: int, index: int) -> dict:
    numel = rng.choice([world, 2 * world, 3 * world + 1, world - 1, 1, 5]) if index < 8 else \
        rng.randint(0, 12 * world)
    return {"numel": numel, "_seed": rng.randrange(10**6)}


def _ring_input(case, rank):
    return _data(case["_seed"], rank, (case["numel"],))


_RING_SCHEDULE = ("reduce phase, step s: send chunk (rank - s) % N right, receive chunk "
                  "(rank - s - 1) % N from the left and ADD it; gather phase: send chunk "
                  "(rank + 1 - s) % N, receive chunk (rank - s) % N and COPY it. Chunks are views: "
                  "write into them")


def _ring_run(fn, case, rank, world):
    from minishard import comm
    mine = _ring_input(case, rank)
    want = torch.stack([_ring_input(case, r) for r in range(world)]).sum(0)  # in rank order
    sent = [0]

    def send_recv(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> None:
        sent[0] += send.numel() * send.element_size()
        comm.send_recv(send, to, recv, frm)

    tensor = mine.clone()
    with comm.ledger() as led:
        fn(tensor, rank, world, send_recv)
    wrong = [c for c, (g, w) in enumerate(zip(tensor.tensor_split(world), want.tensor_split(world)))
             if g.shape != w.shape or not torch.allclose(g, w, rtol=1e-9, atol=1e-12)] \
        if tensor.shape == want.shape else []
    what_is_wrong = (f"chunks {wrong} of tensor.tensor_split(N) "
                     "hold something else than the sum on this rank: each chunk must collect "
                     "every rank's value exactly once (N-1 adds along the ring), then reach "
                     "every rank (N-1 copies)")
    checks = [("collectives called (use send_recv only)", led.count(), 0,
               "build the ring from send_recv; no all_reduce or other collective"),
              ("the tensor after the call (in place): the sum over ranks", tensor, want,
               (what_is_wrong, what_is_wrong + ". The schedule: " + _RING_SCHEDULE))]
    if case["numel"] % world == 0:
        ring = 2 * (world - 1) * case["numel"] * 8 // world
        checks.append(("bytes this rank sent", sent[0], ring,
                       ("a ring sends one chunk of S/N bytes per step, 2(N-1) steps: "
                        "2(N-1)/N x S in all",
                        "a ring sends one chunk per step, 2(N-1) steps. " + _RING_SCHEDULE)))
    return checks, (tensor, sent[0])


def _ring_together(case, world, shared):
    same = _same_bits(world, [t for t, _ in shared], "the sum: the same bits on every rank",
                      ("ranks ended with sums that differ in the last bits: some chunk was "
                       "summed more than once, in a different order on different ranks. A ring "
                       "sums each chunk ONCE, along the ring, and then COPIES the total to "
                       "every rank, so every rank holds the same bits",
                       "a ring sums each chunk once and copies the total: " + _RING_SCHEDULE))
    if same is not None:
        return same
    total = sum(sent for _, sent in shared)  # whatever the chunk sizes: each chunk N-1 times
    want = 2 * (world - 1) * case["numel"] * 8  # in each phase
    if total != want:
        return (-1, "bytes sent by all ranks together", want, total,
                "every chunk of tensor.tensor_split(N) travels N-1 hops in each phase: "
                "2(N-1) x S bytes over all ranks")
    return None


# --------------------------------------------------------------------- 2. SyncBN backward
def _bn_cases(rng: random.Random, world: int, index: int) -> dict:
    while True:
        counts = [rng.randint(0, 2 if index < 10 else 4) for _ in range(world)]
        if sum(counts) >= 2:
            break
    return {"counts": counts, "channels": rng.randint(1, 3),
            "length": rng.choice([None, 1, 3]), "_seed": rng.randrange(10**6)}


def _bn_inputs(case, rank):
    shape = (case["counts"][rank], case["channels"]) + \
        ((case["length"],) if case["length"] else ())
    x = 3 * _data(case["_seed"], rank, shape) + 1
    dy = _data(case["_seed"] + 1, rank, shape)
    return x, dy


def _bn_describe(case, rank, world):
    x, dy = _bn_inputs(case, rank)
    return f"x={show(x)}, dy={show(dy)}"


def _bn_run(fn, case, rank, world):
    from minishard import comm
    eps, C = 1e-5, case["channels"]
    xs, dys = zip(*[_bn_inputs(case, r) for r in range(world)])
    weight = _data(case["_seed"] + 2, 0, (C,))
    # the oracle: stock batch norm on the global batch, in one process
    X = torch.cat(xs).requires_grad_()
    W, B = weight.clone().requires_grad_(), torch.zeros(C, dtype=torch.float64,
                                                       requires_grad=True)
    y = F.batch_norm(X, None, None, W, B, training=True, eps=eps)
    dx_all, = torch.autograd.grad(y, X, torch.cat(dys), retain_graph=True)
    lo = sum(case["counts"][:rank])
    hi = lo + case["counts"][rank]
    only_mine = torch.zeros_like(y)
    only_mine[lo:hi] = dys[rank]
    dw, db = torch.autograd.grad(y, (W, B), only_mine)   # LOCAL sums, as stock gives them
    dims = [0] + list(range(2, X.dim()))
    mean = X.detach().mean(dims)
    var = X.detach().var(dims, unbiased=False)
    n = X.numel() // C

    def all_reduce(t: torch.Tensor) -> None:
        comm.all_reduce(t, "sum")

    with comm.ledger() as led:
        out = fn(dys[rank].clone(), xs[rank].clone(), mean, torch.rsqrt(var + eps),
                 weight.clone(), n, all_reduce)
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        return [("what you returned", repr(out)[:60], "(dx, dweight, dbias)",
                 "return the three gradients as a tuple: (dx, dweight, dbias)")], None
    dx, dweight, dbias = out
    formula = ("dx = w·invstd·(dy - A/n - x̂·B/n) with A = Σdy, B = Σdy·x̂ summed over ALL "
               "ranks")
    one = ("the point of the exercise is ONE all_reduce per backward: put Σdy and Σdy·x̂ side "
           "by side in one tensor of 2C values (torch.cat) and all_reduce that")
    calls = [(e.op, e.numel) for e in led.entries]
    # the numbers first: a failure of the collectives then means the numbers were right
    return [("dx (this rank's rows)", dx, dx_all[lo:hi], formula),
            ("dweight", dweight, dw, "dweight = Σ dy·x̂ over THIS rank's rows only (DDP or "
             "ZeRO averages parameter gradients later; summing here counts them twice)"),
            ("dbias", dbias, db, "dbias = Σ dy over THIS rank's rows only"),
            ("collectives in your backward (op, elements)", calls, [("all_reduce", 2 * C)],
             one)], None


# ------------------------------------------------------------------------ 3. shard layout
_SMALL_SHAPES = [(), (2,), (3,), (2, 2)]  # what follows dim 0 (a 0-dim parameter: sometimes)


def _layout_cases(rng: random.Random, world: int, index: int) -> dict:
    """One parameter of 1 to 2N+2 rows first (every way the last ranks can hold no rows shows up
    by then), every other one beside a (3, 2); then 1 to 4 parameters of any shape."""
    if index <= 2 * world + 1:
        return {"shapes": [(index + 1,)] + ([(3, 2)] if index % 2 else [])}
    shapes = [() if rng.random() < 0.1 else (rng.randint(1, 3 * world + 1),
                                              *rng.choice(_SMALL_SHAPES))
              for _ in range(rng.randint(1, 4))]
    return {"shapes": shapes}


def _chunk_layout(shape: tuple, world: int, rank: int) -> tuple[tuple[int, int], int]:
    """One parameter's cut, the way FSDP2 makes it: ``torch.chunk`` along dim 0 (a 0-dim
    parameter as one row). Returns (this rank's rows [lo, hi), its padded width in elements).
    torch.chunk gives chunks of ceil(R/N) rows and may give FEWER than N: a rank past the
    last chunk holds no rows, written (R, R)."""
    rows = shape[0] if len(shape) else 1
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    chunks = torch.arange(rows).chunk(world)  # row numbers, cut as FSDP2 cuts the parameter
    mine = chunks[rank] if rank < len(chunks) else chunks[0][:0]
    got = (int(mine[0]), int(mine[-1]) + 1) if len(mine) else (rows, rows)
    return got, len(chunks[0]) * per_row  # every rank's chunk padded to the largest


def _layout_want(shapes, world, rank) -> tuple[list, list, int]:
    cuts = [_chunk_layout(tuple(s), world, rank) for s in shapes]
    widths = [w for _, w in cuts]
    return [r for r, _ in cuts], widths, sum(widths)


def _as_layout(got):
    """The learner's answer as (list of (lo, hi), list of widths, k), or None if malformed."""
    try:
        rows, widths, k = got
        return [(int(lo), int(hi)) for lo, hi in rows], [int(w) for w in widths], int(k)
    except (TypeError, ValueError):
        return None


def _layout_hint(shapes, world, got, want) -> tuple[str, str]:
    """(what is wrong, and how) for a wrong answer, by the first part that differs."""
    (rows, widths, k), (want_rows, want_widths, want_k) = got, want
    numels = [math.prod(s) for s in shapes]
    row_numels = [math.prod(s[1:]) for s in shapes]
    n_rows = [s[0] if len(s) else 1 for s in shapes]
    how = ("With R rows (a 0-dim parameter: one) and c = ceil(R/N), rank r holds rows "
           "[min(r·c, R), min((r+1)·c, R)); its width is c x (elements per row) whatever it "
           "holds; k = the sum of the widths")
    held = [(hi - lo) * m for (lo, hi), m in zip(want_rows, row_numels)]
    plus_one = [(r // world + 1) * m for r, m in zip(n_rows, row_numels)]
    if any(len(s) == 0 and w != want_w for s, w, want_w in zip(shapes, widths, want_widths)):
        what = ("a 0-dim parameter is ONE row of one element (R = 1), not empty: c = ceil(1/N) "
                "= 1, so its width is 1 on every rank, and only rank 0 holds its row")
    elif widths != want_widths and widths == held:
        what = ("a width counts only the rows this rank HOLDS; it must be padded: every rank's "
                "chunk of a parameter is c = ceil(R/N) rows wide, real rows or not, so that "
                "every rank sends the same k")
    elif widths != want_widths and widths == plus_one:
        what = ("c = R//N + 1 is one row too many when N divides R (R = 4, N = 2: 3 rows, not "
                "2): use ceil(R/N) = (R + N - 1) // N")
    elif k != want_k and k == -(-sum(numels) // world):
        what = ("k = ceil(total / N) cuts the CONCATENATION of the parameters into N pieces "
                "(FSDP1's layout); here EACH parameter is cut along dim 0 on its own, and each "
                "is padded to N equal chunks of rows")
    elif widths != want_widths and widths == [r // world * m for r, m in zip(n_rows, row_numels)]:
        what = ("floor(R/N) rows per rank drops rows: N chunks of floor(R/N) cannot hold all "
                "R. Round UP: c = ceil(R/N) rows, the last chunks shorter (padded)")
    elif widths != want_widths:
        what = ("a width is wrong: every rank's chunk of a parameter is padded to the SAME c = "
                "ceil(R/N) rows, so its width is c x (elements per row), real rows or not")
    elif k != want_k:
        what = "k is wrong: this rank's shard is its chunks side by side, the sum of the widths"
    elif any(lo > hi or hi > r for (lo, hi), r in zip(rows, n_rows)):
        what = ("a row range runs past the parameter's R rows: a rank past the last chunk holds "
                "NO rows, (R, R); clamp both ends to R")
    else:
        what = ("a row range is wrong: the chunks are consecutive, c = ceil(R/N) rows each "
                "from row 0; a late rank holds fewer rows, or none (R, R), and with 4 ranks or "
                "more several may hold none")
    return what, what + ". " + how


def _layout_run(fn, case, rank, world):
    shapes = [tuple(s) for s in case["shapes"]]
    want = _layout_want(shapes, world, rank)
    got = fn([tuple(s) for s in shapes], world, rank)
    norm = _as_layout(got)
    if norm is None:
        hint = ("return a tuple (rows, widths, k): a list of (row_start, row_stop) pairs, a "
                "list of ints and an int")
        return [("(rows, widths, k)", got, want, hint)], None
    return [("(rows, widths, k)", norm, want, _layout_hint(shapes, world, norm, want))], None


# ---------------------------------------------------------------------- 4. reduce gradient
def _reduce_cases(rng: random.Random, world: int, index: int) -> dict:
    return {"numel": _small_first(rng, world, index, 20), "_seed": rng.randrange(10**6)}


def _full_grad(case, world, rank):
    """Rank ``rank``'s full flat gradient: the real elements, then zero padding (as the engine
    keeps it)."""
    padded, _, _ = _layout(case["numel"], world, rank)
    return torch.cat([_data(case["_seed"], rank, (case["numel"],)),
                      torch.zeros(padded - case["numel"], dtype=torch.float64)])


def _reduce_run(fn, case, rank, world):
    from minishard import comm
    numel = case["numel"]
    padded, start, real = _layout(numel, world, rank)
    want = torch.stack([_full_grad(case, world, r) for r in range(world)]
                       ).mean(0)[start:start + real]

    def reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> None:
        comm.reduce_scatter(out, full, "sum")

    with comm.ledger() as led:
        got = fn(_full_grad(case, world, rank), numel, world, rank, reduce_scatter)
    hint = "reduce_scatter SUMS: divide by N for the average the optimizer needs"
    right_form = isinstance(got, torch.Tensor) and got.dtype == want.dtype  # else the checker
    if right_form and got.shape == want.shape and real and torch.allclose(got, want * world):
        hint = "this is the SUM over ranks (N x the average): divide by N"  # names type, dtype
    elif right_form and got.shape != want.shape:
        hint = (f"this rank's piece has {real} REAL elements here, you returned "
                f"{got.numel()}",
                f"return only this rank's REAL elements ({real} here): the shard of k = "
                f"{padded // world} minus the padding; a late rank may hold only padding "
                "(0 real; with 4 ranks or more, several may): clamp at 0, a negative slice "
                "end counts from the END")
    calls = [(e.op, e.numel) for e in led.entries]
    return [("collectives (op, elements)", calls, [("reduce_scatter", padded)] if world > 1
             else calls, "one reduce_scatter of the whole padded gradient, nothing else"),
            ("this rank's shard of the averaged gradient", got, want, hint)], None


# ------------------------------------------------------------------------ 5. clip grad norm
def _clip_cases(rng: random.Random, world: int, index: int) -> dict:
    count = rng.randint(1, 3)
    numels = [rng.randint(1, 2 * world if index < 10 else 12) for _ in range(count)]
    # below the norm (clipping acts) or above it (it must not scale anything up)
    return {"numels": numels, "max_norm_factor": rng.choice([0.3, 0.9, 1.5, 4.0]),
            "_seed": rng.randrange(10**6)}


def _clip_inputs(case, world, rank):
    """(every parameter's full gradient, this rank's shards of them)."""
    fulls = [_data(case["_seed"] + i, 0, (n,)) for i, n in enumerate(case["numels"])]
    shards = []
    for g in fulls:
        _, start, real = _layout(g.numel(), world, rank)
        shards.append(g[start:start + real].clone())
    return fulls, shards


def _clip_run(fn, case, rank, world):
    from minishard import comm
    fulls, shards = _clip_inputs(case, world, rank)
    norm = float(torch.cat(fulls).norm())
    max_norm = case["max_norm_factor"] * norm
    clipped = [g.clone() for g in fulls]
    want_norm = float(torch.nn.utils.clip_grad_norm_(_as_params(clipped), max_norm))
    wants = [c[start:start + real] for c, (_, start, real) in
             zip(clipped, (_layout(g.numel(), world, rank) for g in fulls))]

    def all_reduce(t: torch.Tensor, op: str = "sum") -> None:
        comm.all_reduce(t, op)

    total = fn(shards, max_norm, all_reduce)
    one_number = isinstance(total, (int, float)) or (isinstance(total, torch.Tensor)
                                                     and total.numel() == 1)
    total = float(total) if one_number else total
    scaled_up = max_norm > norm and any(
        s.numel() and not torch.allclose(s, w) for s, w in zip(shards, wants))
    hint = ("scale by min(1, max_norm / (total + 1e-6)): clipping never scales UP"
            if scaled_up else "the global norm: sum |g|² over YOUR shards, all_reduce that "
            "sum, then take the square root; every rank then scales its shards by the same "
            "factor")
    if not one_number:
        hint = "return the total norm: ONE number (a float or a one-element tensor)"
    checks = [("the total norm returned", total, want_norm, hint, 1e-6, 1e-12)]  # fp32 is fine
    checks += [(f"gradient shard {i} after clipping (in place)", s, w, hint)
               for i, (s, w) in enumerate(zip(shards, wants))]
    shared = torch.tensor([total], dtype=torch.float64) if isinstance(total, float) else total
    return checks, shared


def _clip_together(case, world, shared):
    return _same_bits(world, shared, "the total norm: the same bits on every rank",
                      "ranks returned norms that differ in the last bits: sum the squares "
                      "with ONE all_reduce, so every rank takes the square root of the same "
                      "number")


def _as_params(tensors):
    params = []
    for t in tensors:
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t  # the same tensor: clipping scales the caller's copy in place
        params.append(p)
    return params


EXERCISES: dict[str, Exercise] = {e.name: e for e in [
    Exercise("ring_all_reduce", "a ring all-reduce (sum) from point-to-point sends",
             _ring_cases, _ring_run,
             lambda case, r, w: f"tensor={show(_ring_input(case, r))}", _ring_together),
    Exercise("syncbn_backward", "SyncBatchNorm backward: dx, dweight, dbias from global sums",
             _bn_cases, _bn_run, _bn_describe),
    Exercise("shard_layout", "each parameter cut along dim 0: this rank's rows, widths and k",
             _layout_cases, _layout_run, lambda case, r, w: ""),
    Exercise("reduce_gradient", "stage 2's reduction: reduce-scatter, average, drop padding",
             _reduce_cases, _reduce_run,
             lambda case, r, w: f"full_grad={show(_full_grad(case, w, r))}"),
    Exercise("clip_grad_norm", "clip by the global norm when each rank holds a shard",
             _clip_cases, _clip_run,
             lambda case, r, w: f"grads={[show(g) for g in _clip_inputs(case, w, r)[1]]}",
             _clip_together),
]}
