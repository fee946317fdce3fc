"""Stage-3 buckets in backward gather the units that run NEXT in backward: the reverse of the
forward order (schedule.py; [Note: buckets] in zero/config.py). Built in forward order
instead, a backward bucket starting at the last unit carries the FIRST units (5, 0, 4, 1, ...): loss and weights are
unchanged, but units are gathered long before they run, and the gathered peak doubles.

The oracle is the recorded forward order (``record_events``), reversed, and the bucket bound:
at most ``bucket_bytes`` gathered beyond the unit that runs (the units here are equal).
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minishard import ZeRO

UNITS, WIDTH = 6, 8


def _gathers(world_rows: int):
    rows = math.ceil(WIDTH / dist.get_world_size()) * dist.get_world_size()  # padded
    unit = 4 * (rows * WIDTH + rows)  # a Linear's weight and bias, fp32
    torch.manual_seed(0)
    model = ZeRO(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(UNITS)]), stage=3,
                 units={nn.Linear}, bucket_bytes=2 * unit)
    x = torch.randn(world_rows, WIDTH)
    model(x).sum().backward()  # the first step records the order
    with model.record_events() as events:
        model(x).sum().backward()
    forward = [e["unit"] for e in events if e["event"] == "forward"]
    backward = [e["unit"] for e in events if e["event"] == "backward"]
    gathered_in_backward = []
    seen_backward = False
    for e in events:
        seen_backward |= e["event"] == "backward"
        if seen_backward and e["event"] == "gather":
            gathered_in_backward.append(e["unit"])
    return forward, backward, gathered_in_backward, model.peak_gathered_bytes, unit


@pytest.mark.parametrize("ws", [2, 3])
def test_backward_buckets_gather_in_reverse_order(pools, ws):
    for forward, backward, gathered, peak, unit in pools(ws).run(_gathers, 2):
        units = [u for u in forward if u != "<root>"]  # the root holds no parameters
        assert [u for u in backward if u != "<root>"] == units[::-1]
        assert gathered == sorted(gathered, key=units.index, reverse=True), gathered
        assert peak <= 3 * unit, (peak, unit)  # the unit that runs + a bucket of two
