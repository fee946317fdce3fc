"""Three small promises (issue 42, defect 4), each against plain torch or a fresh wrap.

* A meta-device wrap whose initialiser raises leaves the model as it was: wrapping it again
  with a working initialiser succeeds and equals an eager build (before: "already wrapped").
* A unit whose output holds several tensors logs "backward" ONCE per backward (before: once per
  tensor), as the trace and record_events promise one event per unit.
* ``clip_grad_norm_`` on a model with no parameters, or no gradients yet, returns 0 at every
  stage and world size, as ``torch.nn.utils.clip_grad_norm_`` does.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from minishard import ZeRO


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)  # two outputs, each needing a gradient


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two, self.head = Two(), nn.Linear(4, 1)

    def forward(self, x):
        a, b = self.two(x)
        return self.head(a + b)


def _retry_after_a_failed_init(stage):
    def broken(module):
        raise RuntimeError("initialiser failed")
    with torch.device("meta"):
        module = Net()
    try:
        ZeRO(module, stage=stage, units={Two}, device="cpu", param_init_fn=broken)
        first = "wrapped"
    except RuntimeError as exc:
        first = str(exc)
    torch.manual_seed(3)
    model = ZeRO(module, stage=stage, units={Two}, device="cpu")
    torch.manual_seed(3)
    eager = Net()
    got = model.full_state_dict()
    return first, all(torch.equal(got[k], v) for k, v in eager.state_dict().items())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_failed_deferred_init_can_be_wrapped_again(pools, stage):
    for first, equal in pools(2).run(_retry_after_a_failed_init, stage):
        assert "initialiser failed" in first and equal, first


def _events(stage):
    model = ZeRO(Net(), stage=stage, units={Two})
    with model.record_events() as events:
        model(torch.randn(3, 4)).sum().backward()
    return [e["unit"] for e in events if e["event"] == "backward"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_unit_with_two_outputs_logs_one_backward(pools, stage):
    for backward in pools(2).run(_events, stage):
        assert sorted(backward) == ["<root>", "two"], backward


def _clip_without_gradients(stage):
    empty = ZeRO(nn.Sequential(nn.ReLU()), stage=stage)
    fresh = ZeRO(Net(), stage=stage, units={Two})
    plain = torch.nn.utils.clip_grad_norm_(Net().parameters(), 1.0)  # no grads: torch's answer
    return float(empty.clip_grad_norm_(1.0)), float(fresh.clip_grad_norm_(1.0)), float(plain)


@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_without_parameters_or_gradients_returns_zero(pools, ws, stage):
    for no_params, no_grads, torch_says in pools(ws).run(_clip_without_gradients, stage):
        assert no_params == no_grads == torch_says == 0.0
