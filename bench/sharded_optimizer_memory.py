"""Optimizer state per rank: minishard.ShardedOptimizer vs torch's ZeroRedundancyOptimizer vs
minishard.ZeRO(stage=1), fp32 AdamW after one step (exp_avg + exp_avg_sq + step), two models:

    balanced   tutorial 04's 4 x Linear(96)               (equal whole parameters)
    skewed     Embedding(4096, 64) + 4 x Linear(64)      (one parameter bigger than Ψ/N)

    torchrun --standalone --nproc_per_node=4 bench/sharded_optimizer_memory.py

Bytes of every tensor in each optimizer's state on each rank (exact, not RSS; the wrappers'
counts include AdamW's 4-byte ``step`` per parameter); the last column is ZeRO stage 1's 8Ψ/N
(equal flat slices). Prints one table on rank 0. Measured (2026-12-05, 4 ranks): balanced 74,504
B on every rank for both wrappers, 74,496 for stage 1; skewed 2,097,156 / 65,544 / 33,804 /
33,804 B for both wrappers (the embedding's rank holds 3.8x stage 1's 557,568).
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import minishard


def models():
    torch.manual_seed(0)
    yield "balanced", nn.Sequential(*[nn.Linear(96, 96) for _ in range(4)])
    torch.manual_seed(0)
    yield "skewed", nn.Sequential(nn.Embedding(4096, 64), *[nn.Linear(64, 64) for _ in range(4)])


def state_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v))


def one_step(model, opt) -> None:
    x = torch.randint(0, 64, (8, 64)) if isinstance(model[0] if not isinstance(
        model, minishard.ZeRO) else model.module[0], nn.Embedding) else torch.randn(8, 96)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def measure(name, build) -> list[int]:
    import copy
    out = []
    for kind in ("sharded", "torch", "stage1"):
        model = copy.deepcopy(build)
        if kind == "stage1":
            model = minishard.ZeRO(model, stage=1)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif kind == "torch":
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-3)
        else:
            opt = minishard.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        one_step(model, opt)
        out.append(model.memory_report(opt)["optimizer"] if kind == "stage1"
                   else state_bytes(opt.optim.state if opt.optim is not None else {}))
    return out


def main() -> None:
    with minishard.launch.session() as (rank, world):
        rows = []
        for name, model in models():
            psi = sum(p.numel() for p in model.parameters())
            mine = torch.tensor(measure(name, model))
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            rows += [(name, psi, r, *every[r].tolist()) for r in range(world)]
        if rank == 0:
            print(f"{world} ranks, fp32 AdamW; optimizer state bytes per rank")
            print(f"{'model':<10}{'Ψ':>8}{'rank':>6}{'ShardedOptimizer':>18}"
                  f"{'ZeroRedundancyOpt':>19}{'ZeRO(stage=1)':>15}{'8Ψ/N':>9}")
            for name, psi, r, ours, torchs, stage1 in rows:
                print(f"{name:<10}{psi:>8,}{r:>6}{ours:>18,}{torchs:>19,}{stage1:>15,}"
                      f"{8 * psi // world:>11,}")


if __name__ == "__main__":
    main()
