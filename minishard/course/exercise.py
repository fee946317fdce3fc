"""Exercises that check themselves: write the key pieces yourself, the project's oracles judge them.

    python -m minishard.exercise --list
    python -m minishard.exercise syncbn_backward           # tutorials/exercises/syncbn_backward.py
    python -m minishard.exercise syncbn_backward mine.py   # or any file of yours

Each exercise is a stub in ``tutorials/exercises/NAME.py``: one function, its contract in the
docstring, ``raise NotImplementedError`` for a body. The checker starts warm gloo ranks
(``minishard.testing.RankPool``, 2, 3 and 4 of them), loads your file on every rank, and runs
your function on examples from small to larger, each judged by an INDEPENDENT oracle computed in
one process from every rank's inputs (oracles.py: stock torch on the global batch, plain sums
and slices, never minishard's own code). It checks the CONTRACT, not only the numbers: the
collectives your code issues, the bytes a ring sends, the same bits on every rank where a real
all-reduce gives them. The first example that fails is printed: every rank's inputs, the rank
that failed, what was expected and what your code gave, and a hint, which says more at the next
failure of the same exercise. Each choice, and why: [Note: the checker].

    ring_all_reduce     the ring all-reduce from point-to-point sends (tutorial 01)
    syncbn_backward     SyncBatchNorm's backward: one all-reduce of [Σdy, Σdy·x̂] (tutorial 03)
    shard_layout        which rows of each parameter a rank holds, FSDP2's cut (flat.py)
    reduce_gradient     stage 2's reduction: reduce-scatter, average, drop the padding (flat.py)
    clip_grad_norm      clipping by the global norm when each rank holds a shard (engine.py)

Your function receives the communication it may use as arguments (``all_reduce``,
``reduce_scatter``, ``send_recv``: thin wrappers over ``minishard.comm``), so it needs no
``torch.distributed`` of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from minishard.course.oracles import EXERCISES, Exercise, show

__all__ = ["EXERCISES", "Failure", "check", "main"]

STUBS = Path(__file__).resolve().parents[2] / "tutorials" / "exercises"
WORLDS = (2, 3, 4)
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
        inputs = self.inputs.replace("\n", "\n            ")
        where = f"on rank {self.rank}" if self.rank >= 0 else "all ranks together"
        return (f"FAILED {self.exercise} at {self.world} ranks, {where}.\n"
                f"  inputs:   {inputs}\n  checking: {self.what}\n"
                f"  expected: {self.expected}\n  got:      {self.got}\n  hint:     {self.hint}")


def _differs(got, expected, rtol: float = 1e-9, atol: float = 1e-12) -> bool:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or (got.shape, got.dtype) != (expected.shape,
                                                                            expected.dtype):
            return True
        return not torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol)
    if isinstance(expected, float):
        return not (isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol,
                                                                   abs_tol=atol))
    return got != expected


# The last step of every hint of an exercise: how to do it (its first says what is wrong).
HOW = {
    "ring_all_reduce": "chunks = tensor.tensor_split(N); reduce phase, step s = 0..N-2: send "
                       "chunk (rank - s) % N right, receive chunk (rank - s - 1) % N from the "
                       "left into a buffer and ADD it to that chunk; gather phase, s = 0..N-2: "
                       "send chunk (rank + 1 - s) % N, receive chunk (rank - s) % N and COPY it "
                       "in (tutorial 01 builds this ring)",
    "syncbn_backward": "x̂ = (x - mean)·invstd; put this rank's Σdy and Σ(dy·x̂) (per channel) "
                       "side by side in ONE tensor of 2C and all_reduce it once: A, B; then "
                       "dx = weight·invstd·(dy - A/n - x̂·B/n) with n the global count, and "
                       "dweight, dbias from this rank's rows alone (minishard/syncbn.py)",
    "shard_layout": "for each parameter: R = its dim-0 size (1 if 0-dim), c = ceil(R/N); rows "
                    "(min(r·c, R), min((r+1)·c, R)); width c x (elements per row); k = the sum "
                    "of the widths (minishard/zero/flat.py, Layout)",
    "reduce_gradient": "k = len(full_grad) // N; out = an empty k-element tensor; "
                       "reduce_scatter(out, full_grad); divide by N; keep out[:real], real = "
                       "max(0, min(k, numel - rank·k)) (minishard/zero/flat.py, reduce_grads)",
    "clip_grad_norm": "total = a one-element tensor of Σ g² over this rank's shards; "
                      "all_reduce(total); total = sqrt; multiply every shard in place by "
                      "min(1, max_norm / (total + 1e-6)); return total",
}


def _hint(hint, level: int, name: str = "") -> str:
    """A hint is one string, or steps: what is wrong first, then how to do it (a string's next
    step: it again, then ``HOW[name]``). ``level`` is how many times this exercise failed
    before; the last step stays once reached."""
    if isinstance(hint, str):
        hint = (hint, f"{hint.rstrip('.')}. How: {HOW[name]}") if name in HOW else (hint,)
    step = min(level, len(hint) - 1)
    more = "" if step == len(hint) - 1 else (f"  (hint {step + 1} of {len(hint)}: fail again "
                                             "for the next)")
    return hint[step] + more


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


class _Raised(Exception):
    """The learner's code raised (its exception is the cause), as opposed to the checker failing
    on what that code returned."""


def _guarded(solution) -> Callable:
    """The learner's function, with any exception it raises (or its file raises on loading)
    wrapped in :class:`_Raised`."""
    def call(*args, **kwargs):
        try:
            return _load(solution)(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise _Raised() from exc
    return call


def _form_hint(got, expected) -> str | None:
    """A hint from the form of a wrong output (its type or dtype), when that is what is wrong."""
    if isinstance(expected, torch.Tensor) and not isinstance(got, torch.Tensor):
        return f"return a tensor here, not a {type(got).__name__}"
    if isinstance(expected, torch.Tensor) and got.dtype != expected.dtype:
        return (f"you returned {got.dtype}; keep its dtype, {expected.dtype} (a cast rounds "
                "every element, and what you return is compared in that dtype)")
    return None


def _on_rank(name: str, solution, case: dict, level: int = 0):
    """Runs on every rank of the pool: the learner's code on this example, then the checks.
    Returns (None or the first failing check as (what, expected, got, hint), shared values).
    Never raises: the learner's exception, or an output the checks cannot use, is a failure."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        checks, shared = EXERCISES[name].run(_guarded(solution), case, rank, world)
    except NotImplementedError:
        return (("your function", "an implementation", "NotImplementedError",
                 _hint("fill in the body of the stub (its docstring says what it must do)",
                       level, name)), None)
    except _Raised as raised:  # the learner's bug: show where, not the checker's traceback
        exc = raised.__cause__
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return (("your function", "no exception", "".join(lines[-3:]).strip(),
                 _hint("your function raised this (the last lines of its traceback say where); "
                       "if a collective raised it, every rank must make the same calls in the "
                       "same order", level, name)), None)
    except Exception as exc:  # the checks could not use what the function returned
        return (("what your function returned", "what the stub's docstring describes",
                 f"{type(exc).__name__}: {exc}", _hint("return exactly what the stub's "
                 "docstring says: the types, shapes and number of values", level, name)), None)
    for what, got, expected, hint, *tol in checks:
        if _differs(got, expected, *tol):
            hint = _form_hint(got, expected) or hint
            return (what, show(expected), show(got), _hint(hint, level, name)), shared
    return None, shared


# [Note: the checker] Ranks: 3 makes the uneven cases, 4 the layouts where more than one rank
# holds only padding. The oracles never use minishard's own code, which is the reference
# solution: tests/test_exercise.py shows the checker passes it and fails known-wrong versions.
# The collectives are counted by the comm ledger: the SyncBatchNorm backward must use exactly one
# all_reduce. Hints come in steps: the first says what is wrong; the next failure of the same
# exercise (counted in a small file, see ``attempts_file``) adds how to do it. Inputs are float64
# so that rounding cannot hide a wrong term, and random floats (not integers) so that a sum
# formed in a different order on different ranks shows in the last bits.
def check(name: str, solution, pools: Callable[[int], "object"], worlds=WORLDS,
          examples: int = EXAMPLES, seed: int = 0, hint_level: int = 0) -> Failure | None:
    """Run exercise ``name`` against ``solution`` (a module-level function, or
    'file.py:function') on warm ranks ``pools(world)``; None if every example passes.
    ``hint_level``: how many times it failed before (which step of a hint to show)."""
    exercise = EXERCISES[name]
    for world in worlds:
        pool = pools(world)
        for index in range(examples):
            case = exercise.cases(random.Random(seed * 7919 + index), world, index)
            inputs = _describe(exercise, case, world)
            try:
                results = pool.run(_on_rank, name, solution, case, hint_level)
            except TimeoutError:
                return Failure(name, world, -1, inputs, "every rank finishing",
                               "all ranks return", "some ranks never returned",
                               _hint("a rank waited in a collective another rank never "
                                     "called: every rank must call the same communication, "
                                     "in the same order", hint_level, name))
            for rank, (failed, _) in enumerate(results):
                if failed is not None:
                    return Failure(name, world, rank, inputs, *failed)
            disagree = exercise.together(case, world, [shared for _, shared in results])
            if disagree is not None:
                rank, what, expected, got, hint = disagree
                return Failure(name, world, rank, inputs, what, expected, got,
                               _hint(hint, hint_level, name))
    return None


def _describe(exercise: Exercise, case: dict, world: int) -> str:
    """The example's parameters, then every rank's own inputs, one line each."""
    head = ", ".join(f"{k}={v}" for k, v in case.items() if not k.startswith("_"))
    ranks = [exercise.describe(case, r, world) for r in range(world)]
    return "\n".join([head] + [f"rank {r}: {text}" for r, text in enumerate(ranks) if text])


# --------------------------------------------------------------------------------------- CLI
def attempts_file() -> Path:
    """Where the CLI counts each exercise's failures since its last pass (the hint steps):
    $MINISHARD_EXERCISE_STATE, else ~/.cache/minishard/exercise-attempts.json."""
    default = Path.home() / ".cache" / "minishard" / "exercise-attempts.json"
    return Path(os.environ.get("MINISHARD_EXERCISE_STATE", default))


def _attempts() -> dict[str, int]:
    try:
        return json.loads(attempts_file().read_text())
    except (OSError, ValueError):
        return {}


def _record_attempt(name: str, failed: bool) -> None:
    counts = _attempts()
    counts[name] = counts.get(name, 0) + 1 if failed else 0
    try:
        attempts_file().parent.mkdir(parents=True, exist_ok=True)
        attempts_file().write_text(json.dumps(counts))
    except OSError:  # a read-only home: hints then stay at their first step
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minishard.exercise",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="the exercise (see --list)")
    parser.add_argument("path", nargs="?", help=f"your file (default: {STUBS}/NAME.py)")
    parser.add_argument("--list", action="store_true", help="list the exercises")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(WORLDS),
                        help="world sizes to check at (default: "
                             f"{' '.join(map(str, WORLDS))})")
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
                        args.examples, hint_level=_attempts().get(args.name, 0))
    finally:
        for pool in pools.values():
            pool.close()
    took = time.perf_counter() - start
    _record_attempt(args.name, failure is not None)
    if failure is not None:
        print(failure)
        return 1
    print(f"PASSED {args.name}: {args.examples} examples at each of {args.ranks} ranks, every "
          f"one equal to the oracle ({took:.1f} s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
