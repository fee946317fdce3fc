"""Checkpoints of a ZeRO model: full state dicts (full_state.py), per-rank shard files written
atomically and read back checked (state.py, files.py), and torch.distributed.checkpoint's format,
both ways with FSDP2 (dcp.py). They import the engine; the engine imports none of them.
"""
