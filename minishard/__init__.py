"""minishard: SyncBatchNorm and ZeRO-1/2/3 from raw torch.distributed collectives.

Public names only; see the modules for the story:
  comm.py     the one door to collectives, and the Ledger that counts their bytes
  syncbn.py   SyncBatchNorm (autograd Function + module) and convert/revert helpers
  flat.py     FlatBuffer: a unit's parameters as views of one padded 1-D buffer
  zero.py     the ZeRO engine, stages 0-3
  testing.py  RankPool: warm gloo ranks for tests
"""
from minishard import comm
from minishard.comm import ledger
from minishard.zero import STAGES, MixedPrecision, ZeRO

__all__ = ["comm", "ledger", "ZeRO", "STAGES", "MixedPrecision"]
from minishard.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

__all__ += ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"]
from minishard.state import (full_optimizer_state_dict, latest_checkpoint, load_checkpoint,
                             load_full_optimizer_state_dict, save_checkpoint)

__all__ += ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "full_optimizer_state_dict",
            "load_full_optimizer_state_dict"]
