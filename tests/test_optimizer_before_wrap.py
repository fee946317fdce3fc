"""An optimizer built BEFORE wrapping (nanoGPT's and DDP's order) is the model's from the wrap on.

At stages 1-3 the wrap replaces every parameter with a DTensor of this rank's rows; an optimizer
built over the originals must hold the successors the moment ``ZeRO(...)`` returns, so whatever
reads ``optimizer.param_groups`` before its first step sees the model's parameters. The oracles
are not minishard: one process on the global batch, and torch's DDP built in the same order.
Each habit below read the emptied originals before: Lightning's clip over the optimizer's
parameters, nanoGPT's float16 GradScaler path, torch's Join with ``optimizer=``, torch's
``get_optimizer_state_dict`` (what DCP saves) before the first step. Then the full optimizer
export's numbering: torch's own (the optimizer's order), equal to DDP's ``opt.state_dict()``
for any group layout; and a stepped optimizer that loads a state dict is adopted again.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard

STEPS = 2


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def batch(step, n):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * n, 5, generator=gen)


def loss_of(model, x):
    return model(x).square().mean()


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def habit_run(habit: str, stage, foreach, world=None):
    """Two steps of ``habit`` with the optimizer built before wrapping; returns (every norm the
    habit saw, the weights after, whether param_groups holds exactly model.parameters()).
    ``stage`` None: one process on the global batch of ``world`` ranks, the oracle."""
    n, r = (world, 0) if stage is None else (dist.get_world_size(), dist.get_rank())
    module = net()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    model = minishard.ZeRO(module, stage=stage) if stage is not None else module
    held = [id(p) for p in params_of(opt)] == [id(p) for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if habit == "scaler" else None
    norms = []
    with Join([model], optimizer=opt) if habit == "join" and stage is not None else _nothing():
        for step in range(STEPS):
            x = batch(step, n)
            loss = loss_of(model, x[r * 4:(r + 1) * 4] if stage is not None else x)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            # Lightning's clip_gradients(optimizer): over the optimizer's parameters
            norms.append(float(torch.nn.utils.clip_grad_norm_(params_of(opt), 0.5)))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    weights = model.full_state_dict() if stage is not None else model.state_dict()
    return norms, weights, held


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("habit", ["clip", "scaler", "join"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_optimizer_built_before_wrapping_is_the_models_at_once(pools, habit, stage):
    world = 3 if stage % 2 else 2  # 3 pads the rows
    norms, want, _ = habit_run(habit, None, False, world)  # one process, the global batch
    for foreach in (False, True):
        for got_norms, got, held in pools(world).run(habit_run, habit, stage, foreach):
            assert held, "param_groups still holds the originals after ZeRO(...) returned"
            torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms),
                                       rtol=1e-5, atol=1e-6)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def dcp_before_first_step(stage):
    """torch's get_optimizer_state_dict (what DCP saves) before the first step, the optimizer
    built before wrapping: the same entries as DDP's built the same way."""
    ours = minishard.ZeRO(module := net(), stage=stage)
    del module
    opt = torch.optim.Adam(ours.module.parameters(), lr=0.1)  # after: the control
    before = net()
    opt_before = torch.optim.Adam(before.parameters(), lr=0.1)
    ours_before = minishard.ZeRO(before, stage=stage)
    ddp = DDP(net())
    opt_ddp = torch.optim.Adam(ddp.parameters(), lr=0.1)

    def entries(model, optimizer):
        state = get_optimizer_state_dict(model, optimizer)["state"]
        return sorted((k, sorted(v)) for k, v in state.items())
    return entries(ours_before.module, opt_before), entries(ours.module, opt), \
        entries(ddp.module, opt_ddp)


@pytest.mark.parametrize("stage", [1, 3])
def test_torchs_optimizer_state_dict_before_the_first_step(pools, stage):
    for before, after, ddp in pools(2).run(dcp_before_first_step, stage):
        assert ddp and before == ddp and after == ddp, (before, after, ddp)


# ------------------------------------------------------------- the full export's numbering
LAYOUTS = {
    "named": lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05}],  # (name, p) pairs
    "reversed": lambda ps: [{"params": ps[::-1]}],
    "block 1 before block 0": lambda ps: [{"params": ps[4:] + ps[:4]}],
    "two groups, interleaved": lambda ps: [{"params": ps[1::2], "lr": 0.05},
                                           {"params": ps[::2], "weight_decay": 0.1}],
}


def exported(stage, layout, built):
    """full_optimizer_state_dict after two Adam steps, the groups laid out by ``layout`` over
    ``model.parameters()`` (built before or after wrapping), beside DDP's opt.state_dict() of
    the same construction and run."""
    n, r = dist.get_world_size(), dist.get_rank()
    module = net()
    ddp = DDP(copy.deepcopy(module))

    def params(m):  # torch 2.6's named form for "named": the groups then carry param_names
        return list(m.named_parameters() if layout == "named" else m.parameters())
    opt_ddp = torch.optim.Adam(LAYOUTS[layout](params(ddp.module)), lr=0.01)
    opt = torch.optim.Adam(LAYOUTS[layout](params(module)), lr=0.01) \
        if built == "before" else None
    model = minishard.ZeRO(module, stage=stage)
    if opt is None:
        opt = torch.optim.Adam(LAYOUTS[layout](params(model.module)), lr=0.01)
    for step in range(STEPS):
        x = batch(step, n)[r * 4:(r + 1) * 4]
        for m, o in ((model, opt), (ddp, opt_ddp)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad()
    return minishard.full_optimizer_state_dict(model, opt), opt_ddp.state_dict()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stage", [0, 3])
def test_the_full_optimizer_state_is_numbered_as_torch_numbers_it(pools, layout, stage):
    """DDP's opt.state_dict() is the oracle: equal group for group, index for index; and a
    plain optimizer built the same way over the unwrapped model loads it and steps."""
    for built in ("after", "before"):
        for ours, ddp in pools(2).run(exported, stage, layout, built):
            assert ours["param_groups"] == ddp["param_groups"], (built, layout)
            assert ours["state"].keys() == ddp["state"].keys()
            for i, state in ddp["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(ours["state"][i][key], value, rtol=1e-5,
                                               atol=1e-7)
    plain = net()
    opt = torch.optim.Adam(LAYOUTS[layout](list(plain.named_parameters() if layout == "named"
                                                else plain.parameters())), lr=0.01)
    opt.load_state_dict(ours)
    loss_of(plain, batch(0, 1)).backward()
    opt.step()  # a numbering off by a parameter fails here on shapes


# ------------------------------------------------------------- adopted again after a load
def load_into_stepped(stage, foreach):
    """An optimizer that stepped, then loads a state dict of full tensors (a plain optimizer's,
    as full_optimizer_state_dict exports it): adopted again at its next step (its state cut
    into this rank's rows), it steps on as the plain optimizer does."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = minishard.ZeRO(net(), stage=stage)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=foreach)
    plain = net()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01, foreach=foreach)
    for step in range(STEPS):
        loss_of(plain, batch(step, n)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    loss_of(model, batch(9, n)[r * 4:(r + 1) * 4]).backward()
    opt.step()  # stepped: checked once already
    opt.zero_grad()
    model.load_full_state_dict(plain.state_dict())
    opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))  # full tensors, plain ones
    x = batch(STEPS, n)
    loss_of(model, x[r * 4:(r + 1) * 4]).backward()
    opt.step()
    loss_of(plain, x).backward()
    plain_opt.step()
    got = model.full_state_dict()
    return max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("stage", [1, 3])
def test_a_stepped_optimizer_is_adopted_again_after_it_loads(pools, stage):
    for foreach in (False, True):
        assert max(pools(2).run(load_into_stepped, stage, foreach)) < 1e-6
