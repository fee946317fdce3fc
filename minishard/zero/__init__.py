"""The ZeRO engine, and nothing else. Start reading at engine.py: its table of events names the
file that implements each one (unit.py, schedule.py, flat.py; comm.py one floor up).
"""
from minishard.zero.config import MixedPrecision
from minishard.zero.engine import STAGES, ZeRO

__all__ = ["ZeRO", "STAGES", "MixedPrecision"]
