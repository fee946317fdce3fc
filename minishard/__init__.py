"""minishard: SyncBatchNorm and ZeRO-1/2/3 from raw torch.distributed collectives.

Public names only; the modules tell the story:
  comm.py     the one door to collectives, and the debug check
  costs.py    what a collective costs: the Ledger that counts its bytes, the alpha-beta model
  syncbn.py   SyncBatchNorm (autograd Function + module) and convert/revert helpers
  flat.py     FlatBuffer: a unit's parameters as views of one padded 1-D buffer
  units.py    construction: finding units, tied/shared parameters' owners, flat buffers
  zero.py     the ZeRO engine's schedule, stages 0-3: hooks, reductions, gathers
  state.py    checkpoints: per-rank shard files, atomic, reshardable; full optimizer export
  memory.py   the ZeRO memory formulas and terminal charts; plan.py, the estimator CLI
  testing.py  RankPool: warm gloo ranks for tests
  launch.py   session(): set-up and clean tear-down for scripts started by torchrun
  tour.py     torchrun --standalone --nproc_per_node=2 -m minishard.tour
"""
from minishard import comm, launch, state
from minishard.comm import ledger
from minishard.state import (full_optimizer_state_dict, latest_checkpoint, load_checkpoint,
                             load_full_optimizer_state_dict, save_checkpoint)
from minishard.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from minishard.zero import STAGES, MixedPrecision, ZeRO

__all__ = [
    "comm", "launch", "state", "ledger",
    "SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
    "ZeRO", "STAGES", "MixedPrecision",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint",
    "full_optimizer_state_dict", "load_full_optimizer_state_dict",
]
