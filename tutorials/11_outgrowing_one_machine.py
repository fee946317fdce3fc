"""Tutorial 11: outgrowing one machine -- hybrid sharding on a 2-D mesh.

Two "machines" on this one, 2 ranks each, one job of 4 (two shells, or `&` after the first):

    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --master-addr=127.0.0.1 \\
        --master-port=29511 tutorials/11_outgrowing_one_machine.py
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2 --master-addr=127.0.0.1 \\
        --master-port=29511 tutorials/11_outgrowing_one_machine.py

or with the c10d rendezvous (the same command on both machines, no node ranks):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29512 --rdzv-id=tutorial-11 tutorials/11_outgrowing_one_machine.py

(`torchrun --standalone --nproc_per_node=4` also works: one machine, which the script then
splits into two pretend nodes of 2 ranks, saying so.)

Inside a machine ranks talk over NVLink or shared memory; between machines, over a network that
is often 10x slower. Stage 3 over all N ranks sends every all-gather and reduce-scatter through
the slow links. Hybrid sharding (FSDP1's HYBRID_SHARD, FSDP2 on a 2-D mesh (HSDP), DeepSpeed's
MiCS; not ZeRO++'s hpZ, which keeps optimizer state and gradients sharded over all N ranks and
only adds an in-node copy of the parameters for the backward all-gather) arranges the ranks in a
2-D mesh, one row per node:

    mesh  [[0 1]      shard dim (a row, one node):   stage 3 inside it, gathers and all
           [2 3]]     replicate dim (a column):      the same shard on every node; only the
                                                      reduced gradient shard crosses: all-reduce

    per rank per step (R nodes of S ranks, Ψ fp32 parameters, x 4 bytes):
      full sharding   3Ψ(N-1)/N   across nodes, N = R·S
      hybrid          3Ψ(S-1)/S   inside a node   +   2(Ψ/S)(R-1)/R   across nodes

The price: each rank holds 1/S of the parameters, gradients and optimizer state, not 1/N. With
ONE rank per node (S = 1) nothing is sharded: every rank holds everything and all-reduces its
gradients across nodes, which is plain DDP (stage 0); the script says so when it sees it.

"Across nodes" for full sharding counts EVERY byte of a collective over all N ranks as crossing:
a simplification of the ring model (ranks of a node adjacent, only R of the ring's N hops join
two nodes, but every chunk passes one of them, so the whole collective runs at the inter-node
link's speed). The script prints it beside the numbers.
This script builds the mesh from what torchrun told each rank (LOCAL_WORLD_SIZE ranks per node),
trains the same model with full and with hybrid sharding, splits each ledger into bytes inside a
node and across nodes, and asserts both against the formulas, and that the two trainings agree.
"""
import gc
import os
import sys
import textwrap
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import minishard

WIDTH, BLOCKS, ROWS = 64, 4, 8  # 64*64 + 64 = 4160 parameters per block: no padding at S <= 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def nodes_from_torchrun(world: int) -> tuple[int, int, str]:
    """(nodes R, ranks per node S, how we know). torchrun numbers the ranks node by node:
    node k holds ranks k·S .. k·S+S-1, so mesh row k is node k. Every rank checks that."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = int(os.environ.get("GROUP_RANK", 0))
    facts = torch.tensor([per_node, -per_node, float(dist.get_rank() // per_node != node)])
    minishard.comm.all_reduce(facts, "max")  # do all ranks agree? (max of x and of -x)
    if facts[0] != -facts[1] or world % per_node or facts[2]:
        return 0, 0, "nodes of different sizes"
    if world // per_node > 1:
        return world // per_node, per_node, f"from torchrun: LOCAL_WORLD_SIZE={per_node}"
    if world % 2:
        return 0, 0, "one machine with an odd number of ranks"
    return 2, world // 2, "ONE machine: pretending it is 2 nodes, launch 2 agents for real ones"


def train(mesh, rank: int, world: int):
    """Stage 3 on ``mesh`` (None: full sharding over every rank); 2 steps, the second one
    recorded. Returns (the ledger of step 2, optimizer bytes held, the full parameters)."""
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=3,
                           units={Block}, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(world * ROWS, WIDTH, generator=torch.Generator().manual_seed(step))
        mine = x[rank * ROWS:(rank + 1) * ROWS]  # this rank's rows of the global batch
        with minishard.ledger() as led:
            model(mine).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return led, model.memory_report(opt)["optimizer"], model.full_state_dict()


def split_by_node(led, per_node: int) -> tuple[Fraction, Fraction]:
    """(bytes inside a node, bytes across nodes): an entry crosses if its group's ranks sit on
    more than one node (each Entry records its group's global ranks)."""
    def crosses(e):
        return len({r // per_node for r in e.ranks}) > 1
    inside = sum((e.bytes_sent for e in led.entries if not crosses(e)), Fraction(0))
    return inside, led.total_bytes() - inside


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    nodes, per_node, how = nodes_from_torchrun(world)
    if not nodes:
        say(f"tutorials/11_outgrowing_one_machine.py needs nodes of equal size ({how}, {world} "
            "ranks): e.g. two agents of --nproc-per-node=2 (see the docstring)")
        raise SystemExit(2)
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)
    say(f"{nodes} nodes x {per_node} ranks ({how}); mesh {mesh.mesh.tolist()}: rows are nodes.")
    say(f"Stage 3, {psi:,} fp32 parameters (Ψ), one step, bytes sent per rank:\n")

    full_led, full_opt, full_params = train(None, rank, world)
    hybrid_led, hybrid_opt, hybrid_params = train(mesh, rank, world)

    n, s, r = world, per_node, nodes
    expect = {  # (inside a node, across nodes), the formulas of the docstring
        "full": (Fraction(0), Fraction(3 * psi * (n - 1) * 4, n)),
        "hybrid": (Fraction(3 * psi * (s - 1) * 4, s), Fraction(2 * psi * (r - 1) * 4, s * r))}
    say(f"{'':<16}{'inside a node':>15}{'across nodes':>15}   optimizer state held")
    for name, led, opt_bytes, ways in (("full", full_led, full_opt, n),
                                       ("hybrid", hybrid_led, hybrid_opt, s)):
        got = split_by_node(led, per_node)
        assert got == expect[name], (name, got, expect[name])
        assert opt_bytes == 8 * psi // ways  # Adam's two moments, sharded `ways` ways
        say(f"{name + ' sharding':<16}{float(got[0]):>15,.0f}{float(got[1]):>15,.0f}   "
            f"{opt_bytes:>10,} B = 8Ψ/{ways}")
    say(f"\nacross nodes: full 3Ψ(N-1)/N·4 = {float(expect['full'][1]):,.0f} B, hybrid "
        f"2(Ψ/S)(R-1)/R·4 = {float(expect['hybrid'][1]):,.0f} B: "
        f"{float(expect['full'][1] / expect['hybrid'][1]):.1f}x fewer over the slow links.")
    say(textwrap.fill(
        "(Counted the simple way: an entry crosses nodes when its group spans more than one "
        "node, and then ALL its bytes count as crossing. On a ring with each node's ranks "
        f"adjacent only {r} of its {n} hops join two nodes, but every chunk passes one, so the "
        "collective runs at the inter-node link's speed.)", 100))
    if s == 1:
        ddp = Fraction(2 * psi * (r - 1) * 4, r)  # one all-reduce of the full gradient, ring
        assert expect["hybrid"] == (0, ddp), expect
        say(textwrap.fill(
            "One rank per node: the shard groups hold one rank each, nothing is sharded "
            "(optimizer state 8Ψ/1), and the only traffic is the all-reduce of the full "
            f"gradient across nodes, 2Ψ(R-1)/R·4 = {float(ddp):,.0f} B: this is plain DDP "
            "(stage 0).", 100))
    say("rank 0's hybrid ledger by group (each Entry knows its ranks and mesh dim):")
    for (dim, ranks), sent in hybrid_led.by_group().items():
        say(f"  {dim or 'default':<10} ranks {list(ranks)}: {float(sent):,.0f} B")

    worst = max((hybrid_params[k] - full_params[k]).abs().max().item() for k in full_params)
    assert worst < 1e-5, worst  # the same training: only the order of the sums differs
    say(f"\nHybrid vs full sharding after 2 Adam steps: max |param diff| {worst:.1e}. "
        "All assertions held.")
    del mesh  # the engines (and their hooks) go before the process groups: session's gc


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py. On one machine
    # (--standalone) it splits the ranks into 2 pretend nodes: an even number of them.
    with minishard.launch.session({2, 4, 6, 8}, why="2 pretend nodes of equal size"
                                  ) as (rank, world):
        main(rank, world)
