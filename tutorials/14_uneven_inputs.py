"""Tutorial 14: uneven inputs. When ranks run out of batches at different steps.

    torchrun --standalone --nproc_per_node=2 tutorials/14_uneven_inputs.py        (2, 3 or 4)

Rank r here has 2 + r batches: the last uneven batch, a filtered dataset, a validation set that
does not divide by the number of ranks. Every collective needs every rank, so:

(a) Without Join, rank 0 leaves the loop first and goes on (here: to export the model) while the
    others are still in a step. Its first collective meets theirs: a hang, in real life until the
    process group's timeout. minishard's debug mode names it instead: a CollectiveMismatch on
    every rank, "rank 0 gathers for the state dict, rank 1 for a forward".
(b) torch's ``Join`` around the loop: a rank that has run out *shadows* the others' steps. For
    ZeRO it runs the engine on an EMPTY batch (zero rows: every gather, reduction and all-reduce
    in the same order, contributing zeros) and steps its shard of the optimizer with the averaged
    gradient, so its shard moves with everyone's. Drawn per rank below: real steps, shadow steps,
    collectives issued (the same number on every rank, asserted). The result equals DDP under
    ``Join([ddp])``: each step's gradient is the active ranks' sum over the initial world size.
    The loop decays the lr after every step: a joined rank's scheduler stopped with its loop,
    so it steps with the options the active ranks send it.
(c) The stock ZeRO-1, ``ZeroRedundancyOptimizer``, is a Joinable too, but its joined rank
    steps its shard WITHOUT the averaged gradient (DDP's shadow all-reduce discards it) and
    broadcasts that: measured here against DDP + Adam, beside minishard's stage 1 and
    minishard's ``ShardedOptimizer`` in the stock one's place (``Join([ddp, opt], model=ddp)``:
    an active rank sends the joined ranks the gradients of what they own, then all step).
FSDP1 and FSDP2 have no Join at all (their validation loops hang: torchtitan issue 1618).
"""
import copy

import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard
from minishard import comm

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(WIDTH, 2)).double()


def my_batches(rank: int) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, WIDTH, generator=gen, dtype=torch.float64),
             torch.randn(4, 2, generator=gen, dtype=torch.float64)) for _ in range(2 + rank)]


def train(model, opt, batches, joinables=None) -> None:
    """The user's loop; under ``Join(joinables, optimizer=opt, model=model)`` if given (each
    joinable's hook takes the keywords it knows: minishard.ZeRO's the optimizer it steps,
    ShardedOptimizer's the DDP model)."""
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)

    def steps():
        for x, y in batches:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            sched.step()
    if joinables is None:
        steps()
    else:
        with Join(joinables, optimizer=opt, model=model):
            steps()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def without_join(say, rank: int) -> None:
    say("(a) No Join: rank 0 has the fewest batches and goes on to export the model.")
    model = minishard.ZeRO(fresh(), stage=3, units=Block)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    comm.set_debug(True, timeout=5)  # the ranks compare each collective before issuing it
    caught = None
    try:
        train(model, opt, my_batches(rank))
        model.full_state_dict()
    except comm.CollectiveMismatch as err:
        caught = err
    finally:
        comm.set_debug(False)
    # Every rank raised at the same fingerprint exchange: still in step, the group usable.
    flag = torch.tensor([0.0 if caught is not None else 1.0])
    comm.all_reduce(flag, "max", tag="tutorial: every rank caught it")
    assert flag.item() == 0.0, "every rank must raise"
    assert "state dict" in str(caught), str(caught)
    say("    every rank raised minishard.comm.CollectiveMismatch (asserted):")
    say("    " + str(caught).replace("\n", "\n    "))
    say("    Without debug mode, each would wait in its collective until the group's timeout.\n")


def with_join(say, rank: int, world: int) -> None:
    say("(b) The same loop inside Join([model], optimizer=opt), every stage, against DDP:")
    ddp = DDP(fresh())
    train(ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2), my_batches(rank), [ddp])
    want = ddp.module.state_dict()
    for stage in range(4):
        model = minishard.ZeRO(fresh(), stage=stage, units=Block)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with minishard.ledger() as led, model.record_events() as events:
            train(model, opt, my_batches(rank), [model])
        diff = max_diff(model.full_state_dict(), want)
        assert diff < 1e-12, (stage, diff)
        steps = sum(e["event"] == "forward" and e["unit"] == "<root>" for e in events)
        mine = torch.tensor([len(my_batches(rank)), steps, led.count()], dtype=torch.float64)
        rows = torch.empty(world, 3, dtype=torch.float64)
        comm.all_gather(rows, mine, tag="tutorial: what each rank did")
        assert (rows[:, 1] == world + 1).all() and (rows[:, 2] == rows[0, 2]).all(), rows
        say(f"    stage {stage}: {diff:.1e} from DDP under Join. Per rank: real steps, shadow "
            "steps (an empty batch), collectives:")
        for r, (real, total, collectives) in enumerate(rows.long().tolist()):
            say(f"      rank {r}  " + "#" * real + "." * (total - real)
                + " " * (world + 2 - total) + f"  {real} real + {total - real} shadow, "
                f"{collectives} collectives")
    say("    (# a real step, . a shadow step: the same collectives, zero gradients, and a step "
        "of its shard.)\n")


def stock_zero(say, rank: int) -> None:
    say("(c) ZeRO-1 under Join, each against DDP + Adam under Join([ddp]):")
    ddp = DDP(fresh())
    train(ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2), my_batches(rank), [ddp])
    want = ddp.module.state_dict()
    stock = DDP(fresh())
    opt = ZeroRedundancyOptimizer(stock.parameters(), torch.optim.Adam, lr=1e-2)
    train(stock, opt, my_batches(rank), [stock, opt])
    stock_diff = max_diff(stock.module.state_dict(), want)
    ours = minishard.ZeRO(fresh(), stage=1, units=Block)
    train(ours, torch.optim.Adam(ours.parameters(), lr=1e-2), my_batches(rank), [ours])
    ours_diff = max_diff(ours.full_state_dict(), want)
    beside = DDP(fresh())
    opt = minishard.ShardedOptimizer(beside.parameters(), torch.optim.Adam, lr=1e-2)
    train(beside, opt, my_batches(rank), [beside, opt])
    beside_diff = max_diff(beside.module.state_dict(), want)
    assert max(ours_diff, beside_diff) < 1e-12 and stock_diff > 1e-6, (
        ours_diff, beside_diff, stock_diff)
    say(f"    DDP + ZeroRedundancyOptimizer, Join([ddp, opt]): {stock_diff:.3f} off (its "
        "joined rank stepped without the averaged gradient)")
    say(f"    DDP + minishard.ShardedOptimizer, Join([ddp, opt], model=ddp): {beside_diff:.1e} "
        "off")
    say(f"    minishard stage 1, Join([model], optimizer=opt): {ours_diff:.1e} off")
    say("All assertions held.")


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks; rank r has 2 + r batches of 4 rows.\n")
    without_join(say, rank)
    with_join(say, rank, world)
    stock_zero(say, rank)


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session(world_sizes=minishard.launch.at_least(2),
                                  why="uneven inputs need ranks with different batch counts"
                                  ) as (rank, world):
        main(rank, world)
