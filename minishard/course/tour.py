"""A live tour of minishard's headline results, measured on the spot.

    torchrun --standalone --nproc_per_node=2 -m minishard.tour      (or 3, 4 ranks; --plot FILE.png)

1. SyncBatchNorm on N small per-rank batches equals BatchNorm on the one global batch, while plain
   per-rank BatchNorm does not; one all-reduce each way per layer.
2. ZeRO stages 0-3: bytes each rank holds and sends per step, measured, beside the formulas.
3. Stage 3 gathers each unit just in time: the timeline of one step and its peak.
4. Training with stage 3 equals training in one process on the global batch.
Every claim printed is asserted; nothing is pasted.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.observe.memory import bar_chart, fmt_bytes, pyplot, zero_bytes

D = 48  # 48*48 + 48 = 2352 parameters per block: a multiple of 1, 2, 3 and 4, so no padding


def _say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _global_batch(step: int, world: int, per_rank: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * per_rank, *shape, generator=g)


def syncbn_equals_global_batchnorm(rank: int, world: int) -> None:
    _say("\n1. SyncBatchNorm: N small batches normalised as ONE global batch")
    x = _global_batch(0, world, 2, 4, 5, 5) * 3 + 1   # 2 images per rank: tiny batches
    mine = x[2 * rank:2 * rank + 2].clone().requires_grad_()  # as if a conv layer came before
    local_bn, global_bn = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
    sync_bn = minishard.SyncBatchNorm(4)
    with minishard.ledger() as led:
        y_sync = sync_bn(mine)
        y_sync.square().sum().backward()
    y_local, y_global = local_bn(mine.detach()), global_bn(x)[2 * rank:2 * rank + 2]
    err_sync = (y_sync - y_global).abs().max().item()
    err_local = (y_local - y_global).abs().max().item()
    assert err_sync < 1e-5 and err_local > 1e-2, (err_sync, err_local)
    assert torch.allclose(sync_bn.running_var, global_bn.running_var, atol=1e-6)
    assert [e.op for e in led.entries] == ["all_reduce", "all_reduce"]
    _say(f"   per-rank BatchNorm vs global: max |diff| {err_local:.3f}   (wrong statistics)")
    _say(f"   SyncBatchNorm     vs global: max |diff| {err_sync:.1e}  (equal)")
    _say(f"   cost: {len(led.entries)} all-reduces per layer, of {led.entries[0].numel} and "
         f"{led.entries[1].numel} values (2C+1 forward, 2C backward), whatever N is")


class _Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def _model(blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(blocks)])


def zero_memory_and_traffic(rank: int, world: int) -> None:
    _say("\n2. ZeRO stages: what each rank holds and sends (fp32 Adam, measured)")
    psi = sum(p.numel() for p in _model().parameters())
    rows = []
    _say(f"   {'stage':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'sent/step':>11}  formula")
    for stage in range(4):
        model = minishard.ZeRO(_model(), stage=stage, units={_Block})
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(8, D)
        model(x).sum().backward(); opt.step(); opt.zero_grad()
        with minishard.ledger() as led:
            model(x).sum().backward()
        m, f = model.memory_report(opt), zero_bytes(psi, world, stage)
        grads = m["peak_full_grads"] if stage == 1 else m["grads"]
        assert (m["params"], grads, m["optimizer"]) == (f["params"], f["grads"], f["optimizer"])
        assert float(led.total_bytes()) == (3 if stage == 3 else 2) * 4 * psi * (world - 1) / world
        _say(f"   {stage:<6}{fmt_bytes(m['params']):>11}{fmt_bytes(grads):>11}"
             f"{fmt_bytes(m['optimizer']):>11}{fmt_bytes(float(led.total_bytes())):>11}  "
             f"= {fmt_bytes(sum(f.values()))} held")
        rows.append((f"stage {stage}", {"params": m["params"], "grads": grads,
                                        "optimizer": m["optimizer"]}))
    _say("\n" + "\n".join("   " + line for line in bar_chart(rows, width=40).splitlines()))
    return rows


def stage3_timeline(rank: int, world: int) -> None:
    _say("\n3. Stage 3 gathers each unit just in time")
    peaks = {}
    for units in (None, {_Block}):
        model = minishard.ZeRO(_model(6), stage=3, units=units)
        with model.record_events() as events:
            model(torch.randn(4, D)).sum().backward()
        peaks["one unit" if units is None else "per block"] = model.peak_gathered_bytes
    mark = {"gather": "G", "forward": "f", "free": "x", "backward": "b", "reduce": "R"}
    line = " ".join(f"{mark[e['event']]}{e['unit']}" for e in events if e["unit"] != "<root>")
    _say("   one step, per block unit (G gather, f forward, x free, b backward, R reduce-scatter):"
         f"\n   {line}")
    assert peaks["per block"] * 6 == peaks["one unit"]
    _say(f"   peak of full parameters held: {fmt_bytes(peaks['one unit'])} as one unit, "
         f"{fmt_bytes(peaks['per block'])} per block")
    return events


def stage3_equals_one_process(rank: int, world: int) -> None:
    _say("\n4. Stage-3 training equals one process on the global batch")
    model = minishard.ZeRO(_model(), stage=3, units={_Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = _global_batch(step, world, 4, D)
        ref_opt.zero_grad(); ref(x).square().mean().backward(); ref_opt.step()
        opt.zero_grad(); model(x[4 * rank:4 * rank + 4]).square().mean().backward(); opt.step()
    full, want = model.full_state_dict(), ref.state_dict()
    err = max((full[k] - want[k]).abs().max().item() for k in want)
    assert err < 1e-5, err
    _say(f"   after 3 AdamW steps, max |param difference| = {err:.1e}")


def _plot(path: str, rows, events) -> None:
    """Per-rank memory by stage, and the stage-3 timeline of gathered bytes (rank 0's)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    base = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer"):
        vals = [d[part] / 1024 for _, d in rows]
        left.barh([label for label, _ in rows], vals, left=base, label=part)
        base = [a + b for a, b in zip(base, vals)]
    left.set_xlabel("KiB held per rank")
    left.legend()
    t0 = events[0]["t"]
    right.step([1000 * (e["t"] - t0) for e in events],
               [e["gathered_bytes"] / 1024 for e in events], where="post")
    right.set_xlabel("ms into one stage-3 step")
    right.set_ylabel("gathered KiB")
    fig.tight_layout()
    fig.savefig(path)
    print(f"saved {path}")


def main(rank: int, world: int, plot: str | None) -> None:
    _say(f"minishard tour: {world} gloo ranks on CPU (torch {torch.__version__})")
    syncbn_equals_global_batchnorm(rank, world)
    rows = zero_memory_and_traffic(rank, world)
    events = stage3_timeline(rank, world)
    stage3_equals_one_process(rank, world)
    _say("\nEvery number above was measured in this run, and every claim asserted.")
    if plot and rank == 0:
        _plot(plot, rows, events)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser(description="minishard's live tour (run with torchrun)")
    parser.add_argument("--plot", help="also save a PNG of memory per stage and the stage-3 "
                                       "timeline (needs matplotlib: pip install 'minishard[plot]')")
    args = parser.parse_args()
    with minishard.launch.session(
            world_sizes=minishard.launch.at_least(2),
            why="it compares N ranks with one process") as (rank, world):
        main(rank, world, args.plot)
