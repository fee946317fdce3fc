"""One way in and one way out for scripts started by ``torchrun``: every tutorial and the tour.

    with minishard.launch.session(world_sizes={2, 4}, why="...") as (rank, world):
        ...   # the lesson

On the way in: a gloo process group from torchrun's environment, with a timeout (a rank stuck in
a collective becomes an error after ``timeout`` seconds instead of hanging for gloo's default 30
minutes), one thread per rank (N ranks share this machine's cores) and, if the script only makes
sense at some world sizes, ONE line saying which and why, then every rank exits with status 2
(no traceback: a wrong ``--nproc_per_node`` is the caller's choice, not a bug in the lesson).

On the way out (only when the body finished without an exception):

    gc.collect()              objects in reference cycles (a model and its hooks, an autograd
                              graph, a finished collective's handle) are freed NOW, while the
                              interpreter and the process group are fully alive
    dist.barrier()            on gloo, a barrier also waits for this rank's earlier collectives:
                              after it no rank has work in flight that a peer still needs
    destroy_process_group()   every group (also those from new_group), its gloo threads joined

and once more ``gc.collect()`` from ``atexit``, which runs before the interpreter starts tearing
itself down: what the script's ``main()`` still held when the block ended is unreachable by then.

Why all this: torch 2.13 with gloo now and then aborts a rank at interpreter exit, after the
script has printed its result, when C++ objects that hold tensors are destroyed during
finalization (pytorch#190489); the cure is to let nothing of the kind survive to it. The whole
story, and why an exception skips these steps: tutorials/08_launching.md, section 7.

Run outside torchrun, a script gets one line saying how to start it (exit status 2).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Collection
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["session", "at_least", "needs"]

WRONG_WORLD_SIZE = 2  # exit status for "run me with another --nproc_per_node"


def at_least(n: int) -> range:
    """World sizes n, n+1, ...: ``session(world_sizes=at_least(2), why=...)``."""
    return range(n, 1 << 31)


def needs(world_sizes: Collection[int]) -> str:
    """The world sizes a script accepts, in words: "2 or 4", "at least 2" (a range up to a very
    large number), "2, 3 or 4"."""
    if isinstance(world_sizes, range) and world_sizes.step == 1 and len(world_sizes) > 64:
        return f"at least {world_sizes.start}"
    sizes = sorted(world_sizes)
    if len(sizes) == 1:
        return str(sizes[0])
    return ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}"


def _smallest(world_sizes: Collection[int]) -> int:
    return world_sizes.start if isinstance(world_sizes, range) else min(world_sizes)  # O(1)


def _script() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m minishard.tour
        return f"-m {spec.name}"
    return os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"


def _refuse(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _close() -> None:
    """Tear down in the order the module docstring explains."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def session(world_sizes: Collection[int] | None = None, why: str = "",
            timeout: float = 60) -> Iterator[tuple[int, int]]:
    """Yield ``(rank, world)`` inside a gloo process group; tear it down cleanly on the way out.

    ``world_sizes``: the world sizes the script supports (any collection: ``{2, 4}``,
    ``at_least(2)``); ``why``: the reason, in a few words, printed when the world size is
    not among them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        _refuse(f"{_script()}: start it with torchrun, e.g. "
                f"torchrun --standalone --nproc_per_node=2 {_script()}")
        raise SystemExit(WRONG_WORLD_SIZE)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(1)
    atexit.register(gc.collect)  # runs after main() has returned, before interpreter teardown
    rank, world = dist.get_rank(), dist.get_world_size()
    if world_sizes is not None and world not in world_sizes:
        if rank == 0:
            _refuse(f"{_script()} needs {needs(world_sizes)} ranks"
                    + (f" ({why})" if why else "")
                    + f"; got {world}. Run it with torchrun --nproc_per_node="
                    f"{_smallest(world_sizes)}.")
        _close()
        raise SystemExit(WRONG_WORLD_SIZE)
    yield rank, world
    _close()
