"""minishard: SyncBatchNorm and ZeRO-1/2/3 from raw torch.distributed collectives.

Public names only; the modules tell the story. Reading order for the ZeRO engine: zero.py (the
schedule), unit.py (a unit's work), gathers.py and reductions.py (when collectives run), flat.py
(the bytes), comm.py (the collectives); then the features, each in its own file:
  comm.py            the one door to collectives, and the debug check
  costs.py           what a collective costs: the Ledger that counts its bytes, the alpha-beta model
  syncbn.py          SyncBatchNorm (autograd Function + module) and convert/revert helpers
  zero.py            the ZeRO engine: the stage table, the four hooks, end of backward, public API
  unit.py            a unit: its flat buffers and places; gather, to_(un)sharded, release
  flat.py            FlatBuffer: a unit's full buffer and shard; gather_params, reduce_grads
  layout.py          Layout: which rows of which parameter sit where (no storage)
  dtensors.py        the user parameters as DTensors of this rank's rows; DTensor's collectives
  reductions.py      gradient reductions: buckets, in-flight limit, find_unused's order and bitmap
  gathers.py         gathers beyond "just before it runs": order, prefetch, buckets, re-gathers
  config.py          ZeRO's arguments in full: checks, mesh groups, mixed precision, param groups
  build.py           construction: finding units, tied/shared parameters' owners, flat buffers
  deferred_init.py   materialising a meta-device model one module at a time
  full_state.py      gathered(), full state dicts, the full optimizer state export
  guards.py          misuse guards: released stage-3 parameters, module.parameters(), stale optimizers
  meters.py          peaks, the event timeline, memory_report(), the wrap meter, the step formula
  allocations.py     Allocations: every storage a rank allocates, and the most alive at once
  trace.py           model.trace(path): every rank's schedule as one Chrome trace; draw() a PNG
  verdicts.py        every rank raises together, or none does
  state.py           checkpoints: per-rank shard files, atomic, reshardable (checkpoint_files.py)
  dcp_checkpoint.py  checkpoints in torch.distributed.checkpoint's format: both ways with FSDP2
  memory.py          the ZeRO memory formulas and terminal charts; plan.py, the estimator CLI
  sharded_optimizer.py  ShardedOptimizer: ZeRO-1 over parameters (torch's ZeroRedundancyOptimizer)
  testing.py         RankPool: warm gloo ranks for tests
  launch.py          session(): set-up and clean tear-down for scripts started by torchrun
  tour.py            torchrun --standalone --nproc_per_node=2 -m minishard.tour
"""
from minishard import comm, launch, state
from minishard.allocations import Allocations
from minishard.comm import ledger
from minishard.sharded_optimizer import ShardedOptimizer
from minishard.state import (full_optimizer_state_dict, latest_checkpoint, load_checkpoint,
                             load_full_optimizer_state_dict, save_checkpoint)
from minishard.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from minishard.zero import STAGES, MixedPrecision, ZeRO

__all__ = [
    "comm", "launch", "state", "ledger", "Allocations",
    "SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
    "ZeRO", "STAGES", "MixedPrecision", "ShardedOptimizer",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint",
    "full_optimizer_state_dict", "load_full_optimizer_state_dict",
]
