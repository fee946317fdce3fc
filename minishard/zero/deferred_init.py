"""Deferred init: a model built under ``with torch.device("meta"):`` (wholly or partly) gets its
values while it is wrapped, one module at a time, so no rank ever holds the whole model.

The flat buffers are laid out first (build.py), holding only what the stage keeps (stage 3: this
rank's shards; 0-2: the full buffers), as zeros. Then :func:`materialize` walks
``root.modules()`` in order, ONE MODULE AT A TIME::

    for each module m with tensors on the meta device:
        allocate m's own tensors on ``device``          (parameters and buffers, not its children's)
        rank 0: fill them with NaN, run param_init_fn(m) or m.reset_parameters()
                (any storage it allocates starts as NaN too: _NaNStorage)
        rank 0: anything still NaN / untouched?  -> the verdict, broadcast: every rank raises
        broadcast each tensor from rank 0; each rank copies the part it keeps into its
        shard (_write_param), keeps the buffers, frees the rest

So no rank holds more than what its stage keeps + one module's full tensors (+ the buffers,
which every rank keeps): at stage 3, the shards + at most the largest unit's full tensors, when
each module's tensors belong to its unit ([Note: what a rank holds]: counted and allocated).

**Why module by module, in modules() order.** Building under ``torch.device("meta")`` consumes
no random numbers, and ``modules()`` visits submodules in registration order, so each module's
initialiser called in that order, on the CPU generator, with the same seed, draws the SAME
numbers as the eager ``torch.manual_seed(s); build()`` -- whatever the units are. Tested, bit
for bit on ``device="cpu"``, when every module creates its own tensors with its
``reset_parameters()`` (as torch's layers do) and registers its submodules in the order it
builds them. What differs otherwise, plainly: [Note: the same numbers].

A meta tensor that no initialiser wrote (a RoPE ``inv_freq`` computed in ``__init__`` is lost
on the meta device, and ``reset_parameters`` may not recompute it) is an error naming the
module and the tensor, on every rank, at wrap time: never uninitialised memory.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minishard import comm
from minishard.zero.meters import WrapMeter, storage_bytes
from minishard.verdicts import rank0_verdict

__all__ = ["DeferredInit", "default_device", "has_meta_tensors", "materialize"]


@dataclasses.dataclass(frozen=True)
class DeferredInit:
    """Where meta tensors are materialised, and how they are initialised (see materialize)."""
    device: torch.device
    param_init_fn: Callable[[nn.Module], None] | None = None

    def __post_init__(self) -> None:
        if self.device.type == "meta":
            raise ValueError("ZeRO: device='meta' would leave the model without values; pass "
                             "the device to materialise on (device='cpu' or a CUDA device)")


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


# [Note: what a rank holds] Laying out a stage-3 buffer allocates its full tensor and frees it
# at once, untouched: also within the module docstring's bound. ``WrapMeter`` counts it all;
# tests/test_deferred_init.py checks the count exactly. What is really ALLOCATED adds up to two
# modules before, whose broadcasts gloo's worker threads may still hold
# (comm.FINISHED_KEPT_BY_BACKEND): the shards + 3 units, tests/test_memory_wall.py; and each
# module's freed pages go back to the operating system at once (release_free_pages, below).
#
# [Note: the same numbers] Materialising unit by unit would not draw the eager build's numbers:
# the root unit's embedding and head sit on either side of the blocks in the drawing order.
# The guarantee (module docstring) is tested. What differs otherwise, plainly:
# * a module whose ``__init__`` draws random numbers outside ``reset_parameters()``, or creates
#   its own tensors AFTER building its children (``modules()`` visits a parent first), or
#   registers children in another order than it builds them: other numbers (same distribution);
# * a tied parameter takes the value of its FIRST user in ``modules()`` order (an eager
#   ``head.weight = emb.weight`` keeps the embedding's, as here); later users' initialisers
#   still run, on a scratch copy, so the numbers drawn after them stay aligned;
# * a model mixing real and meta modules: real modules keep their values (rank 0's) and their
#   initialisers do not run, so the meta modules after them draw other numbers than an eager
#   build would;
# * another ``device`` draws from that device's generator (CUDA's), not the CPU's;
# * only rank 0 runs the initialisers: afterwards rank 0's generator is where an eager build
#   leaves it, the other ranks' are untouched.
def materialize(root: nn.Module, units: list, group, deferred: DeferredInit,
                meter: WrapMeter) -> None:
    """Give every meta tensor of ``root`` its values, one module at a time in ``modules()``
    order (the module docstring says why that order): parameters go into the flat
    buffers (each rank keeps its part), buffers stay in their modules. Real tensors of a mixed
    model are broadcast from rank 0 the same way. Collective: every rank walks the same
    modules and issues the same broadcasts."""
    slots = {(id(place.module), place.attr): (param.flat, param.index) for unit in units
             for param in unit.params() for place in param.places}
    written: set[tuple[int, int]] = set()      # (id(flat), j): parameter values in place
    buffers: dict[int, torch.Tensor] = {}      # id(original buffer) -> the one it became
    for name, module in root.named_modules():
        _materialize_module(name, module, slots, written, buffers, group, deferred, meter)
        release_free_pages()  # the module's full tensors are gone: their pages too


def _materialize_module(name, module, slots, written, buffers, group, deferred, meter) -> None:
    """One module's own tensors: materialise, initialise on rank 0, check, broadcast, keep.

    A *target* is a meta tensor not materialised yet: the initialiser must write it. The
    module's other tensors (real ones, a tied parameter an earlier module already wrote, a
    shared buffer) are shown to the initialiser as scratch copies, so it cannot change them."""
    own = [(kind, attr, t) for kind, table in (("parameter", module._parameters),
                                               ("buffer", module._buffers))
           for attr, t in table.items() if t is not None]
    def is_done(kind: str, attr: str, t: torch.Tensor) -> bool:
        if kind == "buffer":
            return id(t) in buffers
        flat, j = slots[id(module), attr]
        return (id(flat), j) in written

    done = {attr for kind, attr, t in own if is_done(kind, attr, t)}
    targets = {attr: _empty_like(t, deferred.device) for kind, attr, t in own
               if t.is_meta and attr not in done}
    meter.hold(storage_bytes(targets.values()))
    if any(t.is_meta for _, _, t in own):  # a tied user too: its initialiser draws numbers
        error = None
        if comm.group_rank(group) == 0:
            targets, error = _initialise(name, module, own, targets, deferred, meter)
        error = rank0_verdict(error, group, deferred.device, tag=f"init {name or '<root>'}")
        if error is not None:
            raise RuntimeError(error)
    for kind, attr, t in own:
        if attr in done:
            if kind == "buffer":
                module._buffers[attr] = buffers[id(t)]
            continue
        value = targets.get(attr, t)
        comm.broadcast(value.data, 0, group, tag=f"init {name + '.' if name else ''}{attr}")
        if kind == "parameter":
            flat, j = slots[id(module), attr]
            _write_param(flat, j, value)
            written.add((id(flat), j))
            meter.drop(storage_bytes([value]) if attr in targets else 0)
        else:
            module._buffers[attr] = buffers[id(t)] = value


def _write_param(flat, j: int, value: torch.Tensor) -> None:
    """Store parameter ``j``'s whole ``value`` (every rank has it) where this rank keeps it:
    all of it into ``full`` while ``full`` is kept, and its rows into the shard. One parameter
    at a time: no rank ever needs the whole flat buffer."""
    with torch.no_grad():
        if flat.is_gathered:
            flat.param_in(flat.full.data, j).copy_(value.view(flat.shapes[j]))
        flat.shard_views()[j].copy_(flat.my_rows(j, value.detach()))


def _empty_like(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else out


def _initialise(name, module, own, targets, deferred, meter):
    """Rank 0: run the module's initialiser on ``targets`` (NaN-filled; the module's other
    tensors swapped for scratch copies), put the module back as it was, and say what was not
    written. Returns (the values, by attribute; an error message or None)."""
    tables = {"parameter": module._parameters, "buffer": module._buffers}
    saved = {(kind, attr): t for kind, attr, t in own}
    scratch = {attr: _empty_like(t, deferred.device) for kind, attr, t in own if attr not in targets}
    meter.hold(storage_bytes(scratch.values()))
    with torch.no_grad():
        for t in targets.values():
            _fill_sentinel(t)
    before = {attr: (t._version, t.data_ptr()) for attr, t in targets.items()}
    for kind, attr, _ in own:
        tables[kind][attr] = targets.get(attr, scratch.get(attr))
    init = deferred.param_init_fn or _reset_parameters
    error = None
    try:
        with torch.no_grad(), _NaNStorage():
            init(module)
    except Exception as exc:  # tell the other ranks, rather than leave them waiting
        who = "param_init_fn" if deferred.param_init_fn else "reset_parameters()"
        error = (f"ZeRO deferred init: {who} of module {name or '<root>'!r} "
                 f"({type(module).__name__}) raised {type(exc).__name__}: {exc}")
    values = {attr: tables[kind][attr] for kind, attr, _ in own if attr in targets}
    for (kind, attr), t in saved.items():  # the module as it was (parameters leave it later)
        tables[kind][attr] = t
    meter.drop(storage_bytes(scratch.values()))
    if error is None:
        error = _unwritten(name, module, own, targets, values, before, deferred)
    return values, error


class _NaNStorage(TorchDispatchMode):
    """While an initialiser runs, fresh floating storage (``torch.empty``, ``to_empty``,
    ``new_empty``) is NaN, not whatever memory held: an initialiser that only allocates leaves
    NaN behind, and :func:`_was_written` catches it."""
    _FRESH = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
              torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self._FRESH and (out.is_floating_point() or out.is_complex()):
            out.fill_(float("nan"))
        return out


def _reset_parameters(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _fill_sentinel(t: torch.Tensor) -> None:
    """Floating tensors get NaN: an element still NaN after the initialiser was not written."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))


def _was_written(value: torch.Tensor | None, installed: torch.Tensor, before) -> bool:
    """Did the initialiser write ``installed`` (or replace it by a real tensor)? Floating
    tensors: no NaN left. Others: replaced, or their version counter or storage moved."""
    if value is None or value.is_meta:
        return False
    if value.is_floating_point() or value.is_complex():  # in chunks: no tensor-sized mask
        return not any(bool(torch.isnan(c).any()) for c in value.detach().reshape(-1).split(2**16))
    return value is not installed or (value._version, value.data_ptr()) != before


def _unwritten(name, module, own, targets, values, before, deferred) -> str | None:
    """The error naming every target the initialiser left unwritten (or replaced by a tensor
    of another shape or dtype), or None."""
    prefix = f"{name}." if name else ""
    declared = {attr: (kind, t) for kind, attr, t in own}
    bad = []
    for attr, value in values.items():
        kind, t = declared[attr]
        if not _was_written(value, targets[attr], before[attr]):
            bad.append(f"{kind} {prefix}{attr}")
        elif (value.shape, value.dtype, value.device) != (t.shape, t.dtype, targets[attr].device):
            bad.append(f"{kind} {prefix}{attr} (set to a {tuple(value.shape)} {value.dtype} "
                       f"tensor on {value.device}; declared {tuple(t.shape)} {t.dtype} on "
                       f"{targets[attr].device})")
    if not bad:
        return None
    cls = type(module).__name__
    how = ("param_init_fn(module) did not (fully) write it" if deferred.param_init_fn else
           f"{cls}.reset_parameters() did not (fully) write it"
           if hasattr(module, "reset_parameters") else
           f"no initialiser wrote it ({cls} has no reset_parameters())")
    return (f"ZeRO deferred init: {', '.join(bad)} of module {name or '<root>'!r} ({cls}) is "
            f"on the meta device and {how}; refusing to train on uninitialised memory. Tensors computed in __init__ "
            "(a RoPE inv_freq, a causal mask) are lost on the meta device: recompute them in "
            "the module's reset_parameters(), pass ZeRO(..., param_init_fn=fn) where fn(module) "
            "writes the module's own tensors, or build that module on a real device.")


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


_malloc_trim = _libc_malloc_trim()


def release_free_pages() -> None:
    """Hand the pages of freed tensors back to the operating system now, where the C library
    keeps them (glibc; elsewhere a no-op). Called after each module of a meta wrap, whose
    promise is a flat peak: its full tensors are freed, their pages must go too.

    Why it is needed: glibc serves a large request with its own mapping, returned to the OS on
    free, but each such free raises the size it maps from then on (up to 32 MiB); later buffers
    of a unit's size come from the heap, where a freed one is kept and reused only if the next
    request still fits the hole. Interleaved with small allocations, the holes do not fit, and
    the resident set grows with the number of modules although the live tensors do not
    (bench/RESULTS.md, "The memory wall"). ``malloc_trim(0)`` returns every free page at once:
    ~20 us when there is nothing to return. (A phase that can reuse one buffer needs none of
    this: full_state.Staging.)"""
    if _malloc_trim is not None:
        _malloc_trim(0)
