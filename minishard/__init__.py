"""minishard: SyncBatchNorm and ZeRO-1/2/3 from raw torch.distributed collectives.

Public names only; the modules tell the story. The house, one folder per concern:
  comm.py            the one door to collectives (the Ledger of costs.py counts their bytes)
  syncbn.py          SyncBatchNorm (autograd Function + module) and convert/revert helpers
  zero/              THE ENGINE, and nothing else; start at zero/engine.py (its event table)
  checkpoint/        full state dicts, per-rank shard files, torch.distributed.checkpoint (DCP)
  observe/           trace, allocations, the memory formulas, the plan, the flight record, doctor
  course/            exercises that check themselves, their oracles, the tour
  sharded_optimizer.py  ShardedOptimizer: ZeRO-1 over parameters (torch's ZeroRedundancyOptimizer)
  join.py            torch's Join for a ZeRO model (uneven inputs); attaches from outside
  verdicts.py        every rank raises together, or none does
  launch.py          session(): set-up and clean tear-down for scripts started by torchrun
  testing.py         RankPool: warm gloo ranks for tests
Arrows point down: features import the engine, never the other way round (tests/test_budgets.py).
``python -m minishard.plan``, ``.doctor``, ``.tour``, ``.exercise``: modules in observe/, course/.
"""
import importlib.abc
import importlib.util
import sys

# The engine first: checkpoint/ and observe/ import parts of it, and its face imports them.
from minishard.zero import STAGES, MixedPrecision, ZeRO  # noqa: I001
from minishard import comm, launch
from minishard.checkpoint import state
from minishard.checkpoint.state import (full_optimizer_state_dict, latest_checkpoint,
                                        load_checkpoint, load_full_optimizer_state_dict,
                                        save_checkpoint)
from minishard.comm import ledger
from minishard.observe.allocations import Allocations
from minishard.observe.flight import dump_flight_record
from minishard.sharded_optimizer import ShardedOptimizer
from minishard.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

__all__ = [
    "comm", "launch", "state", "ledger", "Allocations",
    "SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
    "ZeRO", "STAGES", "MixedPrecision", "ShardedOptimizer",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint",
    "full_optimizer_state_dict", "load_full_optimizer_state_dict", "dump_flight_record",
]


# `python -m minishard.plan` (and .tour, .exercise): the command-line names outlive the move.
COMMANDS = {"minishard.plan": "observe/plan.py", "minishard.tour": "course/tour.py",
            "minishard.exercise": "course/exercise.py", "minishard.doctor": "observe/doctor.py"}


class _Commands(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in COMMANDS:
            return importlib.util.spec_from_file_location(name, f"{__path__[0]}/{COMMANDS[name]}")
        return None


sys.meta_path.append(_Commands())
