"""What a user parameter IS at stages 1-3: a DTensor, so torch's own tools see a shard.

A flat buffer keeps this rank's rows of each parameter (flat.py). Handed to the user as a plain
tensor, those rows look like a whole parameter to every tool that reduces over one:
``torch.nn.utils.clip_grad_norm_`` would add up this rank's rows only (each rank a different
norm, each clipping by a different factor), ``p.grad.norm()`` would log one rank's part, and
``torch.distributed.checkpoint.state_dict.get_state_dict`` could not tell a piece from a tensor.

So, as FSDP2 does, each user parameter is an ``nn.Parameter`` wrapping a
``torch.distributed.tensor.DTensor``: its *local tensor* is a view of this rank's rows in the
flat buffer (no copy), its *placement* says how the rows make the whole::

    1-D mesh (the shard group)            Shard(0)                 rank r holds rows rows_of(R, N, r)
    2-D mesh (replicate, shard)           (Replicate(), Shard(0))  the same rows, on every replica
    a 0-dim parameter (no rows to cut)    Replicate() on each dim  every rank holds it whole

``p.shape`` is the global shape, ``p.to_local()`` this rank's rows, ``p.full_tensor()`` the
whole parameter (an all-gather). An op on DTensors runs the collective its placements need:
the norm of a ``Shard(0)`` gradient is a partial sum on each rank, all-reduced before it is
used, so ``clip_grad_norm_`` returns the true norm and scales every rank's rows by one factor.
Inside the engine every collective runs on the local tensors through comm.py, as before; the
ones DTensor runs for the user are watched by :class:`TorchCollectives` (in every ledger).

The price is DTensor's dispatch: each op on a parameter (an optimizer's step over many of them)
goes through DTensor's Python layer first. ``foreach=True`` optimizers pay it once per group of
tensors instead of once per tensor (bench/RESULTS.md, "DTensor parameters").

A 0-dim parameter cannot be cut into rows (FSDP2 refuses one); minishard keeps it replicated:
every rank's one-element chunk holds it (flat.py) and its gradient is averaged over every rank.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from minishard import comm, costs

__all__ = ["Spec", "local", "mesh_of", "TorchCollectives"]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The plain tensor a DTensor holds on this rank (anything else as it is): the engine does
    its own arithmetic on shards, without DTensor's dispatch."""
    return t._local_tensor if isinstance(t, DTensor) else t


def mesh_of(groups, device_type: str) -> DeviceMesh:
    """The mesh the user parameters live on: the user's ``mesh=``, else the shard group's."""
    if groups.mesh is not None:
        return groups.mesh
    group = groups.shard or torch.distributed.group.WORLD
    return DeviceMesh.from_group(group, device_type)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one flat buffer's user parameters are DTensors: its mesh, whose last dim is the
    shard group (a 2-D mesh's first dim holds the replicas)."""
    mesh: DeviceMesh

    def placements(self, shape: torch.Size) -> tuple:
        row = Shard(0) if len(shape) else Replicate()
        return (Replicate(),) * (self.mesh.ndim - 1) + (row,)

    def wrap(self, rows: torch.Tensor, shape: torch.Size) -> DTensor:
        """``rows`` (this rank's, a view: no copy) as the DTensor of global ``shape``."""
        return DTensor.from_local(rows, self.mesh, self.placements(shape), run_check=False,
                                  shape=shape, stride=_contiguous_stride(shape))


class TorchCollectives(TorchDispatchMode):
    """Inside a ledger (costs.ledger opens it): the collectives torch runs on its own, on
    DTensors (``clip_grad_norm_``'s all-reduce of the partial norms, a ``full_tensor()``'s
    all-gather), recorded as comm's entries, tagged ``torch <op>``. They run as functional
    collectives (``torch.ops._c10d_functional``): this mode sees each op as it is issued."""

    # functional op -> (comm's name, how many times the input the whole tensor is)
    _OPS = {"all_reduce": ("all_reduce", False), "all_reduce_coalesced": ("all_reduce", False),
            "all_gather_into_tensor": ("all_gather", True),
            "reduce_scatter_tensor": ("reduce_scatter", False), "broadcast": ("broadcast", False)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # let DTensor run the op; its collectives come back through here
            return NotImplemented
        if func.namespace == "_c10d_functional" and func._opname in self._OPS:
            op, gathered = self._OPS[func._opname]
            group = _resolve_process_group(args[-1])
            n = comm.group_size(group)
            for t in args[0] if isinstance(args[0], (list, tuple)) else [args[0]]:
                comm.record(op, t.numel() * (n if gathered else 1), t.dtype, n, f"torch {op}",
                            group=group)
        return func(*args, **(kwargs or {}))


costs.WATCHERS.append(TorchCollectives)
