r"""SyncBatchNorm: BatchNorm whose statistics cover the batch of every rank in a process group.

It normalises with the statistics of the GLOBAL batch, so N ranks with batch b compute exactly
what one process computes on a batch of N*b. Per layer of C channels, x this rank's (N_r, C, *)
input, n the global count of values per channel, Σ over all ranks and all dims but C::

    forward   x0 = this rank's mean, t = x - x0: of the spread's size, its sums cancel nothing
              n_r, m_r, M2_r: this rank's count, mean and Σ(x - m_r)², from t
              [n_r·m_r, M2_r + n_r·m_r², n_r]  --all_reduce(SUM), float64-->  [S, Q, n]
              mean = S/n   M2 = Q - S·mean   var = M2/n   invstd = 1/sqrt(var + eps)
              pass 2 if (3N+5)·u·Q > u_in·M2 in ANY channel (u, u_in: the rounding units of
              float64 and of t's dtype), i.e. Q - S·mean may have cancelled (float64 inputs
              always, float32 and half ones when |mean|/std > ~5e3):
              [n_r·d_r, M2_r + n_r·d_r²], d_r = m_r - mean  --all_reduce(SUM)-->  [D, E]
              mean += D/n   M2 = E - D²/n
              y = (x - mean)·invstd·w + b, computed as t·scale + (b - c0·scale), c0 = mean - x0
    backward  [Σdy, Σdy·x̂]  --all_reduce(SUM), float64-->  [A, B]
              dx = w·invstd·(dy - A/n - x̂·B/n);   dw = Σdy·x̂, db = Σdy stay LOCAL (DDP averages)

Each collective is O(C) numbers whatever the world size (stock torch.nn.SyncBatchNorm
all-gathers O(C·N)), sent with comm's ``algorithm="auto"``: a few KiB go by the fewest messages
(recursive doubling or a direct exchange), not by the ring.

Every rank relies on ([Note: rules every rank relies on]): each rank calls each collective in the
same order, an empty rank too (with zeros); input checks are local and run before any collective;
a global count of one value per channel raises on every rank together; every rank's input has the
same dtype; each layer's name (its path, else ``#k``) is the same on every rank; eval mode sends
nothing. The elementwise work and its precision: [Note: elementwise work]. Why these formulas
(Chan et al.'s exact combination, the error bound that decides the second pass, the backward's
derivation): the end of tutorials/03_sync_batchnorm.py.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from minishard import comm, verdicts

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
           "name_sync_batchnorms"]


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """(1, C, 1, ...): the shape that broadcasts a per-channel vector against x."""
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Elementwise work and local statistics: float32 for half inputs, else the input's dtype."""
    return torch.promote_types(x.dtype, torch.float32)


def _per_channel(dtype: torch.dtype, shape, *vectors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 per-channel vectors, cast to ``dtype`` in ONE conversion and each shaped
    (1, C, 1, ...) so that it broadcasts against x (many tiny casts cost more than the arithmetic
    on small layers)."""
    return torch.stack(vectors).to(dtype).view(len(vectors), *shape).unbind()


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _sum_over_group(t: torch.Tensor, group, tag: str) -> None:
    """All-reduce (sum) a few statistics; a group of one has nothing to add."""
    if comm.group_size(group) > 1:
        comm.all_reduce(t, "sum", group=group, tag=tag, algorithm="auto")


def _channel_sums(a: torch.Tensor, b: torch.Tensor, shift: torch.Tensor | None = None):
    """Per channel (every dim but 1): ``(Σ a·(b - shift), Σ a)``, in float32 or better, in ONE
    pass over a and b and with no temporary of their size. ``shift`` (per channel, default 0) is
    subtracted in float32 or better, so b may be half precision. a and b must not be empty.

    This is the reduction half of torch's own BatchNorm backward kernel, which returns
    grad_weight = Σ dy·(x - mean)·invstd and grad_bias = Σ dy: called with dy = a, x = b,
    mean = shift and invstd = 1. (Spelled out, ``(a * (b - shift)).sum(dims)`` makes two
    temporaries of a's size; on CPU each fresh one costs page faults, several times the
    arithmetic on a layer of a few hundred KiB.)"""
    dtype = torch.promote_types(b.dtype, torch.float32)
    if shift is None:
        shift = torch.zeros(b.shape[1], dtype=dtype, device=b.device)
    ones = torch.ones_like(shift)
    _, ab, a_sum = torch.ops.aten.native_batch_norm_backward(
        a.to(b.dtype), b, None, None, None, shift.to(dtype), ones, True, 0.0, [False, True, True])
    return ab, a_sum


def _local_shift(xa: torch.Tensor) -> torch.Tensor:
    """This rank's per-channel mean in xa's dtype (zeros if xa is empty): the value subtracted
    before any other statistics (module doc)."""
    if xa.numel() == 0:
        return torch.zeros(xa.shape[1], dtype=xa.dtype, device=xa.device)
    return xa.mean([0] + list(range(2, xa.dim())))


def _global_stats(t: torch.Tensor, x0: torch.Tensor, group, tag: str, suffix: str):
    """(n, mean, M2, c0) of the whole group's batch, per channel, float64: the two passes of the
    module doc, and c0 = mean - x0 for this rank's x0, formed without rounding the mean first.
    ``t`` is this rank's x - x0. One all_reduce unless the pass-1 sums cancel."""
    # (Every line here is a few operations on C numbers: on CPU each costs several us whatever
    # C is, so the code prefers one fused operation (addcmul: a + v·b·c) to two.)
    C = t.shape[1]
    n_r = t.numel() // C
    x0d = x0.double()
    if n_r:  # t is small: Σt² - n·mean(t)² has nothing left to cancel (module doc)
        sum_sq, sum_t = torch.stack(_channel_sums(t, t)).double().unbind()
        mean_t = sum_t / n_r
        M2_r = torch.addcmul(sum_sq, sum_t, mean_t, value=-1).clamp_min_(0)
    else:  # an empty rank: zeros, and it still joins every collective
        mean_t = M2_r = torch.zeros(C, dtype=torch.float64, device=t.device)
    m_r = x0d + mean_t  # this rank's mean

    S_r = n_r * m_r
    stats = torch.cat([S_r, torch.addcmul(M2_r, S_r, m_r), S_r.new_full((1,), n_r)])
    _sum_over_group(stats, group, f"{tag} forward{suffix}")
    S, Q, n = stats[:C], stats[C:2 * C], int(stats[2 * C])  # n: the one device->host read
    if n == 1:  # every rank sees the same n, so every rank raises here: no rank hangs
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size "
            f"{tuple(t.shape)} on this rank and 1 value per channel in total over the "
            f"{comm.group_size(group)} ranks of the process group. Use a larger batch, or "
            "call .eval() to normalise with the running statistics.")
    mean = S / n
    M2 = torch.addcmul(Q, S, mean, value=-1)
    c0 = mean - x0d if n else torch.zeros_like(mean)  # (n == 0: mean is NaN)

    # Pass 1's float64 error bound against one rounding unit of the local statistics (module
    # doc); every rank holds the same S, Q, n, so every rank takes the same branch.
    bound = ((3 * comm.group_size(group) + 5) * _unit_roundoff(torch.float64)
             / _unit_roundoff(t.dtype))
    if bool((bound * Q > M2).any()):
        d_r = (x0d - mean) + mean_t if n_r else mean_t  # m_r - mean, digits kept
        shifted = torch.cat([n_r * d_r, M2_r + n_r * d_r * d_r])
        _sum_over_group(shifted, group, f"{tag} forward{suffix} (second pass)")
        D, E = shifted[:C], shifted[C:]
        # mean + D/n, rounded, would err by u·|mean|; c0 adds D/n to (mean - x0) instead,
        # which is exact when mean and x0 are within a factor 2 (Sterbenz): what is left is
        # the rounding of a number of the spread's size.
        c0 = c0 + D / n
        mean = mean + D / n
        M2 = E - D * D / n
    return n, mean, M2, c0


# [Note: elementwise work] Elementwise work runs in the compute dtype (float32 for half inputs,
# else the input's: its rounding unit is u_in), on t: y = t·scale + (b - c0·scale),
# c0 = mean - x0, with the per-channel constants formed in float64 and rounded once, so the mean
# is never rounded to the compute dtype (let alone to a half-precision input's) before it is
# subtracted. Nor to float64: after the second pass c0 = (mean - x0) + D/n, not
# (mean + D/n) - x0, which would round a number of the mean's size and cost u·|mean| (a float64
# input with mean 1e6: 1e-10, ten times torch's own error). The output is in the input's dtype.
# The forward makes ONE tensor of the input's size (t, in which y is built; for half inputs its
# float32 copy plus the output): no float64 tensor of the input's size, only O(C) float64 values.
class SyncBatchNormFunction(torch.autograd.Function):
    """The math of the module doc: one all_reduce in forward (two when the sums cancel) and one in
    backward. ``tag`` and ``suffix`` name the layer in the ledger and in debug fingerprints:
    "{tag} forward{suffix}"."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, tag,
                suffix=""):
        shape, dtype = _channel_shape(x), _compute_dtype(x)
        # t = x - x0, x0 this rank's mean rounded to the compute dtype: the only tensor of x's
        # size made here (y is built in it). For half inputs: one float32 copy, shifted in place.
        xa = x if x.dtype == dtype else x.to(dtype)
        x0 = _local_shift(xa)
        t = xa - x0.view(shape) if xa is x else xa.sub_(x0.view(shape))
        n, mean, M2, c0 = _global_stats(t, x0, group, tag, suffix)
        var = (M2 / n).clamp_min_(0)  # clamp: rounding may leave a tiny negative
        invstd = (var + eps).rsqrt_()

        if running_mean is not None and n > 0:  # n == 0 (every rank empty): leave them, as stock
            m = momentum
            running_mean.mul_(1 - m).add_(mean.to(running_mean.dtype), alpha=m)
            running_var.mul_(1 - m).add_((var * (n / (n - 1))).to(running_var.dtype), alpha=m)

        # y = (x - mean)·scale + b = t·scale + (b - c0·scale), c0 = mean - x0: the large common
        # part x0 is already gone from t, and c0 is small and formed in float64 without the
        # mean's own rounding, so the mean is never rounded before it is subtracted.
        scale = invstd if weight is None else invstd * weight.double()
        shift = -c0 * scale if bias is None else torch.addcmul(bias.double(), c0, scale, value=-1)
        scale, shift = _per_channel(dtype, shape, scale, shift)
        y = t.mul_(scale).add_(shift)
        y = y if y.dtype == x.dtype else y.to(x.dtype)  # half inputs: back to their dtype

        ctx.save_for_backward(x, weight, x0, c0, invstd)
        ctx.n, ctx.group, ctx.tag, ctx.suffix = n, group, tag, suffix
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable  # the collective below is not differentiable: refuse double backward
    def backward(ctx, dy):
        x, weight, x0, c0, invstd = ctx.saved_tensors  # c0 = mean - x0
        C, shape, dtype = x.shape[1], _channel_shape(x), _compute_dtype(x)

        # The local parts of A and B: Σdy and Σdy·(x - x0), one fused pass in float32 or better
        # (dy·t is not normalised: its size is |dy|·std, so in float16 it would overflow);
        # then Σdy·(t - c0) in float64.
        if x.numel():
            sum_dy_t, sum_dy = _channel_sums(dy, x, x0)
            sums = torch.cat([sum_dy, sum_dy_t]).double()
        else:
            sums = torch.zeros(2 * C, dtype=torch.float64, device=x.device)
        sum_dy = sums[:C]
        sum_dy_xhat = torch.addcmul(sums[C:], c0, sum_dy, value=-1)
        if ctx.n:  # (every rank empty: invstd is NaN and the sums are 0; keep them 0)
            sum_dy_xhat.mul_(invstd)

        # Parameter gradients: LOCAL sums (DDP / ZeRO average them across ranks).
        dweight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None

        dx = None
        if ctx.needs_input_grad[0]:  # the same on every rank (same model), so all join or none
            AB = torch.cat([sum_dy, sum_dy_xhat])  # a new tensor: the local sums above survive
            _sum_over_group(AB, ctx.group, f"{ctx.tag} backward{ctx.suffix}")
            A, B = AB[:C], AB[C:]
            n = ctx.n
            k = invstd if weight is None else invstd * weight.double()
            minus_c = k * invstd * B / -n
            # dx = w·invstd·(dy - A/n - x̂·B/n) = dy·k - (t - c0)·c - k·A/n,  c = k·invstd·B/n
            minus_c, K, k_ = _per_channel(dtype, shape, minus_c,
                                          torch.addcmul(k * A / n, c0, minus_c), k)
            x0_ = x0.view(shape)
            t = x - x0_ if x.dtype == dtype else x.to(dtype).sub_(x0_)  # t, in dx's buffer
            dx = t.mul_(minus_c).sub_(K).addcmul_(dy, k_)
            dx = dx if dx.dtype == x.dtype else dx.to(x.dtype)
        return dx, dweight, dbias, None, None, None, None, None, None, None


_BUILT = itertools.count()  # SyncBatchNorm layers built in this process: the default names

# [Note: rules every rank relies on]
# * Every rank in the group calls the forward and (if the input needs a gradient) the backward
#   collective, in the same order. A rank with ZERO samples needs no special case: its sums are
#   zeros, it joins both collectives, and returns an empty output and zero parameter gradients.
# * The input checks (dims, channel count, dtype, group membership) are local and run BEFORE any
#   collective. If all ranks get the same bad input they all raise. If only one rank does, the
#   others wait in the collective until the process group times out: that is a bug in the
#   caller's code.
# * Only a GLOBAL count of one value per channel is an error (its variance is undefined). That
#   count is known only after the all_reduce, and every rank sees the same one, so all ranks
#   raise it together. Reading it costs one device-to-host copy per layer (stock syncs there too).
# * Every rank's input has the same dtype: it sets u_in, so it decides whether there is a second
#   pass (ranks with different dtypes would pair different collectives).
# * Every layer has a name all ranks agree on, in the ledger and in debug mode's fingerprints:
#   its path in the model (``convert_sync_batchnorm`` and ``name_sync_batchnorms`` set it), else
#   ``#k``, the k-th SyncBatchNorm built in this process (the same on every rank as long as every
#   rank builds the same layers in the same order). So a rank that runs layer #0 while another
#   runs layer #1 of the same shape is a CollectiveMismatch in debug mode, not statistics silently
#   paired across layers.
# * In eval mode there is no communication at all: the running statistics normalise (or, with
#   track_running_stats=False, each rank's own batch statistics, exactly as stock).


class SyncBatchNorm(_BatchNorm):
    """Drop-in for :class:`torch.nn.SyncBatchNorm` (same arguments, parameters, buffers and
    state_dict keys), built on :class:`SyncBatchNormFunction`; works on CPU/gloo as well as GPUs.

    Inputs (N, C, *) with 2 to 5 (or more) dims; channels_last inputs give channels_last outputs.
    Statistics are synchronised only in training mode with torch.distributed initialised; without
    it this is exactly ``F.batch_norm``, as in stock. A process group of one rank runs the same
    code as N ranks (the same precision), with nothing to communicate.

    ``tag`` names this layer in the comm ledger; ``convert_sync_batchnorm`` sets it to the layer's
    path in the model (also in ``path``). A layer without a path is named ``#k`` in collective
    tags: ``build_index``, the k-th SyncBatchNorm built in this process (see the module doc).
    ``original_class`` and ``last_input_dim`` tell ``revert_sync_batchnorm`` which BatchNormNd to
    go back to.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True) -> None:
        # Only pass `bias` when it matters: older torch releases have no such keyword.
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype, **({} if bias else {"bias": False}))
        self.process_group = process_group
        self.tag = f"SyncBatchNorm({num_features})"
        self.path: str | None = None
        self.build_index = next(_BUILT)
        self.original_class: type | None = None
        self.last_input_dim: int | None = None

    def _check_input_dim(self, x: torch.Tensor) -> None:
        """Local checks, run before any collective (see the module doc)."""
        if x.dim() < 2:
            raise ValueError(
                f"{self.tag}: expected at least 2D input (got {x.dim()}D input of shape "
                f"{tuple(x.shape)}). The input must be (N, C, *), channels in dim 1; for a single "
                "sample add a batch dim with x.unsqueeze(0).")
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"{self.tag}: expected {self.num_features} channels in dim 1 of the input, got "
                f"shape {tuple(x.shape)}. Check that the layer's num_features matches the "
                "previous layer's output channels and that channels are in dim 1 (N, C, *).")
        if not x.is_floating_point():
            raise TypeError(
                f"{self.tag}: expected a floating point input, got {x.dtype}. Convert it first, "
                "e.g. x.float().")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if self.last_input_dim != x.dim():  # (nn.Module's __setattr__ is slow: set on change)
            self.last_input_dim = x.dim()

        # Momentum and the batch counter, exactly as stock _BatchNorm: momentum=None means a
        # cumulative average, factor 1/num_batches_tracked.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)

        # Batch statistics in training, and in eval when there are no running statistics.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Running statistics are updated only when tracked (training) or read (eval).
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None

        # Synchronise while training in a process group (a group of one runs the same code).
        if self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group or None  # None: the default (whole world) group
            verdicts.check_member(group, self.tag)
            suffix = "" if self.path else f" #{self.build_index}"
            return SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean,
                                               running_var, self.eps, factor, group, self.tag,
                                               suffix)
        return F.batch_norm(x, running_mean, running_var, self.weight, self.bias,
                            use_batch_stats, factor, self.eps)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Same as :func:`convert_sync_batchnorm` (stock's signature)."""
        return convert_sync_batchnorm(module, process_group)


# ---------------------------------------------------------------------------- convert / revert
_PLAIN_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BATCHNORM_FOR_DIM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> None:
    """Hand src's tensors (the SAME objects: optimizers and hooks that hold them keep working),
    training flag and qconfig to dst."""
    if src.affine:
        dst.weight, dst.bias = src.weight, src.bias
    dst.running_mean, dst.running_var = src.running_mean, src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.training = src.training
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig


def _bias_kwarg(bn: _BatchNorm) -> dict:
    return {"bias": False} if bn.affine and bn.bias is None else {}


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (BatchNorm1d/2d/3d, torch.nn.SyncBatchNorm, any
    ``_BatchNorm``) by a minishard :class:`SyncBatchNorm` that shares its parameters and buffers.

    Call it BEFORE wrapping the model in DDP (DDP records the parameters it syncs). Layers that
    are already minishard SyncBatchNorm are left as they are. If ``module`` itself is a BatchNorm,
    the new layer is returned; otherwise ``module``, changed in place, is.
    """
    return _convert(module, process_group, name="")


def _convert(module: nn.Module, process_group, name: str) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, **_bias_kwarg(module))
        _move_state(module, out)
        out.original_class = next((c for c in _PLAIN_BATCHNORMS if isinstance(module, c)), None)
        if name:
            out.tag, out.path = f"{out.tag} {name}", name
    for child_name, child in module.named_children():
        out.add_module(child_name, _convert(child, process_group,
                                            f"{name}.{child_name}" if name else child_name))
    return out


def name_sync_batchnorms(model: nn.Module) -> nn.Module:
    """Name every SyncBatchNorm in ``model`` that has no path yet by its path in ``model``
    (``named_modules``), as ``convert_sync_batchnorm`` does: for layers built directly, whose
    default name ``#k`` (build order) is only the same on every rank if every rank built the same
    layers in the same order. Returns ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, SyncBatchNorm) and m.path is None and name:
            m.tag, m.path = f"{m.tag} {name}", name
    return model


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """The inverse of :func:`convert_sync_batchnorm`: every SyncBatchNorm (ours or stock's) becomes
    a plain BatchNorm1d/2d/3d sharing its parameters and buffers.

    Which one: the class it was converted from, if it was converted from one of those; else the one
    that fits the input it saw last (2D/3D -> 1d, 4D -> 2d, 5D -> 3d); else, for a layer never run
    (and for stock SyncBatchNorm), BatchNorm2d, the common case in conv nets. The choice only
    decides which input dims the reverted layer accepts; the numbers are the same.
    """
    out = module
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        cls = (getattr(module, "original_class", None)
               or _BATCHNORM_FOR_DIM.get(getattr(module, "last_input_dim", None), nn.BatchNorm2d))
        out = cls(module.num_features, module.eps, module.momentum, module.affine,
                  module.track_running_stats, **_bias_kwarg(module))
        _move_state(module, out)
    for child_name, child in module.named_children():
        out.add_module(child_name, revert_sync_batchnorm(child))
    return out
