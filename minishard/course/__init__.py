"""The course beside the code: exercises that check themselves (exercise.py,
``python -m minishard.exercise``), the oracles that judge them (oracles.py) and the live tour
(tour.py, ``torchrun --standalone --nproc_per_node=2 -m minishard.tour``).
"""
