"""FlatBuffer: one unit's communication buffer, and each parameter's shard cut along dim 0.

Every parameter is cut into N chunks of rows, as FSDP2 cuts it: with R rows, each rank gets
c = ceil(R / N) rows (the last ones fewer, maybe none), padded to c rows for the collectives
(:class:`Layout`: the arithmetic, no storage). Rank r's *shard* puts its chunk of every parameter
side by side. For a (3x2), b (3), c (5), N=2::

    a: rows 0-1 -> rank 0, row 2 + one pad row -> rank 1        (c=2 rows of 2: width 4)
    rank 0's shard = [a0 a1 | b0 b1 | c0 c1 c2]        k = 4 + 2 + 3 = 9 elements on every rank
    rank 1's shard = [a2 _  | b2 _  | c3 c4 _ ]        (_ : padding, always zero)
    full = [a0 a1 a2 _ | b0 b1 b2 _ | c0 c1 c2 c3 c4 _ ]        N * k = 18 elements

The *user parameters* are DTensors of global shape (3, 2) whose local tensor is this rank's rows
(params.py). ``full`` is what the module computes with: its parameters are views of it while a
unit computes, so autograd sums their gradients into ``full.grad``. The collectives, one per unit
(or bucket), are the functions below the class: :func:`gather_params` (all-gather, then
*copy-out* into full's layout, one op) and :func:`reduce_grads` (*copy-in* to the rank-major
N x k layout, one op, then reduce-scatter: rank r receives the gradient of its rows).

Where the tensors live is the buffer's :class:`FlatMode` (engine.py's stage table picks it):

    mode        full                       the user parameters are views of
    REPLICATED  always (stage 0, N = 1,    full (the whole parameters; all-reduced gradients)
                ``replicate=``)
    VIEW        always (stages 1-2)        full: this rank's rows of each parameter's region
    OWN         only while gathered (3)    ``shard``: k elements of their own

Mixed precision (``param_dtype``): full holds the compute dtype, ``shard`` the fp32 masters, so
a VIEW buffer becomes OWN under a cast. Hybrid sharding (``replicate_group``): the gradient is
reduce-scattered inside ``group``, then all-reduced across the replicas (lesson 10).
"""
from __future__ import annotations

import enum
import math
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minishard import comm
from minishard.zero.params import Spec, local

__all__ = ["Layout", "FlatMode", "FlatBuffer", "gather_params", "reduce_grads", "copy_in",
           "land", "collective_key", "rows_of", "identity"]


# ------------------------------------------------------------------------------ the layout
def rows_of(n_rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dim-0 cut into ``ranks`` chunks of ceil(n_rows / ranks) that
    ``rank`` holds (empty for the last ranks when there are fewer rows than ranks)."""
    c = math.ceil(n_rows / ranks)
    return min(rank * c, n_rows), min((rank + 1) * c, n_rows)


class Layout:
    """Where every row of a unit's parameters sits, and nothing else (no storage): parameters
    of ``shapes`` cut along dim 0 into ``chunks`` pieces, seen from the holder of piece
    ``chunk`` (the module docstring's picture)."""

    def __init__(self, shapes: list[torch.Size], chunks: int, chunk: int) -> None:
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.numel = sum(self.numels)
        # each parameter is cut into ``chunks`` (N, or 1 at stage 0); ours is number ``chunk``
        self.chunks, self.chunk = n, r = chunks, chunk
        self.n_rows = [s[0] if len(s) else 1 for s in shapes]   # a 0-dim param: one row
        self.row_numels = [math.prod(s[1:]) for s in shapes]
        self.widths = [math.ceil(rows / n) * m for rows, m in zip(self.n_rows, self.row_numels)]
        self.offsets = [sum(self.widths[:j]) for j in range(len(shapes))]  # in the shard
        self.shard_numel = sum(self.widths)                  # k: what each rank sends
        self.padded_numel = n * self.shard_numel
        # the rows this rank owns (FSDP2's torch.chunk cut: a 0-dim parameter is one row, rank
        # 0's), and those it holds: the same, but every rank holds a 0-dim one (replicated)
        self.owned_rows = [rows_of(rows, n, r) for rows in self.n_rows]
        self.row_ranges = [cut if len(s) else (0, 1) for cut, s in zip(self.owned_rows, shapes)]
        self.scalars = [j for j, s in enumerate(shapes) if not len(s) and n > 1]
        self.shard_real = sum((hi - lo) * m for (lo, hi), m in zip(self.row_ranges,
                                                                    self.row_numels))
        # full and the shards have the same layout when each rank's shard is one piece of full
        self.same_layout = n == 1 or (len(shapes) == 1 and not self.scalars)

    def is_replicated(self, j: int) -> bool:
        """Does every holder hold all of parameter j (one chunk, or a 0-dim parameter)?"""
        return self.chunks == 1 or j in self.scalars

    def regions(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded region of a full-layout tensor, viewed (N, width_j): row r
        is what rank r holds of it."""
        n = self.chunks
        return [full[n * at:n * (at + w)].view(n, w) for at, w in zip(self.offsets, self.widths)]

    def region(self, full: torch.Tensor, j: int) -> torch.Tensor:
        return self.regions(full)[j]

    def param_in(self, full: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's values in a full-layout tensor, shaped like it (padding left out)."""
        return self.region(full, j).view(-1)[:self.numels[j]].view(self.shapes[j])

    def shard_of(self, full: torch.Tensor, r: int) -> torch.Tensor:
        """Rank r's shard (k elements, padded) cut out of a full-layout tensor: a copy."""
        return torch.cat([region[r] for region in self.regions(full)])

    def shard_shape(self, j: int) -> torch.Size:
        """Parameter j's shape on this rank: its rows (the whole shape on one rank, or of a
        0-dim parameter)."""
        if self.chunks == 1 or not len(self.shapes[j]):
            return self.shapes[j]
        lo, hi = self.row_ranges[j]
        return torch.Size([hi - lo, *self.shapes[j][1:]])

    def my_rows(self, j: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter j's full ``value``, shaped like its shard."""
        lo, hi = self.row_ranges[j]
        return value.reshape(self.n_rows[j], self.row_numels[j])[lo:hi].view(self.shard_shape(j))


# ------------------------------------------------------------------------------ the buffer

class FlatMode(enum.Enum):
    """Where a flat buffer's full tensor and shards live (the table in the module docstring)."""
    REPLICATED = enum.auto()  # not sharded (stage 0, replicate=): the parameters are views of full
    VIEW = enum.auto()  # full always kept; the shards are views of this rank's rows in it
    OWN = enum.auto()   # the shards own their storage (``shard``); full exists while gathered

    def under_cast(self, cast: bool) -> "FlatMode":
        """The mode to build when full holds another dtype than the master (mixed precision):
        a bf16 full buffer cannot hold the fp32 master, so a VIEW shard must own its storage."""
        return FlatMode.OWN if self is FlatMode.VIEW and cast else self


class FlatBuffer(Layout):
    """The parameters ``params`` of one unit (one dtype, one requires_grad): their ``full``
    buffer and this rank's shard of them. The collectives between the two are the functions
    below the class: :func:`gather_params` and :func:`reduce_grads`."""

    def __init__(self, params: list[torch.Tensor], group=None, *, mode: FlatMode = FlatMode.OWN,
                 param_dtype: torch.dtype | None = None, name: str = "",
                 replicate_group=None, device: torch.device | None = None,
                 spec: Spec | None = None, model: int = 0) -> None:
        assert mode is not FlatMode.REPLICATED or replicate_group is None, \
            "stage 0 reduces over every rank at once"
        self.group, self.mode, self.name = group, mode, name
        self.model = model  # the wrap's number (config.check_same_config): in every stamp
        self.spec = spec  # stages 1-3: the user parameters are DTensors (params.py)
        self.replicate_group = replicate_group  # hybrid sharding: the ranks holding our shard too
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        sharded = mode is not FlatMode.REPLICATED  # stage 0: one chunk, the whole of each parameter
        super().__init__([p.shape for p in params], self.world if sharded else 1,
                         self.rank if sharded else 0)
        first = params[0]
        self.tail = 0 if sharded else comm.SUM_STAMP_NUMEL  # full ends with a stamp's room,
        self.stamped = None  # and a weakref to the reduced buffer its .grads view: reduce_grads
        self.dtype, self.requires_grad = first.dtype, first.requires_grad  # dtype: the master's
        self.param_dtype = param_dtype or first.dtype             # what the module computes in
        self.params, self.locals = [], []  # the user parameters (adopt), their local tensors
        self.pending: comm.Handle | None = None  # a gather into full not landed yet

        # Parameters on the meta device have no values yet (deferred init): what this rank
        # keeps is laid out on ``device`` as zeros, and deferred_init.py fills it in.
        deferred = first.is_meta
        cast = self.param_dtype != self.dtype
        if mode.under_cast(cast) is not mode:
            raise ValueError(f"FlatBuffer {name!r}: a {mode.name} shard cannot hold the master "
                             f"dtype in a {self.param_dtype} full buffer; build the mode "
                             "FlatMode.under_cast() gives")
        # this rank's shard when it has storage of its own (mode OWN; at stage 0 under a cast,
        # the whole fp32 parameters); None when the user parameters are views of full
        self.shard: torch.Tensor | None = None
        if deferred and mode is FlatMode.OWN:  # only the shard, no full-size zeros
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
            values = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
            values.untyped_storage().resize_(0)  # allocated and freed at once, never touched
        else:
            with torch.no_grad():
                values = torch.zeros(self.padded_numel + self.tail, dtype=self.dtype,
                                     device=device if deferred else first.device)
                for j, p in enumerate([] if deferred else params):
                    self.param_in(values, j).copy_(p.detach().view(self.shapes[j]))
                for j in self.scalars:  # every rank's one-element chunk holds it
                    self.region(values, j)[1:] = self.region(values, j)[0]
        if mode is FlatMode.OWN and self.shard is None:
            self.shard = self.shard_of(values, self.chunk)
            values = values.to(self.param_dtype)
        elif cast and mode is FlatMode.REPLICATED:  # mixed precision: fp32 master, cast full
            self.shard, values = values, values.to(self.param_dtype)
        self.full = values.requires_grad_(self.requires_grad)
        self.full_bytes = values.numel() * values.element_size()  # full's storage, gathered
        self.current = False  # full holds the shards as they are now (needs_gather)
        # stages 1-3: each user parameter's DTensorSpec in the master dtype, made once (as_user)
        self.dspecs = [spec.of(shape, self.dtype) for shape in self.shapes] if spec else []

    # ----------------------------------------------------------------- the user parameters
    def shard_views(self) -> list[torch.Tensor]:
        """This rank's rows of each parameter, shaped like its shard, as views of the storage
        that holds them (``shard`` in mode OWN, else full's layout): the user parameters'
        local tensors."""
        source = self.full.data if self.shard is None else self.shard
        out = []
        for j, ((lo, hi), m) in enumerate(zip(self.row_ranges, self.row_numels)):
            n = (hi - lo) * m
            if self.mode is FlatMode.OWN:
                piece = self.shard[self.offsets[j]:self.offsets[j] + n]
            else:  # this rank's chunk of the parameter's region (REPLICATED: the whole of it)
                piece = self.region(source, j)[self.chunk][:n]
            out.append(piece.view(self.shard_shape(j)))
        return out

    def adopt(self, originals: list[nn.Parameter]) -> list[nn.Parameter]:
        """The user parameters: at stages 1-3 a new ``nn.Parameter`` per original, a DTensor
        of this rank's rows (params.py); at stage 0 the original itself, re-pointed
        (``p.data``) at its view of ``full``, unless it cannot be (on the meta device, or on
        another device or dtype). A gradient from before wrapping keeps this rank's rows."""
        self.params, self.locals = [], self.shard_views()
        for j, (p, view) in enumerate(zip(originals, self.locals)):
            grad = None if p.is_meta else p.grad
            if self.spec is None and (p.device, p.dtype) == (view.device, view.dtype) \
                    and not p.is_meta:
                p.grad = None
                p.data = view
            else:
                p = nn.Parameter(self.as_user(j, view), requires_grad=p.requires_grad)
            if grad is not None:
                p.grad = self.as_user(j, self.my_rows(j, grad).clone())
            self.params.append(p)
        return self.params

    def as_user(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``rows`` of parameter j (or of its gradient, or state shaped like it) as
        the user sees them: a DTensor at stages 1-3, the plain tensor at stage 0."""
        if self.spec is None or rows.dtype != self.dtype:  # (state in another dtype: its spec)
            return rows if self.spec is None else self.spec.wrap(rows, self.shapes[j])
        return DTensor(rows, self.dspecs[j], requires_grad=False)  # rows or a gradient's

    def mark_stale(self) -> None:
        """The shards were written outside a step (a load): the next use of ``full`` gathers it
        first, as after unit.py's ``to_sharded``. No version counter is trusted: a foreach op
        or a write through ``.data`` on a DTensor moves none."""
        self.current = False

    # ----------------------------------------------------------------------- full's storage
    def unsharded_views(self, detached: bool = False) -> list[torch.Tensor]:
        """The parameters as views of ``full`` (detached if frozen or ``detached``): ONE split
        into [p1, pad1, p2, ...], whose backward fills ``full.grad`` in one pass (a slice each
        would build a zero full-size gradient per parameter)."""
        sizes = [s for n, w in zip(self.numels, self.widths) for s in (n, self.chunks * w - n)]
        sizes.append(self.tail)  # the stamp's room, if any: [::2] picks it, zip drops it
        out = []
        for j, (piece, shape) in enumerate(zip(torch.split(self.full, sizes)[::2], self.shapes)):
            frozen = self.params and not self.params[j].requires_grad
            out.append(piece.detach().view(shape) if frozen or detached else piece.view(shape))
        return out

    def held_bytes(self) -> int:
        """Bytes of storage this buffer holds now: ``full`` (if not freed) and ``shard``."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (self.full, self.shard) if t is not None}
        return sum(storages.values())

    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    @property
    def needs_gather(self) -> bool:
        """Must a gather refresh ``full`` before the module reads it? Never when full IS the
        parameters (stage 0 without a cast); else when it is freed, or when the shards were
        handed back to the user since it was gathered (unit.py: ``to_sharded``)."""
        if self.mode is FlatMode.REPLICATED and self.shard is None:
            return False
        return not self.is_gathered or not self.current

    def mark_current(self) -> None:
        """``full`` holds the current shards, or will when the gather starting now lands: a
        gather still pending into it lands first (an older one landing after a newer one would
        leave stale values marked current), and its storage comes back if it was freed."""
        self.wait()
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full_bytes)
        self.current = True

    def wait(self) -> None:
        """Land the gather into ``full`` still in flight, if any."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    # ------------------------------------------------------------------------------ gradients
    def take_grad(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Detach ``full.grad`` from the buffer (freeing it here) in the dtype to reduce in. A
        rank that computed no gradient for this buffer sends zeros: every rank must join every
        collective."""
        grad = self.full.grad
        if grad is None:
            grad = torch.zeros(self.full.numel(), dtype=self.param_dtype, device=self.full.device)
        self.full.grad = None
        return grad if dtype is None or grad.dtype == dtype else grad.to(dtype)

    def add_shard_grad(self, piece: torch.Tensor) -> None:
        """Accumulate this rank's reduced ``piece`` (k elements, or the whole buffer in mode
        REPLICATED) into the user parameters' ``.grad`` (views of it, padding dropped, in the master
        dtype). A frozen parameter's grad stays None."""
        for j, (p, rows) in enumerate(zip(self.params, self.locals)):
            if not p.requires_grad:
                continue
            g = piece[self.offsets[j]:self.offsets[j] + rows.numel()].view(rows.shape)
            g = g.to(self.dtype)
            if p.grad is None:
                p.grad = self.as_user(j, g)
            else:
                local(p.grad).add_(g)


def collective_key(flat: FlatBuffer) -> tuple:
    """Buffers with equal keys may share one collective: one compute dtype, and all sharded
    (over their shard group) or all whole (mode REPLICATED: stage 0, or ``ZeRO(replicate=...)``'s
    buffers, over every rank)."""
    return flat.param_dtype, flat.mode is FlatMode.REPLICATED


# ------------------------------------------------------------------------------- the bytes
# [Note: the cut] Padding costs up to (N-1) rows per parameter (``padded_numel - numel``
# elements, moved by every collective and held by stage 3's ``full``; tests/test_zero.py asserts
# the bytes). The price of copy-in/copy-out is one copy of the unit's bytes per gather and per
# reduction (none when a unit has one parameter, or N = 1; FSDP2 always copies). FSDP1 and
# DeepSpeed's stages 1-2 cut the concatenation instead (rank 0 = [a0 a1 a2 b0 b1]...): no copy,
# but 1-D pieces across parameter boundaries lose names, shapes and per-parameter freezing.
# DeepSpeed's ZeRO-3 cuts each parameter on its own, flattened to 1-D: elements, not rows.
# One collective for several buffers (a unit's, or a bucket's) instead of one each: on gloo,
# with ~1 MiB buffers, the per-call cost is most of the time; the price is a staging buffer.

def copy_in(flats: list[FlatBuffer], grads: list[torch.Tensor], send: torch.Tensor) -> None:
    """Full-layout gradients of ``flats`` into ``send`` (N x their k's, rank-major): row r is
    what rank r receives. One op; then a replicated 0-dim parameter's column (its gradient sits
    in rank 0's chunk, where the module's view is) is copied to every rank's row."""
    torch.cat([region for f, g in zip(flats, grads) for region in f.regions(g)], dim=1, out=send)
    start = 0
    for flat in flats:
        for j in flat.scalars:
            send[1:, start + flat.offsets[j]] = send[0, start + flat.offsets[j]]
        start += flat.shard_numel


def identity(flats: list[FlatBuffer]) -> str:
    """What one collective of ``flats`` is, equal on every rank that issues it: every buffer's
    name and the model's number ([Note: stamps] in checks.py)."""
    return f"{'+'.join(f.name for f in flats)} (model {flats[0].model})"


def land(flats: list[FlatBuffer], staging: torch.Tensor, work, k: int) -> None:
    """After a gather (comm checked its stamps): ``staging[:, :k]`` into each flat's ``full``,
    one op: parameter j's region of full, viewed (N, width_j), is columns of j."""
    work.wait()
    torch.split_with_sizes_copy(staging[:, :k], [w for f in flats for w in f.widths], dim=1,
                                out=[region for f in flats for region in f.regions(f.full.data)])


# [Note: one gather] ``gather_params`` all-gathers several buffers (one unit's, or a bucket's)
# in ONE collective, each rank's row its shards side by side, then the room comm stamps::
#
#     flat A (k=2), flat B (k=3):   this rank's row of staging = [A's shard, B's shard, stamp]
#     staging (N x (5+s)) after the gather:  rank 0 [a0 a1 b0 b1 b2 | stamp]
#                                            rank 1 [a2 a3 b3 b4 b5 | stamp]
#     comm checks the stamps agree; A's full from staging[:, 0:2], B's from staging[:, 2:5]
#
# The handle is left in each flat's ``pending``: any flat's ``wait()`` (or the next gather into
# it) lands them all. One buffer at N = 1: full is its shard, no staging.
def gather_params(flats: list[FlatBuffer], async_op: bool = False) -> comm.Handle:
    """All-gather the shards of ``flats`` (same group, one compute dtype) into their ``full``
    buffers in one collective ([Note: one gather]); at stage 0 under a cast it is the cast."""
    first, rank, tag = flats[0], flats[0].rank, identity(flats)
    with torch.no_grad():
        for flat in flats:
            flat.mark_current()
        if first.mode is FlatMode.REPLICATED:  # every rank holds all of it in fp32
            for flat in flats:
                flat.full.data.copy_(flat.shard)
            return comm.Handle()
        if len(flats) == 1 and first.chunks == 1:  # one rank: full is its shard
            mine = first.full.data.view(1, -1)[0]
            if first.shard is not None:
                mine.copy_(first.shard)
            handle = comm.all_gather(first.full.data, mine, first.group, async_op=True, tag=tag)
        else:
            k = sum(f.shard_numel for f in flats)
            staging = first.full.new_empty(first.chunks,
                                           k + comm.STAMP_BYTES // first.full.element_size())
            # this rank's part: each buffer's own shard, or its row of each region of full
            torch.cat([p for f in flats for p in ([f.shard] if f.shard is not None else
                                                  [r[f.chunk] for r in f.regions(f.full.data)])],
                      out=staging[rank, :k])
            work = comm.all_gather(staging, staging[rank], first.group, async_op=True, tag=tag,
                                   stamped=True)
            handle = comm.Handle(then=lambda: land(flats, staging, work, k))
    for flat in flats:
        flat.pending = handle
    if not async_op:
        for flat in flats:
            flat.wait()
    return handle


# [Note: one reduction] ``reduce_grads`` averages several buffers' full gradients in ONE
# collective. Mode REPLICATED (DDP): an all-reduce of the joined gradients, ending with room for
# comm's stamp (full's tail). Otherwise a reduce-scatter, after which each rank keeps its k
# elements of every buffer; for that, each rank's pieces of the buffers sit side by side in the
# buffer sent (rank-major, :func:`copy_in`)::
#
#     flat A (k=2): rows [a0 a1 | a2 a3]       flat B (k=3): rows [b0 b1 b2 | b3 b4 b5]
#     send  = [a0 a1 b0 b1 b2 | a2 a3 b3 b4 b5]      (each N x k, joined on dim 1)
#     rank 0 receives [a0 a1 b0 b1 b2]: its piece of A, then of B; rank 1 the other half.
#
# With replicas (hybrid sharding), waiting also all-reduces (avg) the reduced pieces across them:
# the mean of S-rank means over R replicas is the mean over all R·S ranks.
def reduce_grads(flats: list[FlatBuffer], reduce_dtype: torch.dtype | None = None) -> comm.Handle:
    """Average the full gradients of ``flats`` (same group and mode) over the ranks in one
    collective ([Note: one reduction]) into their user parameters' ``.grad``: a handle."""
    first, tag = flats[0], identity(flats)
    grads = [f.take_grad(reduce_dtype) for f in flats]
    if first.mode is FlatMode.REPLICATED:  # joined, one stamp's room at the end (full's tail)
        out = grads[0] if len(grads) == 1 else torch.cat(
            [g[:f.padded_numel] for f, g in zip(flats, grads)] + [grads[-1][-first.tail:]])
        handle = comm.all_reduce(out, "avg", first.group, async_op=True, tag=tag, stamped=True)
        sizes = [f.padded_numel for f in flats]
    else:
        if len(flats) == 1 and first.same_layout:
            send = grads[0]
        else:
            send = grads[0].new_empty(first.chunks, sum(f.shard_numel for f in flats))
            copy_in(flats, grads, send)
        out = send.new_empty(sum(f.shard_numel for f in flats))
        handle = comm.reduce_scatter(out, send.reshape(-1), "avg", first.group, async_op=True,
                                     tag=tag)
        sizes = [f.shard_numel for f in flats]

    def deliver() -> None:
        handle.wait()
        if first.replicate_group is not None:  # issued at the same program point on every rank
            _average_across(out, first.replicate_group, f"{tag} (replicas)")
        for flat, piece in zip(flats, torch.split(out[:sum(sizes)], sizes)):
            if flat is flats[-1] and flat.tail and out.dtype == flat.dtype and all(
                    p.grad is None for p in flat.params):  # its .grad views hold the room
                flat.stamped = weakref.ref(out)            # (memory_report counts it)
            flat.add_shard_grad(piece)

    return comm.Handle(then=deliver)


def _average_across(out: torch.Tensor, group, tag: str) -> None:
    """Hybrid sharding: ``out`` (this rank's reduced pieces) averaged over its replicas, with
    room for comm's stamp (a copy: out's own storage keeps no room)."""
    send = torch.cat([out, out.new_empty(comm.SUM_STAMP_NUMEL)])
    comm.all_reduce(send, "avg", group, tag=tag, stamped=True)
    out.copy_(send[:out.numel()])
