"""FlatBuffer: one unit's parameters as views into one padded 1-D buffer, and this rank's shard of it.

The layout, for parameters a (3x2), b (3), c (5) and a group of 4 ranks::

    full  = [a a a a a a b b b c c c c c | pad pad]      numel 14, padded to 16 = 4 ranks x k=4
             0           6     9          14    16
    rank 0 owns full[0:4]    a a a a
    rank 1 owns full[4:8]    a a b b
    rank 2 owns full[8:12]   b c c c
    rank 3 owns full[12:16]  c c | pad pad   -> its shard Parameter holds only the 2 real elements

  * ``full`` is a leaf tensor; while it is gathered, the module's ``a``, ``b``, ``c`` are
    ``torch.split`` views of it, so autograd sums their gradients into ``full.grad`` in one
    concatenation (one flat gradient per unit, ready to reduce in one collective).
  * ``shard`` is the ``nn.Parameter`` the optimizer sees: this rank's slice, *without* padding, so
    padding never reaches the optimizer's math, a norm or a state dict. Collectives need equal
    sizes on every rank, so they move the padded slice (``k`` elements); padding stays zero.

Where the tensors live is the buffer's :class:`FlatMode` (zero.py's stage table picks it):

    mode      full params              shard Parameter                        optimizer sees
    NONE      always (it IS the param)  full itself, unpadded                  the whole flat
    VIEW      always                    a view of full's own slice (no copy)   the shard
    OWN       only while gathered       its own storage, padded to k           the shard

``replicate_group`` (hybrid sharding on a 2-D mesh): the buffer is cut across ``group`` (the ranks
of one node, say) and that whole group is replicated R times (once per node). Replicas hold identical
shards; gathers stay inside ``group``; a gradient is reduce-scattered (avg) inside ``group``, then
this rank's k-element slice is all-reduced (avg) across its replicas, so it ends up as the mean
over all R·S ranks, having crossed nodes only as a 1/S-sized piece::

    per rank per step, stage 3:  3Ψ(S-1)/S inside the group  +  2(Ψ/S)(R-1)/R across replicas

``mixed precision`` (``param_dtype``): full is kept in the compute dtype and the shard is an fp32
master copy with storage of its own; gathers send the shard cast to ``param_dtype``. So a VIEW
buffer becomes OWN under a cast, decided where it is built (:meth:`FlatMode.under_cast`).
"""
from __future__ import annotations

import enum
import math

import torch
from torch import nn

from minishard import comm

__all__ = ["FlatMode", "FlatBuffer", "gather_params", "reduce_grads"]


class FlatMode(str, enum.Enum):
    """Where a flat buffer's full tensor and shard live (the table in the module docstring).
    A ``str`` enum: ``FlatMode.VIEW == "view"``, so the old spellings still compare equal."""
    NONE = "none"  # not sharded (stage 0): full IS the parameter
    VIEW = "view"  # full always kept; the shard is a view of this rank's slice of it
    OWN = "own"    # the shard owns its storage; full exists only while gathered

    def under_cast(self, cast: bool) -> "FlatMode":
        """The mode to build when full holds another dtype than the master (mixed precision):
        a bf16 full buffer cannot hold the fp32 master, so a VIEW shard must own its storage."""
        return FlatMode.OWN if self is FlatMode.VIEW and cast else self


class FlatBuffer:
    """The parameters ``params`` of one unit (one dtype, one requires_grad) flattened into
    ``full``, this rank's ``shard`` of it, and the collectives that move between the two
    (the layout and the three modes are drawn in the module docstring)."""

    def __init__(self, params: list[torch.Tensor], group=None, *, mode: FlatMode | str = "own",
                 param_dtype: torch.dtype | None = None, name: str = "",
                 replicate_group=None, device: torch.device | None = None) -> None:
        mode = FlatMode(mode)
        assert mode is not FlatMode.NONE or replicate_group is None, \
            "stage 0 reduces over every rank at once"
        self.group, self.mode, self.name = group, mode, name
        self.replicate_group = replicate_group  # hybrid sharding: the ranks holding our shard too
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        first = params[0]
        self.dtype = first.dtype                                  # the master (shard) dtype
        self.param_dtype = param_dtype or first.dtype             # what the module computes in
        self.requires_grad = first.requires_grad
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        ranks = 1 if mode is FlatMode.NONE else self.world
        self.padded_numel = math.ceil(self.numel / ranks) * ranks
        self.shard_numel = self.padded_numel // ranks               # k: what each rank sends
        start = 0 if mode is FlatMode.NONE else self.rank * self.shard_numel
        self.shard_start = start
        self.shard_real = max(0, min(self.shard_numel, self.numel - start))  # without padding

        # Parameters on the meta device have no values yet (deferred init, units.py): what this
        # rank keeps is laid out on ``device`` as zeros, and write_param() fills it in.
        deferred = first.is_meta
        cast = self.param_dtype != self.dtype
        if mode.under_cast(cast) is not mode:
            raise ValueError(f"FlatBuffer {name!r}: a {mode.name} shard cannot hold the master "
                             f"dtype in a {self.param_dtype} full buffer; build the mode "
                             "FlatMode.under_cast() gives")
        with torch.no_grad():
            if deferred:  # mode OWN keeps only the shard: no full-size zeros for it
                values = None if mode is FlatMode.OWN else torch.zeros(
                    self.padded_numel, dtype=self.dtype, device=device)
            else:
                values = torch.zeros(self.padded_numel, dtype=self.dtype, device=first.device)
                torch.cat([p.detach().reshape(-1) for p in params], out=values[:self.numel])
        if mode is FlatMode.NONE:
            self.full = nn.Parameter(values if not cast else values.to(self.param_dtype),
                                     requires_grad=self.requires_grad)
            self.shard = self.full if not cast else nn.Parameter(values, self.requires_grad)
            self._shard_padded = self.shard.data
        elif mode is FlatMode.VIEW:
            self.full = values.requires_grad_(self.requires_grad)
            self._shard_padded = self.full.data[start:start + self.shard_numel]
            self.shard = nn.Parameter(self._shard_padded[:self.shard_real], self.requires_grad)
        else:
            if values is None:  # deferred: full is allocated and freed at once, never touched
                self._shard_padded = torch.zeros(self.shard_numel, dtype=self.dtype,
                                                 device=device)
                values = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
                values.untyped_storage().resize_(0)
            else:
                self._shard_padded = values[start:start + self.shard_numel].clone()
            self.full = values.to(self.param_dtype).requires_grad_(self.requires_grad)
            self.shard = nn.Parameter(self._shard_padded[:self.shard_real], self.requires_grad)
        self._gathered_version = self.shard._version
        self._pending = None  # an async gather in flight

    # ------------------------------------------------------------------------------- layout
    def views(self) -> list[torch.Tensor]:
        """The parameters, shaped as the module expects, as views of ``full`` (autograd-aware)."""
        pieces = torch.split(self.full, self.numels + [self.padded_numel - self.numel])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Unpadded full ``values`` (``numel`` elements, e.g. gathered masters) as views shaped
        like the parameters."""
        return [piece.view(shape) for piece, shape in zip(torch.split(values, self.numels),
                                                          self.shapes)]

    def detached_views(self) -> list[torch.Tensor]:
        """:meth:`views` outside autograd: what the module shows between steps."""
        with torch.no_grad():
            return [v.detach() for v in self.views()]

    def held_range(self) -> tuple[int, int]:
        """The unpadded range [lo, hi) of the flat that the shard Parameter holds (NONE: all)."""
        if self.mode is FlatMode.NONE:
            return 0, self.numel
        lo = min(self.shard_start, self.numel)
        return lo, lo + self.shard_real

    def full_bytes(self) -> int:
        return self.padded_numel * self.full.element_size()

    def set_requires_grad(self, requires_grad: bool) -> None:
        """Freeze (False) or unfreeze the whole buffer: its full tensor and its shard. A frozen
        buffer gets no gradient, so the optimizer skips its shard (no step, no weight decay)."""
        self.requires_grad = requires_grad
        self.full.requires_grad_(requires_grad)
        self.shard.requires_grad_(requires_grad)

    def held_bytes(self) -> int:
        """Bytes of storage this buffer holds now: ``full`` (if not freed) and the shard's own."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (self.full, self._shard_padded)}
        return sum(storages.values())

    def write_param(self, j: int, value: torch.Tensor) -> None:
        """Store parameter ``j``'s whole ``value`` (every rank has it) where this rank keeps it:
        all of it into ``full`` while ``full`` is kept (cast to the compute dtype), and the part
        that falls in this rank's slice ``[shard_start, shard_start + k)`` into the shard::

            param j = flat[a:b]     shard = flat[s:s+k]     shard[lo-s:hi-s] = value[lo-a:hi-a]
                                                            lo, hi = max(a, s), min(b, s+k)

        Used by deferred init (units.py), one parameter at a time: no rank ever needs the
        whole flat buffer to fill its shard."""
        a = sum(self.numels[:j])
        b, flat_value = a + self.numels[j], value.detach().reshape(-1)
        with torch.no_grad():
            if self.is_gathered:
                self.full.data[a:b].copy_(flat_value)
            s = self.shard_start
            lo, hi = max(a, s), min(b, s + self._shard_padded.numel())
            if lo < hi:
                self._shard_padded[lo - s:hi - s].copy_(flat_value[lo - a:hi - a])
        if self.is_gathered:
            self._gathered_version = self.shard._version  # full and shard agree: not stale

    # ---------------------------------------------------------------------- full param storage
    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    @property
    def is_stale(self) -> bool:
        """True when the shard changed (an optimizer step) since ``full`` was last gathered."""
        return self.shard is not self.full and self.shard._version != self._gathered_version

    @property
    def needs_gather(self) -> bool:
        """``full`` is freed, or older than the shard: a gather must refresh it."""
        return not self.is_gathered or self.is_stale

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into ``full`` (allocating it if it was freed)."""
        if self.mode is FlatMode.NONE and self.param_dtype == self.dtype:
            return
        self._start_gather()
        with torch.no_grad():
            if self.mode is FlatMode.NONE:  # mixed precision without sharding: just cast
                self.full.data.copy_(self.shard.data)
            else:
                self._pending = comm.all_gather(self.full.data, self._send(), self.group,
                                                async_op=async_op, tag=self.name)

    def _start_gather(self) -> None:
        """Make room in ``full`` (if it was freed) and mark it as holding the current shards.
        A gather still pending into this buffer lands first: an older gather landing after a
        newer one would leave stale values marked current."""
        self.wait()
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full_bytes())
        self._gathered_version = self.shard._version

    def _send(self) -> torch.Tensor:
        """What this rank contributes to a gather: its padded shard, in the compute dtype."""
        return self._shard_padded.to(self.param_dtype)

    def wait(self) -> None:
        """Finish an async :meth:`gather`."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def free(self) -> None:
        """Release ``full``'s storage (stage 3). Views saved by autograd keep pointing at the same
        storage object, so the next :meth:`gather` refills them in place before backward."""
        self.wait()
        self.full.untyped_storage().resize_(0)

    def push_to_shard(self) -> None:
        """Copy this rank's slice of ``full`` into the shard (after someone edited ``full``)."""
        with torch.no_grad():
            if self.mode is not FlatMode.VIEW:  # a VIEW shard already IS that slice
                sl = self.full.data[self.shard_start:self.shard_start + self.shard_real]
                self.shard.data.copy_(sl)
        self._gathered_version = self.shard._version

    def gather_shards(self, shard_like: torch.Tensor, what: str = "state dict") -> torch.Tensor:
        """Every rank's ``shard_like`` (shaped like this rank's shard: the master values, or an
        optimizer state such as Adam's ``exp_avg``) joined into a new tensor of ``numel``
        elements, no padding: what state dicts need, whatever the stage or mixed precision."""
        if self.mode is FlatMode.NONE:  # every rank already holds all of it
            return shard_like.detach()[:self.numel].clone()
        send = shard_like.new_zeros(self.shard_numel)  # collectives need equal sizes: pad to k
        send[:self.shard_real] = shard_like.detach()
        out = shard_like.new_empty(self.padded_numel)
        comm.all_gather(out, send, self.group, tag=f"{self.name} ({what})")
        return out[:self.numel]

    def load_master(self, values: torch.Tensor, only_if_changed: bool = False) -> None:
        """Set the master values from the full, unpadded ``values`` (each rank keeps its slice).
        ``only_if_changed``: leave the shard (and its version: no re-gather) if equal."""
        with torch.no_grad():
            mine = values[self.shard_start:self.shard_start + self.shard_real]
            mine = mine.reshape(self.shard.shape).to(self.dtype)
            if not (only_if_changed and torch.equal(mine, self.shard)):
                self.shard.copy_(mine)

    # ------------------------------------------------------------------------------ gradients
    def take_grad(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Detach ``full.grad`` from the buffer (freeing it here) in the dtype to reduce in. A
        rank that computed no gradient for this buffer sends zeros: every rank must join every
        collective."""
        grad = self.full.grad
        if grad is None:
            grad = torch.zeros(self.padded_numel, dtype=self.param_dtype, device=self.full.device)
        self.full.grad = None
        return grad if dtype is None or grad.dtype == dtype else grad.to(dtype)

    def add_shard_grad(self, piece: torch.Tensor) -> None:
        """Accumulate this rank's reduced slice (``piece``: k elements, or the whole flat in mode
        NONE) into ``shard.grad``, padding dropped, in the master dtype."""
        g = (piece if self.mode is FlatMode.NONE else piece[:self.shard_real]).to(self.dtype)
        if self.shard.grad is None:
            self.shard.grad = g
        else:
            self.shard.grad.add_(g)


def gather_params(flats: list[FlatBuffer]) -> comm.Handle:
    """Start ONE async all-gather that refreshes the full buffers of all ``flats`` (same group,
    sharded, one compute dtype); any one flat's ``wait()`` (or the next gather into it) lands it
    for all of them. Returns the shared handle.

    The ranks' shards travel side by side through a staging buffer, and are copied out::

        flat A (k=2), flat B (k=3):   send = [A's shard, B's shard]            (5 elements)
        staging (N x 5) after the gather:  rank 0 [a0 a1 b0 b1 b2]
                                           rank 1 [a2 a3 b3 b4 b5]
        A.full = staging[:, 0:2] read row by row = [a0 a1 a2 a3]; B.full = staging[:, 2:5]

    One collective instead of one per buffer: on gloo, with ~1 MiB buffers, the per-call cost is
    most of the time. The price is the staging buffer and one copy of the gathered bytes."""
    if len(flats) == 1:
        flats[0].gather(async_op=True)
        return flats[0]._pending or comm.Handle()
    first = flats[0]
    with torch.no_grad():
        for flat in flats:
            flat._start_gather()
        n, r = first.world, first.rank
        staging = first.full.new_empty(n, sum(f.shard_numel for f in flats))
        torch.cat([f._send() for f in flats], out=staging[r])  # this rank's row, in place
        handle = comm.all_gather(staging, staging[r], first.group, async_op=True,
                                 tag="+".join(f.name for f in flats))

    def land() -> None:
        handle.wait()
        pieces = torch.split(staging, [f.shard_numel for f in flats], dim=1)
        for flat, piece in zip(flats, pieces):
            rows = flat.full.data.view(n, -1)
            for j in range(n):
                if j != r or flat.mode is not FlatMode.VIEW:  # a VIEW shard IS row r already
                    rows[j].copy_(piece[j])

    shared = comm.Handle(then=land)
    for flat in flats:
        flat._pending = shared
    return shared


def reduce_grads(flats: list[FlatBuffer], reduce_dtype: torch.dtype | None = None) -> comm.Handle:
    """Average the full gradients of ``flats`` (same group and mode) over the ranks in ONE
    collective, into each one's ``shard.grad``; returns a handle to wait on. With replicas
    (hybrid sharding), waiting also all-reduces (avg) the reduced slices across them: the mean
    of S-rank means over R replicas is the mean over all R·S ranks.

    Mode NONE (DDP): an all-reduce of the concatenated gradients. Otherwise a reduce-scatter,
    after which each rank keeps its slice of every buffer. For that, each rank's slices of the
    buffers must sit side by side in the buffer we send::

        flat A (k=2): [a0 a1 | a2 a3]          flat B (k=3): [b0 b1 b2 | b3 b4 b5]
        send  = [a0 a1 b0 b1 b2 | a2 a3 b3 b4 b5]      (each viewed as N x k, joined on dim 1)
        rank 0 receives [a0 a1 b0 b1 b2]: A's shard, then B's; rank 1 the other half.

    One collective for several small buffers costs one per-call latency instead of several.
    """
    first = flats[0]
    grads = [f.take_grad(reduce_dtype) for f in flats]
    tag = "+".join(f.name for f in flats)
    if first.mode is FlatMode.NONE:
        send = grads[0] if len(grads) == 1 else torch.cat(grads)
        handle = comm.all_reduce(send, "avg", first.group, async_op=True, tag=tag)
        out, sizes = send, [f.padded_numel for f in flats]
    else:
        n = first.world
        send = grads[0] if len(grads) == 1 else torch.cat([g.view(n, -1) for g in grads], 1)
        out = send.new_empty(sum(f.shard_numel for f in flats))
        handle = comm.reduce_scatter(out, send.reshape(-1), "avg", first.group, async_op=True,
                                     tag=tag)
        sizes = [f.shard_numel for f in flats]

    def land() -> None:
        handle.wait()
        if first.replicate_group is not None:  # issued at the same program point on every rank
            comm.all_reduce(out, "avg", first.replicate_group, tag=f"{tag} (replicas)")
        for flat, piece in zip(flats, torch.split(out, sizes)):
            flat.add_shard_grad(piece)

    return comm.Handle(then=land)
