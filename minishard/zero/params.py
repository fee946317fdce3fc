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
    a replicated one (``replicate=``)     Replicate() on each dim  every rank holds it whole

``p.shape`` is the global shape, ``p.to_local()`` this rank's rows, ``p.full_tensor()`` the
whole parameter (an all-gather). An op on DTensors runs the collective its placements need:
the norm of a ``Shard(0)`` gradient is a partial sum on each rank, all-reduced before it is
used, so ``clip_grad_norm_`` returns the true norm and scales every rank's rows by one factor.
Inside the engine every collective runs on the local tensors through comm.py; the
ones DTensor runs for the user are counted by :func:`torch_collectives` (in every ledger).

The price is DTensor's dispatch: each op on a parameter (an optimizer's step over many of them)
goes through DTensor's Python layer first. ``foreach=True`` optimizers pay it once per group of
tensors instead of once per tensor (bench/RESULTS.md, "DTensor parameters").

A 0-dim parameter cannot be cut into rows (FSDP2 refuses one); minishard keeps it replicated:
every rank's one-element chunk holds it (flat.py) and its gradient is averaged over every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from minishard import comm, costs

__all__ = ["Spec", "local", "mesh_of", "torch_collectives"]


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


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one flat buffer's user parameters are DTensors: its mesh, whose last dim is the
    shard group (a 2-D mesh's first dim holds the replicas); ``replicated``: every rank holds every
    row (a replicated buffer, ``ZeRO(replicate=...)``)."""
    mesh: DeviceMesh
    replicated: bool = False
    _specs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def placements(self, shape: torch.Size) -> tuple:
        row = Shard(0) if len(shape) and not self.replicated else Replicate()
        return (Replicate(),) * (self.mesh.ndim - 1) + (row,)

    def of(self, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        """The DTensorSpec of a user tensor of global ``shape`` and ``dtype``, made once. A
        DTensor is built from it as FSDP2 builds its own (``_from_local_no_grad``), not through
        ``DTensor.from_local`` (~36 us a call here, a gradient per parameter per step)."""
        spec = self._specs.get((shape, dtype))
        if spec is None:
            stride = torch.empty(shape, device="meta").stride()
            spec = self._specs[shape, dtype] = DTensorSpec(self.mesh, self.placements(shape),
                                                           TensorMeta(shape, stride, dtype))
        return spec

    def wrap(self, rows: torch.Tensor, shape: torch.Size) -> DTensor:
        """``rows`` (this rank's, a view: no copy) as the DTensor of global ``shape``."""
        return DTensor(rows, self.of(shape, rows.dtype), requires_grad=False)

    def whole(self, tensor: torch.Tensor) -> DTensor:
        """``tensor``, which this rank holds whole (no_sync's local gradient of a parameter:
        each rank's own, as DDP's ``p.grad``), as a DTensor Replicate()d on every mesh dim."""
        stride = tensor.stride()
        spec = DTensorSpec(self.mesh, (Replicate(),) * self.mesh.ndim,
                           TensorMeta(tensor.shape, stride, tensor.dtype))
        return DTensor(tensor, spec, requires_grad=False)


# torch's functional collectives that DTensor calls -> (comm's op, is the input 1/N of it)
_FUNCOL = {"all_reduce": ("all_reduce", False), "all_gather_single": ("all_gather", True),
           "reduce_scatter_single": ("reduce_scatter", False)}


_watching = [0]  # open torch_collectives blocks: only the outermost wraps (no double count)


@contextlib.contextmanager
def torch_collectives():
    """Inside a ledger (costs.ledger opens it) and a trace (trace.py): the collectives torch
    runs on its own, on DTensors (``clip_grad_norm_``'s all-reduce of the partial norms, a
    ``full_tensor()``'s all-gather), recorded as comm's entries tagged ``torch <op>``. DTensor
    issues them through ``torch.distributed._functional_collectives``, whose functions are
    wrapped for the block: nothing else is slowed down (a dispatch mode would sit on every op
    of a timed step). A trace shows each at the moment it is issued (torch waits on it later,
    unseen)."""
    if _watching[0]:
        yield
        return
    saved = {name: getattr(funcol, name) for name in _FUNCOL}

    def counted(name, original):
        op, gathered = _FUNCOL[name]
        signature = inspect.signature(original)

        def collective(tensor, *args, **kwargs):
            group = signature.bind(tensor, *args, **kwargs).arguments["group"]
            group = _resolve_process_group(funcol._resolve_group_name(group))
            n = comm.group_size(group)
            comm.record(op, tensor.numel() * (n if gathered else 1), tensor.dtype, n,
                        f"torch {op}", group=group)
            if comm._observer is not None:  # a trace: no work of ours to wait on
                comm._observer.started([])
            return original(tensor, *args, **kwargs)
        return collective

    for name, original in saved.items():
        setattr(funcol, name, counted(name, original))
    _watching[0] += 1
    try:
        yield
    finally:
        _watching[0] -= 1
        for name, original in saved.items():
            setattr(funcol, name, original)


costs.WATCHERS.append(torch_collectives)
