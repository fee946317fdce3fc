"""Allocations: every tensor storage a rank allocates, and the most alive at once.

The engine's meters (meters.py) count the buffers the engine MEANS to hold: shards, gathered
units, gradients in flight. A staging copy that outlives its use, a contiguity copy, a send buffer
kept one collective too long: none of them is in a meter, and all of them are memory. This
tracker counts what is really allocated, so a test can bound it::

    with Allocations() as alloc:
        model.full_state_dict(rank0_only=True)
    assert alloc.peak <= 2 * unit_bytes                   # growth over what was alive before
    print(alloc.describe_peak())                           # what was alive at that moment

It is a ``TorchDispatchMode``: every torch operation on this thread passes through it. After each
one, a storage that no input had is new: it is counted with its size, and a weak reference
subtracts it when the storage dies. A storage that grows or shrinks in place
(``untyped_storage().resize_()``, stage 3's free and re-gather, or ``Tensor.resize_``) moves the
count by the difference. So ``now`` is the bytes allocated since entry and still alive (negative
when something older was freed), and ``peak`` its maximum.

What it cannot see: memory a backend allocates inside a collective (gloo works in place on the
tensors comm.py hands it), other threads' allocations, and storages built outside torch's
operators that no operator hands on (``torch.frombuffer``; ``torch.load``'s and ``torch.tensor``'s
are seen). The outside check is the process's resident set (bench/rss.py).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["Allocations", "Allocation"]


@dataclasses.dataclass
class Allocation:
    """One storage counted by :class:`Allocations`: its size now, and what made it (the
    operator, and the first function outside torch that called it: ``flat.py:gather``)."""
    nbytes: int
    op: str
    shape: tuple
    dtype: torch.dtype
    site: str = ""

    def __str__(self) -> str:
        return (f"{self.nbytes / 2**20:8.3f} MiB  {self.site}  {self.op} -> "
                f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}")


_TORCH = os.path.dirname(torch.__file__)


def _site() -> str:
    """``file:function`` of the innermost caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


class Allocations(TorchDispatchMode):
    """Bytes allocated since entry and still alive (``now``), their maximum (``peak``) and what
    was alive at that maximum (``at_peak``: the counted storages, largest first)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.at_peak: list[Allocation] = []
        self._live: dict[int, tuple[weakref.ref, Allocation]] = {}  # storage key -> (ref, record)
        self._lock = threading.RLock()  # a storage may die on gloo's thread (its last reference)
        self._thread = None             # the thread it watches (set on entry)

    # ------------------------------------------------------------------------ what it reports
    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (between phases of one measurement)."""
        self.peak = self.now
        self.at_peak = self._snapshot()

    def describe_peak(self, top: int = 8) -> str:
        lines = [f"peak {self.peak / 2**20:.3f} MiB over the start; alive then (largest first):"]
        lines += [f"  {a}" for a in self.at_peak[:top]]
        return "\n".join(lines)

    # ---------------------------------------------------------------------------- counting
    def _move(self, delta: int) -> None:
        with self._lock:
            self.now += delta
            if self.now > self.peak:
                self.peak = self.now
                self.at_peak = self._snapshot()

    def _snapshot(self) -> list[Allocation]:
        with self._lock:
            records = [dataclasses.replace(a) for _, a in list(self._live.values())]
        return sorted(records, key=lambda a: -a.nbytes)

    def _track(self, storage: torch.UntypedStorage, record: Allocation) -> None:
        key = storage._cdata
        with self._lock:
            self._live[key] = (weakref.ref(storage, lambda _, key=key: self._died(key)), record)

    def _died(self, key: int) -> None:
        with self._lock:
            _, record = self._live.pop(key)
            self._move(-record.nbytes)

    def _resized(self, storage: torch.UntypedStorage, before: int, op: str) -> None:
        """``storage`` changed size in place: count the difference (and follow it from now on:
        when it dies, its whole size is subtracted, so an older storage freed counts negative)."""
        after = storage.nbytes()
        if after == before:
            return
        with self._lock:
            if storage._cdata not in self._live:
                self._track(storage, Allocation(before, op, (after,), torch.uint8, _site()))
            self._live[storage._cdata][1].nbytes = after
            self._move(after - before)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {}
        for t in _plain(tree_leaves((args, kwargs))):
            if not t.is_meta:
                inputs[t.untyped_storage()._cdata] = (t.untyped_storage(), t.untyped_storage().nbytes())
        if func.overloadpacket in _LIFTS:  # torch.tensor(data): its storage was made just now,
            inputs = {}                    # outside any operator, and is handed over as is
        out = func(*args, **kwargs)
        for t in _plain(tree_leaves(out)):
            if t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs:
                continue  # a view or an in-place result: resizes are checked below
            if key not in self._live:
                self._track(storage, Allocation(0, str(func.overloadpacket.__name__),
                                                tuple(t.shape), t.dtype, _site()))
                self._resized(storage, 0, "")
        for storage, before in inputs.values():
            self._resized(storage, before, str(func.overloadpacket.__name__))
        return out

    def __enter__(self):
        self._thread = threading.get_ident()
        with _OPEN_LOCK:
            if not _OPEN:
                torch.UntypedStorage.resize_ = _counted_resize
            _OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        with _OPEN_LOCK:
            _OPEN.remove(self)
            if not _OPEN:
                torch.UntypedStorage.resize_ = _RESIZE
        return super().__exit__(*exc)


_LIFTS = {torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy}


def _plain(leaves):
    """The plain tensors among ``leaves``: a wrapper (a DTensor) stands for the tensors inside
    it, whose storages are the memory (its own claims the global size: a rank holds its part)."""
    for t in leaves:
        if is_traceable_wrapper_subclass(t):
            yield from _plain(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t

# ``untyped_storage().resize_`` is not a torch operator, so no mode sees it: while any tracker is
# open it is replaced, process-wide, by one that tells the open trackers OF THE CALLING THREAD
# (a mode sees only its own thread's operators too), and put back when the last one closes.
_RESIZE = torch.UntypedStorage.resize_
_OPEN: list[Allocations] = []
_OPEN_LOCK = threading.Lock()


def _counted_resize(storage, size):
    before = storage.nbytes()
    result = _RESIZE(storage, size)
    me = threading.get_ident()
    for tracker in list(_OPEN):
        if tracker._thread == me:
            tracker._resized(storage, before, "untyped_storage().resize_")
    return result
