"""Hybrid vs full sharding (stage 3), minishard and FSDP2, on one 2 x (N/2) job, interleaved.

    torchrun --standalone --nproc_per_node=4 bench/hybrid.py [--model mlp|gpt] [--steps 20]

The ranks form a 2-D mesh of 2 "nodes" (rows) of N/2 ranks. Systems, same model and data as
bench/zero_vs_stock.py (one unit / fully_shard per block), Adam, taking turns one step at a time:

    floor                       the local step, no communication
    minishard full              ZeRO(stage=3) over all N ranks
    minishard hybrid            ZeRO(stage=3, mesh=2-D): shard in a row, all-reduce across rows
    FSDP2 full                  fully_shard(mesh=1-D)
    FSDP2 hybrid (HSDP)         fully_shard(mesh=2-D)

Bytes per step per rank inside a node and across nodes: minishard's from its ledger (each entry
records its group's ranks); FSDP2's from the same formulas (3Ψ(N-1)/N across for full sharding;
3Ψ(S-1)/S inside + 2(Ψ/S)(R-1)/R across for hybrid). On one machine "across nodes" is the same
loopback as "inside", so the times show the cost of the extra collective, not the saving a
slow network between machines would give; the bytes show that saving.
"""
import argparse
import copy
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import minishard
from zero_vs_stock import build, step  # the same models, data and step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if world < 4 or world % 2:
        say(f"bench/hybrid.py needs an even number of ranks >= 4 (2 nodes of >= 2), got {world}")
        dist.destroy_process_group()
        raise SystemExit(2)
    from torch.distributed.fsdp import fully_shard
    nodes, per_node = 2, world // 2
    mesh2 = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    mesh1 = init_device_mesh("cpu", (world,))
    base, block, make_batch = build(args.model)
    psi = sum(p.numel() for p in base.parameters())
    adam = lambda m: (m, torch.optim.Adam(m.parameters(), lr=1e-4))

    def fsdp2(mesh):
        m = copy.deepcopy(base)
        for sub in m.modules():
            if isinstance(sub, block):
                fully_shard(sub, mesh=mesh)
        return adam(fully_shard(m, mesh=mesh))

    n, s, r = world, per_node, nodes
    table = {  # name -> (model, optimizer), (bytes inside, across) for FSDP2 (None: the ledger)
        "floor": (adam(copy.deepcopy(base)), (0, 0)),
        "minishard full": (adam(minishard.ZeRO(copy.deepcopy(base), stage=3, units={block})),
                           None),
        "minishard hybrid": (adam(minishard.ZeRO(copy.deepcopy(base), stage=3, units={block},
                                                 mesh=mesh2)), None),
        "FSDP2 full": (fsdp2(mesh1), (0, 3 * psi * 4 * (n - 1) / n)),
        "FSDP2 hybrid (HSDP)": (fsdp2(mesh2), (3 * psi * 4 * (s - 1) / s,
                                               2 * psi / s * 4 * (r - 1) / r)),
    }
    gen = torch.Generator().manual_seed(rank)
    batches = [make_batch(gen) for _ in range(4)]
    times = {name: [] for name in table}
    sent = {}
    for i in range(args.warmup + args.steps):
        for name, ((model, opt), formula) in table.items():
            dist.barrier()
            t0 = time.perf_counter()
            with minishard.ledger() as led:
                step(model, opt, batches[i % len(batches)])
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            if formula is None:
                inside = sum(e.bytes_sent for e in led.entries
                             if len({q // per_node for q in e.ranks}) == 1)
                sent[name] = (float(inside), float(led.total_bytes() - inside))
            else:
                sent[name] = formula
    say(f"model {args.model}: {psi:,} params, {nodes} nodes x {per_node} ranks on one machine "
        f"(gloo, CPU, 1 thread/rank), stage 3, Adam, {args.steps} interleaved steps after "
        f"{args.warmup} warm-up\n")
    say(f"{'system':<22}{'median ms':>10}{'vs floor':>10}{'MiB inside':>12}{'MiB across':>12}")
    med = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
    for name in table:
        inside, across = sent[name]
        say(f"{name:<22}{med[name]:>10.1f}{med[name] / med['floor']:>9.2f}x"
            f"{inside / 2**20:>12.2f}{across / 2**20:>12.2f}")
    say(f"\nhybrid / full: minishard {med['minishard hybrid'] / med['minishard full']:.2f}x, "
        f"FSDP2 {med['FSDP2 hybrid (HSDP)'] / med['FSDP2 full']:.2f}x; minishard hybrid / FSDP2 "
        f"hybrid {med['minishard hybrid'] / med['FSDP2 hybrid (HSDP)']:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
