"""Exercises that check themselves: write the key pieces yourself, the project's oracles judge them.

    python -m minishard.exercise --list
    python -m minishard.exercise syncbn_backward           # tutorials/exercises/syncbn_backward.py
    python -m minishard.exercise syncbn_backward mine.py   # or any file of yours

Each exercise is a stub in ``tutorials/exercises/NAME.py``: one function, its contract in the
docstring, ``raise NotImplementedError`` for a body. The checker starts warm gloo ranks
(``minishard.testing.RankPool``, 2 and 3 of them: 3 makes the uneven cases), loads your file on
every rank, and runs your function on examples from small to larger. Every example is judged by
an INDEPENDENT oracle computed in one process from every rank's inputs: stock torch on the
global batch, plain sums and slices, never minishard's own code (which is the reference solution:
tests/test_exercise.py shows the checker passes it and fails known-wrong versions). The first
example that fails is printed: its inputs, the rank, what was expected and what your code gave,
and a hint.

    ring_all_reduce     the ring all-reduce from point-to-point sends (tutorial 01)
    syncbn_backward     SyncBatchNorm's backward: one all-reduce of [Σdy, Σdy·x̂] (tutorial 03)
    shard_layout        where a rank's shard sits in a padded flat buffer (flat.py)
    reduce_gradient     stage 2's reduction: reduce-scatter, average, drop the padding (flat.py)
    clip_grad_norm      clipping by the global norm when each rank holds a shard (zero.py)

Your function receives the communication it may use as arguments (``all_reduce``,
``reduce_scatter``, ``send_recv``: thin wrappers over ``minishard.comm``), so it needs no
``torch.distributed`` of its own. Inputs are float64 so that rounding cannot hide a wrong term.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["EXERCISES", "Failure", "check", "main"]

STUBS = Path(__file__).resolve().parents[1] / "tutorials" / "exercises"
WORLDS = (2, 3)
EXAMPLES = 30  # per world size; small ones first


# ------------------------------------------------------------------------------ the framework
@dataclasses.dataclass
class Failure:
    """The first failing example: what was run, on which rank, expected vs got, and a hint."""
    exercise: str
    world: int
    rank: int
    inputs: str
    what: str
    expected: str
    got: str
    hint: str

    def __str__(self) -> str:
        return (f"FAILED {self.exercise} at {self.world} ranks, on rank {self.rank}.\n"
                f"  inputs:   {self.inputs}\n  checking: {self.what}\n"
                f"  expected: {self.expected}\n  got:      {self.got}\n  hint:     {self.hint}")


@dataclasses.dataclass(frozen=True)
class Exercise:
    name: str
    summary: str
    cases: Callable[[random.Random, int, int], dict]   # (rng, world, index) -> one example
    # on a rank: (this rank's inputs, [(what, got, expected, hint[, rtol, atol]), ...])
    run: Callable[[Callable, dict, int, int], tuple[str, list]]


def _short(t) -> str:
    if isinstance(t, torch.Tensor):
        flat = t.detach().reshape(-1).tolist()
        body = ", ".join(f"{v:.6g}" for v in flat[:8]) + (", ..." if len(flat) > 8 else "")
        return f"tensor{tuple(t.shape)} [{body}]"
    return repr(t)


def _differs(got, expected, rtol: float = 1e-9, atol: float = 1e-12) -> bool:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return True
        return not torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol)
    if isinstance(expected, float):
        return not (isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol,
                                                                   abs_tol=atol))
    return got != expected


_loaded: dict[str, Callable] = {}


def _load(solution) -> Callable:
    """A function, or 'path/to/file.py:function' loaded once per rank process."""
    if callable(solution):
        return solution
    if solution not in _loaded:
        path, name = solution.rsplit(":", 1)
        spec = importlib.util.spec_from_file_location(f"_exercise_{len(_loaded)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[solution] = getattr(module, name)
    return _loaded[solution]


def _on_rank(name: str, solution, case: dict):
    """Runs on every rank of the pool: the learner's code on this example, then the checks.
    Returns None, or the first failing check as (what, expected, got, hint)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        fn = _load(solution)
        mine, checks = EXERCISES[name].run(fn, case, rank, world)
    except NotImplementedError:
        return ("", "your function", "an implementation", "NotImplementedError",
                "fill in the body of the stub (its docstring says what it must do)")
    except Exception as exc:  # the learner's bug: show where, not the checker's traceback
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return ("", "your function", "no exception", "".join(lines[-3:]).strip(),
                "read the traceback; every rank must make the same calls in the same order")
    for what, got, expected, hint, *tol in checks:
        if _differs(got, expected, *tol):
            return (mine, what, _short(expected), _short(got), hint)
    return None


def check(name: str, solution, pools: Callable[[int], "object"], worlds=WORLDS,
          examples: int = EXAMPLES, seed: int = 0) -> Failure | None:
    """Run exercise ``name`` against ``solution`` (a module-level function, or
    'file.py:function') on warm ranks ``pools(world)``; None if every example passes."""
    exercise = EXERCISES[name]
    for world in worlds:
        pool = pools(world)
        for index in range(examples):
            case = exercise.cases(random.Random(seed * 7919 + index), world, index)
            try:
                results = pool.run(_on_rank, name, solution, case)
            except TimeoutError:
                return Failure(name, world, -1, _describe(case), "every rank finishing",
                               "all ranks return", "some ranks never returned",
                               "a rank waited in a collective another rank never called: "
                               "every rank must call the same communication, in the same order")
            for rank, result in enumerate(results):
                if result is not None:
                    mine, *rest = result
                    inputs = _describe(case) + (f"; on rank {rank}: {mine}" if mine else "")
                    return Failure(name, world, rank, inputs, *rest)
    return None


def _describe(case: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items() if not k.startswith("_"))


def _data(seed: int, rank: int, shape, integers: bool = False) -> torch.Tensor:
    """Rank ``rank``'s tensor for an example: every rank can make every rank's (the oracles do)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if integers:  # sums of small integers are exact in any order
        return torch.randint(-9, 10, shape, generator=g).double()
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _layout(total: int, world: int, rank: int) -> tuple[int, int, int]:
    """The flat buffer layout, computed the plain way: pad with placeholders until every rank's
    piece has the same length, cut into ``world`` pieces, find ours. (padded, start, real)."""
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


def _ring_run(fn, case, rank, world):
    from minishard import comm
    mine = _data(case["_seed"], rank, (case["numel"],), integers=True)
    want = sum(_data(case["_seed"], r, (case["numel"],), integers=True) for r in range(world))
    sent = [0]

    def send_recv(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> None:
        sent[0] += send.numel() * send.element_size()
        comm.send_recv(send, to, recv, frm)

    tensor = mine.clone()
    with comm.ledger() as led:
        fn(tensor, rank, world, send_recv)
    checks = [("collectives called (use send_recv only)", led.count(), 0,
               "build the ring from send_recv; no all_reduce or other collective"),
              ("the tensor after the call (in place): the sum over ranks", tensor, want,
               "reduce phase, step s: send chunk (rank - s) % N right, receive chunk "
               "(rank - s - 1) % N from the left and ADD it; gather phase: send chunk "
               "(rank + 1 - s) % N, receive chunk (rank - s) % N and COPY it. Chunks are views: "
               "write into them")]
    if case["numel"] % world == 0:
        ring = 2 * (world - 1) * case["numel"] * 8 // world
        checks.append(("bytes this rank sent", sent[0], ring,
                       "a ring sends one chunk of S/N bytes per step, 2(N-1) steps: "
                       "2(N-1)/N x S in all"))
    return f"tensor={_short(mine)}", checks


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

    dx, dweight, dbias = fn(dys[rank].clone(), xs[rank].clone(), mean, torch.rsqrt(var + eps),
                            weight.clone(), n, all_reduce)
    formula = ("dx = w·invstd·(dy - A/n - x̂·B/n) with A = Σdy, B = Σdy·x̂ summed over ALL "
               "ranks")
    mine = (f"x={_short(xs[rank])}, dy={_short(dys[rank])}, weight={_short(weight)}, n={n}, "
            f"mean={_short(mean)}, invstd={_short(torch.rsqrt(var + eps))}")
    return mine, [("dx (this rank's rows)", dx, dx_all[lo:hi], formula),
            ("dweight", dweight, dw, "dweight = Σ dy·x̂ over THIS rank's rows only (DDP or "
             "ZeRO averages parameter gradients later; summing here counts them twice)"),
            ("dbias", dbias, db, "dbias = Σ dy over THIS rank's rows only")]


# ------------------------------------------------------------------------ 3. shard layout
def _layout_cases(rng: random.Random, world: int, index: int) -> dict:
    count = rng.randint(1, 2 if index < 10 else 4)
    return {"numels": [rng.randint(1, 3 if index < 10 else 9) for _ in range(count)]}


def _layout_run(fn, case, rank, world):
    padded, start, real = _layout(sum(case["numels"]), world, rank)
    got = fn(list(case["numels"]), world, rank)
    got = tuple(got) if isinstance(got, (tuple, list)) else got
    return "", [("(padded_numel, shard_start, shard_real)", got, (padded, start, real),
             "pad the total to a multiple of N so every rank's piece has k = padded/N elements; "
             "rank r starts at r·k; its real elements are those before the total "
             "(a late rank may hold only padding: 0 real)")]


# ---------------------------------------------------------------------- 4. reduce gradient
def _reduce_cases(rng: random.Random, world: int, index: int) -> dict:
    numel = rng.randint(1, 2 * world) if index < 10 else rng.randint(0, 20)
    return {"numel": numel, "_seed": rng.randrange(10**6)}


def _reduce_run(fn, case, rank, world):
    from minishard import comm
    numel = case["numel"]
    padded, start, real = _layout(numel, world, rank)

    def full_grad(r):  # padding holds zeros, as the engine keeps it
        return torch.cat([_data(case["_seed"], r, (numel,)),
                          torch.zeros(padded - numel, dtype=torch.float64)])

    want = torch.stack([full_grad(r) for r in range(world)]).mean(0)[start:start + real]

    def reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> None:
        comm.reduce_scatter(out, full, "sum")

    got = fn(full_grad(rank), numel, world, rank, reduce_scatter)
    hint = "reduce_scatter SUMS: divide by N for the average the optimizer needs"
    if isinstance(got, torch.Tensor) and got.shape == want.shape and real and \
            torch.allclose(got, want * world):
        hint = "this is the SUM over ranks (N x the average): divide by N"
    elif isinstance(got, torch.Tensor) and got.shape != want.shape:
        hint = (f"return only this rank's REAL elements ({real} here): the shard of k = "
                f"{padded // world} minus the padding")
    return (f"full_grad={_short(full_grad(rank))}",
            [("this rank's shard of the averaged gradient", got, want, hint)])


# ------------------------------------------------------------------------ 5. clip grad norm
def _clip_cases(rng: random.Random, world: int, index: int) -> dict:
    count = rng.randint(1, 3)
    numels = [rng.randint(1, 2 * world if index < 10 else 12) for _ in range(count)]
    # below the norm (clipping acts) or above it (it must not scale anything up)
    return {"numels": numels, "max_norm_factor": rng.choice([0.3, 0.9, 1.5, 4.0]),
            "_seed": rng.randrange(10**6)}


def _clip_run(fn, case, rank, world):
    from minishard import comm
    fulls = [_data(case["_seed"] + i, 0, (n,)) for i, n in enumerate(case["numels"])]
    norm = float(torch.cat(fulls).norm())
    max_norm = case["max_norm_factor"] * norm
    clipped = [g.clone() for g in fulls]
    want_norm = float(torch.nn.utils.clip_grad_norm_(_as_params(clipped), max_norm))
    shards, wants = [], []
    for g, c in zip(fulls, clipped):
        _, start, real = _layout(g.numel(), world, rank)
        shards.append(g[start:start + real].clone())
        wants.append(c[start:start + real])

    def all_reduce(t: torch.Tensor, op: str = "sum") -> None:
        comm.all_reduce(t, op)

    mine = f"grads={[_short(s) for s in shards]}, max_norm={max_norm:.6g}"
    total = fn(shards, max_norm, all_reduce)
    total = float(total) if isinstance(total, (torch.Tensor, int, float)) else total
    scaled_up = max_norm > norm and any(
        s.numel() and not torch.allclose(s, w) for s, w in zip(shards, wants))
    hint = ("scale by min(1, max_norm / (total + 1e-6)): clipping never scales UP"
            if scaled_up else "the global norm: sum |g|² over YOUR shards, all_reduce that "
            "sum, then take the square root; every rank then scales its shards by the same "
            "factor")
    checks = [("the total norm returned", total, want_norm, hint, 1e-6, 1e-12)]  # fp32 is fine
    checks += [(f"gradient shard {i} after clipping (in place)", s, w, hint)
               for i, (s, w) in enumerate(zip(shards, wants))]
    return mine, checks


def _as_params(tensors):
    params = []
    for t in tensors:
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t  # the same tensor: clipping scales the caller's copy in place
        params.append(p)
    return params


EXERCISES: dict[str, Exercise] = {e.name: e for e in [
    Exercise("ring_all_reduce", "a ring all-reduce (sum) from point-to-point sends",
             _ring_cases, _ring_run),
    Exercise("syncbn_backward", "SyncBatchNorm backward: dx, dweight, dbias from global sums",
             _bn_cases, _bn_run),
    Exercise("shard_layout", "a flat buffer's padding and one rank's shard offsets",
             _layout_cases, _layout_run),
    Exercise("reduce_gradient", "stage 2's reduction: reduce-scatter, average, drop padding",
             _reduce_cases, _reduce_run),
    Exercise("clip_grad_norm", "clip by the global norm when each rank holds a shard",
             _clip_cases, _clip_run),
]}


# --------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minishard.exercise",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="the exercise (see --list)")
    parser.add_argument("path", nargs="?", help=f"your file (default: {STUBS}/NAME.py)")
    parser.add_argument("--list", action="store_true", help="list the exercises")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(WORLDS),
                        help="world sizes to check at (default: 2 3)")
    parser.add_argument("--examples", type=int, default=EXAMPLES,
                        help=f"examples per world size (default {EXAMPLES})")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for e in EXERCISES.values():
            print(f"  {e.name:<18}{e.summary}   [{STUBS / (e.name + '.py')}]")
        return 0
    if args.name not in EXERCISES:
        parser.error(f"no exercise {args.name!r}; --list shows them")
    path = Path(args.path) if args.path else STUBS / f"{args.name}.py"
    if not path.is_file():
        parser.error(f"{path}: no such file")
    from minishard.testing import RankPool
    pools: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in pools:
            pools[world] = RankPool(world, timeout=20).start()
        return pools[world]

    start = time.perf_counter()
    try:
        failure = check(args.name, f"{path.resolve()}:{args.name}", get, tuple(args.ranks),
                        args.examples)
    finally:
        for pool in pools.values():
            pool.close()
    took = time.perf_counter() - start
    if failure is not None:
        print(failure)
        return 1
    print(f"PASSED {args.name}: {args.examples} examples at each of {args.ranks} ranks, every "
          f"one equal to the oracle ({took:.1f} s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
