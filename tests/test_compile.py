"""torch.compile as users meet it, against one process on the global batch.

Three orders: nanoGPT's (``torch.compile(model)``, then wrap), torchtitan's (wrap, then
``block.compile()`` each unit's module) and ``torch.compile`` of the wrapped model. The engine's
hooks run eagerly between the compiled code (engine.py's ``_weak_hook``: dynamo breaks the graph
there, as at FSDP2's hooks), so what they check runs: the same collectives as an eager step,
stamped and recorded, and a stage-3 stand-in read by another unit's compiled code raises.

Most cells compile with ``aot_eager`` (dynamo's capture and AOT autograd, as inductor gets them,
without generating C++: seconds, not a minute); two cells compile with inductor, the default.
Micro-batches as nanoGPT's: the first under ``no_sync``. SGD with momentum, for-loop and foreach.
"""
import pytest

import torch
import torch.distributed as dist
from torch import nn

import minishard

D, ROWS, STEPS = 8, 2, 3  # features; rows per rank per micro-batch; steps
ORDERS = ["compile_then_wrap", "wrap_then_compile_blocks", "compile_wrapped"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


def build():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(D, 3))


def batch(step: int, micro: int, world: int) -> torch.Tensor:
    """Every rank's rows of one micro-batch (the global batch: all of them)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(world * ROWS, D, generator=g)


def one_process(world: int, foreach: bool) -> dict:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    for step in range(STEPS):
        for micro in range(2):
            (model(batch(step, micro, world)).square().mean() / 2).backward()
        opt.step(), opt.zero_grad()
    return model.state_dict()


def compiled(order: str, stage: int, backend: str, model=None):
    """The wrapped model, compiled in ``order`` (None: eager); ``model()`` the callable."""
    module = build() if model is None else model
    if order is None:
        wrapped = minishard.ZeRO(module, stage=stage, units={Block})
        return wrapped, wrapped
    if order == "compile_then_wrap":
        wrapped = minishard.ZeRO(torch.compile(module, backend=backend), stage=stage,
                                 units={Block})
        return wrapped, wrapped
    wrapped = minishard.ZeRO(module, stage=stage, units={Block})
    if order == "wrap_then_compile_blocks":
        for block in wrapped.module[:2]:
            block.compile(backend=backend)
        return wrapped, wrapped
    return wrapped, torch.compile(wrapped, backend=backend)


def train_compiled(order: str, stage: int, backend: str, foreach: bool):
    """Rank's side: the trained full state (plain names), graphs compiled after the first step
    and after the last, and the collectives of the last step (op, tag)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model = compiled(order, stage, backend)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    graphs = []
    for step in range(STEPS):
        with minishard.ledger() as led:
            for micro in range(2):
                rows = batch(step, micro, world)[rank * ROWS:(rank + 1) * ROWS]
                with wrapped.no_sync() if micro == 0 else torch.enable_grad():
                    (model(rows).square().mean() / 2).backward()
            opt.step(), opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    state = {k.replace("_orig_mod.", ""): v for k, v in wrapped.full_state_dict().items()}
    return state, (graphs[0], graphs[-1]), issued(led)


def train_eager(stage: int):
    """The collectives of an eager step, as ``train_compiled`` lists them."""
    return train_compiled(None, stage, None, foreach=False)[2]


def issued(led) -> list[tuple[str, str]]:
    """(op, which buffers) of each collective in ``led``: the model's number left out (each
    wrap counts one more) and a compiled module's ``_orig_mod.`` (its parameters' names)."""
    return [(e.op, e.tag.split(" (model")[0].replace("_orig_mod.", "")) for e in led.entries]


CELLS = [(order, stage, "aot_eager", stage % 2 == 1) for order in ORDERS for stage in range(4)]
CELLS += [("compile_then_wrap", 3, "inductor", False), ("wrap_then_compile_blocks", 3,
                                                         "inductor", True)]


@pytest.mark.parametrize("order,stage,backend,foreach", CELLS)
def test_compiled_training_equals_one_process(pools, order, stage, backend, foreach):
    world = 2
    want = one_process(world, foreach)
    eager = pools(world).run(train_eager, stage)[0]
    for state, (first, last), issued in pools(world).run(train_compiled, order, stage, backend,
                                                        foreach, timeout=600):
        assert state.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
        assert first == last > 0, "compiled again after the first step (or never compiled)"
        assert issued == eager, "a compiled step issued other collectives than an eager one"


class Tied(nn.Module):
    """Block 1's compiled code reads block 0's weight: at stage 3 a unit not gathered."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.blocks[0](x)
        return self.blocks[1](x) + x @ self.blocks[0].lin.weight


def read_another_units_parameter(order: str) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = Tied()
    if order == "compile_then_wrap":
        model = minishard.ZeRO(torch.compile(module, backend="aot_eager"), stage=3,
                               units={Block})
    else:
        model = torch.compile(minishard.ZeRO(module, stage=3, units={Block}),
                              backend="aot_eager")
    try:
        model(torch.randn(2, D)).sum().backward()
    except Exception as error:  # dynamo wraps it: its text is ours
        return str(error)
    return "no error"


@pytest.mark.parametrize("order", ["compile_then_wrap", "compile_wrapped"])
def test_a_stand_in_read_in_compiled_code_is_named(pools, order):
    for said in pools(2).run(read_another_units_parameter, order, timeout=600):
        assert "blocks.0.lin.weight'" in said and "not gathered" in said, said
