"""Seeing what the engine does: every rank's schedule as one trace (trace.py), every storage a
rank allocates (allocations.py), the ZeRO memory formulas (memory.py) and the estimator that
answers "which stage fits?" (plan.py, ``python -m minishard.plan``).
"""
