r"""SyncBatchNorm: BatchNorm whose statistics cover the batch of every rank in a process group.

With a small batch per rank, plain BatchNorm normalises each rank's few samples by their own mean
and variance: noisy statistics, and a model that behaves differently from one trained on the
whole batch. SyncBatchNorm normalises with the statistics of the GLOBAL batch (all ranks together),
so N ranks with batch b compute exactly what one process computes on a batch of N*b.

Notation: x is this rank's input (N_r, C, *), n the GLOBAL number of values per channel (sum over
ranks of N_r times the spatial size), every sum Σ runs over all ranks and all dims but C.

Forward: one all_reduce of 2C+1 numbers
---------------------------------------
    local [Σx, Σx², n_r]  --all_reduce(SUM)-->  global [S, Q, n]
    mean = S/n      var = Q/n - mean²      invstd = 1/sqrt(var + eps)
    y    = (x - mean)·invstd·w + b                      (w, b: weight and bias, per channel)
    running_mean <- (1-m)·running_mean + m·mean
    running_var  <- (1-m)·running_var  + m·var·n/(n-1)  (the unbiased variance, as stock does)

Sums can be added across ranks; means and variances cannot (not with unequal batch sizes), which
is why we send sums. Stock torch.nn.SyncBatchNorm all-gathers each rank's (mean, invstd, count)
instead: O(C·N) bytes where we send O(C), whatever the world size.

Backward: one all_reduce of 2C numbers
--------------------------------------
Write x̂ = (x - mean)·invstd and g = dL/dx̂ = w·dy. Every x̂_j depends on every x_i in the global
batch through mean and invstd. With dmean/dx_i = 1/n and, for σ = 1/invstd = sqrt(var + eps),
dσ/dx_i = x̂_i/n (differentiate var = (1/n)Σ(x_j - mean)²; the Σ(x_j - mean) = 0 term drops out)::

    dx̂_j/dx_i = invstd·(δ_ij - 1/n - x̂_i·x̂_j/n)

    dL/dx_i = Σ_j g_j·dx̂_j/dx_i = invstd·(g_i - Σ_j g_j/n - x̂_i·Σ_j g_j·x̂_j/n)
            = w·invstd·(dy_i - A/n - x̂_i·B/n),      A = Σ dy,  B = Σ dy·x̂  (global sums)

So each rank needs only two per-channel global sums: local [Σdy, Σdy·x̂] --all_reduce(SUM)-->
[A, B]. The parameter gradients dL/dw = Σ dy·x̂ and dL/db = Σ dy stay LOCAL sums over this rank's
samples, exactly as stock: DDP (or the ZeRO engine) averages parameter gradients across ranks
afterwards, and summing them here too would count them twice.

Numerics: why the statistics are accumulated in float64
------------------------------------------------------
var = Q/n - mean² subtracts two numbers of size mean² to get one of size std². In float32 (7
digits) an input with mean 1e4 and std 1 leaves nothing: Q/n ≈ 1e8 is only known to ±8 or so.
The usual cure, shifting by a value near the mean before squaring, needs a shift every rank agrees
on; the only such values (running_mean) are absent without running stats and wrong at the first
step. So we compute Σx and Σx² from float64 copies and all-reduce them as float64: still one
collective of 2C+1 numbers. The float64 rounding (about 1e-16·mean²) then stays far below the
rounding the float32/float16 input already carries (about 1e-7·mean·std), for any input float32
can represent. (Float64 inputs get no such margin: a float64 input with mean/std above ~1e5 loses
digits of its variance. Stock's Welford-based kernels do better there; we choose one readable
collective.) The elementwise normalisation runs in the input's dtype: float32 in, float32 out.

Rules every rank relies on
--------------------------
* Every rank in the group calls the forward and (if the input needs a gradient) the backward
  collective, in the same order. A rank with ZERO samples needs no special case: its sums are
  zeros, it joins both collectives, and returns an empty output and zero parameter gradients.
* The input checks (dims, channel count, dtype, group membership) are local and run BEFORE any
  collective. If all ranks get the same bad input they all raise. If only one rank does, the others
  wait in the collective until the process group times out: that is a bug in the caller's code.
* Only a GLOBAL count of one value per channel is an error (its variance is undefined). That count
  is known only after the all_reduce, and every rank sees the same one, so all ranks raise it
  together. Reading it costs one device-to-host copy per layer (stock syncs there too).
* In eval mode there is no communication at all: the running statistics normalise (or, with
  track_running_stats=False, each rank's own batch statistics, exactly as stock).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from minishard import comm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"]


def _channel_view(x: torch.Tensor):
    """The dims that statistics reduce over (all but C) and the shape that broadcasts a
    per-channel vector against x: (1, C, 1, ...)."""
    dims = [0] + list(range(2, x.dim()))
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    return dims, shape


def _per_channel(x: torch.Tensor, shape, *vectors: torch.Tensor) -> list[torch.Tensor]:
    """Float64 per-channel vectors, cast to x's dtype in ONE conversion and shaped (1, C, 1, ...)
    to broadcast against x (many tiny casts cost more than the arithmetic on small layers)."""
    return list(torch.stack(vectors).to(x.dtype).view(len(vectors), *shape[1:]).unsqueeze(1))


class SyncBatchNormFunction(torch.autograd.Function):
    """The math of the module doc, with exactly one all_reduce in forward and one in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, tag):
        C = x.shape[1]
        dims, shape = _channel_view(x)

        # Local sums in float64 (see "Numerics"), packed in ONE buffer for ONE collective.
        x64 = x.to(torch.float64)
        local_count = torch.full((1,), x.numel() // C, dtype=torch.float64, device=x.device)
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), local_count])
        del x64
        comm.all_reduce(stats, "sum", group=group, tag=f"{tag} forward")
        S, Q = stats[:C], stats[C:2 * C]
        n = int(stats[2 * C])  # the one device->host read: we need n on the host to raise

        if n == 1:  # every rank sees the same n, so every rank raises here: no rank hangs
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {x.shape} "
                f"on this rank and 1 value per channel in total over the "
                f"{comm.group_size(group)} ranks of the process group. Use a larger batch, or "
                "call .eval() to normalise with the running statistics.")

        mean = S / n
        var = (Q / n - mean * mean).clamp_min(0)  # clamp: rounding may leave a tiny negative
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None and n > 0:  # n == 0 (every rank empty): leave them, as stock
            m = momentum
            running_mean.mul_(1 - m).add_(m * mean.to(running_mean.dtype))
            running_var.mul_(1 - m).add_(m * (var * n / (n - 1)).to(running_var.dtype))

        # y = (x - mean)·(invstd·w) + b, elementwise in the input's dtype: two passes over x.
        # (Not x·scale + (b - mean·scale), one pass fewer: with a large mean that form subtracts
        # two large numbers and loses the digits the float64 statistics above kept.)
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        shift = torch.zeros_like(mean) if bias is None else bias.to(torch.float64)
        m, s, b = _per_channel(x, shape, mean, scale, shift)
        y = torch.addcmul(b, x - m, s)

        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n, ctx.group, ctx.tag = n, group, tag
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable  # the collective below is not differentiable: refuse double backward
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        C = x.shape[1]
        dims, shape = _channel_view(x)
        (m,) = _per_channel(x, shape, mean)
        centred = x - m                                                    # x̂ = centred·invstd

        # The local parts of A and B, in float32 or better: dy·centred is not normalised (its
        # size is |dy|·std), so in float16 it would overflow or underflow. Unlike Σx² in
        # forward, nothing here cancels badly enough to need float64.
        dy_acc = dy.to(torch.promote_types(x.dtype, torch.float32))
        sums = torch.cat([dy_acc.sum(dims), (dy_acc * centred).sum(dims)]).to(torch.float64)
        sum_dy, sum_dy_xhat = sums[:C], sums[C:]
        if ctx.n:  # (every rank empty: invstd is NaN and the sums are 0; keep them 0)
            sum_dy_xhat = sum_dy_xhat * invstd

        # Parameter gradients: LOCAL sums (DDP / ZeRO average them across ranks).
        dweight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None

        dx = None
        if ctx.needs_input_grad[0]:  # the same on every rank (same model), so all join or none
            AB = torch.cat([sum_dy, sum_dy_xhat])  # a new tensor: the local sums above survive
            comm.all_reduce(AB, "sum", group=ctx.group, tag=f"{ctx.tag} backward")
            A, B = AB[:C], AB[C:]
            n = ctx.n
            k = invstd if weight is None else invstd * weight.to(torch.float64)
            # dx = w·invstd·(dy - A/n - x̂·B/n) = (dy - centred·(invstd·B/n))·k - k·A/n
            c, k_, kA = _per_channel(x, shape, invstd * B / n, k, k * A / n)
            dx = torch.addcmul(-kA, torch.addcmul(dy, centred, -c), k_)
        return dx, dweight, dbias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for :class:`torch.nn.SyncBatchNorm` (same arguments, parameters, buffers and
    state_dict keys), built on :class:`SyncBatchNormFunction`; works on CPU/gloo as well as GPUs.

    Inputs (N, C, *) with 2 to 5 (or more) dims; channels_last inputs give channels_last outputs.
    Statistics are synchronised only in training mode and only when the process group (default: the
    whole world) has more than one rank; otherwise this is exactly ``F.batch_norm``, as in stock.

    ``tag`` names this layer in the comm ledger; ``convert_sync_batchnorm`` sets it to the layer's
    name in the model. ``original_class`` and ``last_input_dim`` tell ``revert_sync_batchnorm``
    which BatchNormNd to go back to.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True) -> None:
        # Only pass `bias` when it matters: older torch releases have no such keyword.
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype, **({} if bias else {"bias": False}))
        self.process_group = process_group
        self.tag = f"SyncBatchNorm({num_features})"
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

        # Synchronise only while training with more than one rank (stock's `need_sync`).
        if self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group or None  # None: the default (whole world) group
            comm.check_member(group, self.tag)
            if comm.group_size(group) > 1:
                return SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean,
                                                   running_var, self.eps, factor, group, self.tag)
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
            out.tag = f"{out.tag} {name}"
    for child_name, child in module.named_children():
        out.add_module(child_name, _convert(child, process_group,
                                            f"{name}.{child_name}" if name else child_name))
    return out


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
