"""Tutorial 05: gather just in time (ZeRO stage 3 / FSDP's FULL_SHARD).

    torchrun --standalone --nproc_per_node=2 tutorials/05_just_in_time.py

Stage 3 keeps only 1/N of every parameter on each rank. A unit's full weights exist only while the
unit computes: all-gathered just before its forward, freed right after, all-gathered again when
backward reaches it, freed once its gradient has been reduce-scattered. So the most full-parameter
memory a rank ever holds is about ONE unit (two with prefetch), not the whole model, and this only
works if the model is cut into several units. This script prints the timeline of one step, unit
by unit, and measures the peak of gathered bytes with one unit for the whole model versus one unit
per block. It asserts that per-block units bring the peak down to the largest unit.

What a gather moves, in FSDP2's layout (tutorial 04, part 0): each rank sends its shard, its
chunk of ceil(R/N) rows of every parameter of the unit side by side, padded; the all-gather
lands the N shards in one buffer, rank after rank, and each parameter's rows are then copied into
place, so the module computes with its own parameters at their full shapes. So the bytes a
gather brings are every parameter padded to a multiple of N rows (not the unit's elements padded
to a multiple of N, as when the concatenation is cut: FSDP1), and each gather, like each
reduce-scatter of the gradients, costs one copy of the unit (minishard skips it for a
one-parameter unit; FSDP2 always copies in and out).

Small parameters kept whole (``persist_below=n``, DeepSpeed's stage3_param_persistence_threshold;
``replicate=nn.LayerNorm``, FSDP2's ``replicate`` beside ``fully_shard``): a unit is ONE gather
however many parameters it holds, so keeping a LayerNorm or a bias whole saves a collective only
when a whole unit is made of them. The last part counts it on a small GPT-shaped stack with one
unit per layer: each LayerNorm unit stops being gathered (twice) and reduce-scattered (once),
and all the kept-whole gradients travel in one all-reduce per step. Asserted from the unwrapped
model's layers, not from the engine.

With ``--plot FILE.png`` it draws the three runs one above the other on one time axis: the
full-parameter bytes held, forward and backward shaded, each unit's compute labelled, and the time
spent WAITING for a collective drawn as such (a flat stretch of the line is often not computing
but waiting, e.g. for an earlier unit's reduce-scatter to make room).
"""
import argparse
import contextlib
import json
import math
import os
import tempfile
import time

import torch
from torch import nn

import minishard
from minishard import comm
from minishard.observe.memory import bar_chart, fmt_bytes, pyplot

WIDTH, BLOCKS = 64, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.linear(x))


def padded_bytes(shapes: list[torch.Size], world: int) -> int:
    """A unit's gathered buffer, in fp32: each parameter's rows padded up to N chunks of
    ceil(R/N) rows (every rank's shard has the same size, as the collectives need; tutorial 04,
    part 0). With N = 3, a Linear(64, 64) block (4160 elements) gathers 4290: the weight's 64
    rows and the bias's 64 both pad to 66."""
    return 4 * sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in shapes)


@contextlib.contextmanager
def record_waits():
    """The (start, end) of every wait for a collective, for the picture only: wraps
    ``comm.Handle.wait``, the one place every collective is waited for (``Ledger.blocked_s`` adds
    up the same waits)."""
    waits, original = [], comm.Handle.wait

    def wait(handle):
        start = time.perf_counter()
        original(handle)
        waits.append((start, time.perf_counter()))
    comm.Handle.wait = wait
    try:
        yield waits
    finally:
        comm.Handle.wait = original


def one_step(units, prefetch=False, trace=None):
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=3,
                           units=units, prefetch=prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, WIDTH)
    model(x).sum().backward()  # a first step records the forward order (used by prefetch)
    opt.step()
    opt.zero_grad()
    with model.trace(trace) if trace else contextlib.nullcontext(), \
            model.record_events() as events, record_waits() as waits, minishard.ledger() as led:
        start = time.perf_counter()
        loss = model(x).sum()
        backward_at = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    opt.step()
    return model, {"events": events, "waits": waits, "blocked_s": led.blocked_s,
                   "start": start, "backward_at": backward_at, "end": end}


class GPTLayer(nn.Module):
    """A transformer block's parameter shapes: LayerNorm, a (d x d) mixer, LayerNorm, MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.mix(self.ln1(x))
        return x + self.proj(torch.relu(self.fc(self.ln2(x))))


def per_layer(m: nn.Module) -> bool:  # every LayerNorm and Linear its own unit
    return isinstance(m, (nn.LayerNorm, nn.Linear))


def persisted_step(persist_below: int) -> tuple[dict, float]:
    """One stage-3 step of the GPT stack, units per layer: the ledger's collectives by kind
    (count, bytes sent) and the step's ms."""
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[GPTLayer() for _ in range(BLOCKS)]), stage=3,
                           units=per_layer, persist_below=persist_below)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, WIDTH)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with minishard.ledger() as led:
        start = time.perf_counter()
        model(x).sum().backward()
        ms = 1000 * (time.perf_counter() - start)
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    return {op: (led.count(op), led.total_bytes(op)) for op in ops}, ms


def persisting(say, world: int) -> None:
    """persist_below=4*WIDTH+1 keeps the LayerNorms and the biases whole: the counts expected
    from the unwrapped layers, asserted."""
    threshold = 4 * WIDTH + 1
    layer = GPTLayer()
    units = [m for m in layer.modules() if per_layer(m)]
    whole_units = sum(all(p.numel() < threshold for p in m.parameters()) for m in units)
    (sharded, t0), (persisted, t1) = persisted_step(0), persisted_step(threshold)
    say(f"\nA GPT-shaped stack, {BLOCKS} layers of {len(units)} units each (LayerNorm, Linear, "
        f"LayerNorm, Linear, Linear), stage 3;\npersist_below={threshold} keeps every parameter "
        f"under {threshold} elements whole (LayerNorms, biases). Collectives in one step:")
    say(f"   {'':<22}{'all_gather':>16}{'reduce_scatter':>18}{'all_reduce':>14}{'step ms':>10}")
    for name, run, ms in (("every parameter cut", sharded, t0),
                          ("small ones whole", persisted, t1)):
        say(f"   {name:<22}" + "".join(f"{n:>6} ({fmt_bytes(float(b)):>9})" if op != "all_reduce"
                                       else f"{n:>4} ({fmt_bytes(float(b)):>7})"
                                       for op, (n, b) in run.items()) + f"{ms:>8.1f}")
    assert sharded["all_gather"][0] - persisted["all_gather"][0] == 2 * whole_units * BLOCKS
    assert sharded["reduce_scatter"][0] - persisted["reduce_scatter"][0] == whole_units * BLOCKS
    assert persisted["all_reduce"][0] - sharded["all_reduce"][0] == 1  # one bucket a step
    say(f"Each layer's {whole_units} LayerNorm units are never gathered: "
        f"{2 * whole_units * BLOCKS} gathers and {whole_units * BLOCKS} reduce-scatters fewer, "
        "one all-reduce more (asserted; the times are not).\nWith one unit per BLOCK nothing "
        "changes but a few bytes: the Linear weights are gathered anyway (bench/RESULTS.md).")


def optimizer_cost(model, steps: int = 7) -> dict:
    """Median ms of an AdamW step over the model's DTensor parameters and over plain copies of
    their local rows (the same numbers of elements and ops), for-loop and foreach."""
    params = list(model.parameters())
    plain = [p.to_local().detach().clone().requires_grad_() for p in params]
    for p, q in zip(params, plain):
        q.grad = p.grad.to_local().clone()
    out = {}
    for foreach in (False, True):
        times = []
        for tensors in (params, plain):
            opt = torch.optim.AdamW(tensors, lr=1e-4, foreach=foreach)
            took = []
            for _ in range(steps):
                start = time.perf_counter()
                opt.step()
                took.append(1000 * (time.perf_counter() - start))
            times.append(sorted(took)[steps // 2])
        out[foreach] = tuple(times)
    return out


def main(rank: int, world: int, plot: str | None) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    shapes = [p.shape for p in Block().parameters()]  # from the unwrapped block
    block_numel = sum(math.prod(s) for s in shapes)
    block_bytes = padded_bytes(shapes, world)

    runs = {}
    whole, runs["one unit"] = one_step(units=None)
    per_block, runs["per block"] = one_step(units={Block})
    trace = os.path.join(tempfile.gettempdir(), "minishard-05-trace.json")
    prefetched, runs["per block + prefetch"] = one_step(units={Block}, prefetch=True, trace=trace)
    events = runs["per block"]["events"]

    say(f"One stage-3 step on rank 0 of {world}, {BLOCKS} blocks, each its own unit:\n")
    say(f"{'t (ms)':>8}  {'event':<9}{'unit':<6}{'full params held':>18}")
    t0 = runs["per block"]["start"]
    for e in events:
        bar = "#" * round(e["gathered_bytes"] / block_bytes * 4)
        say(f"{1000 * (e['t'] - t0):8.2f}  {e['event']:<9}{e['unit']:<6}"
            f"{fmt_bytes(e['gathered_bytes']):>12}  {bar}")

    # Every unit is gathered twice (forward, backward), freed twice and reduced once.
    for kind, times in (("gather", 2), ("free", 2), ("reduce", 1)):
        for b in range(BLOCKS):
            n = sum(1 for e in events if e["event"] == kind and e["unit"] == str(b))
            assert n == times, (kind, b, n)

    peaks = {"one unit": whole.peak_gathered_bytes, "per block": per_block.peak_gathered_bytes,
             "per block + prefetch": prefetched.peak_gathered_bytes}
    say("\nPeak of gathered full parameters on this rank:")
    say(bar_chart([(k, {"gathered": v}) for k, v in peaks.items()]))
    # Padding: every parameter is cut into N chunks of ceil(R/N) rows, the last ones padded, so
    # each parameter's rows are rounded up to a multiple of N: nothing to round with 1, 2 or 4
    # ranks here (64 rows); with 3, two rows per parameter, 130 elements per block. Padding is
    # per parameter, so one unit for the whole model pads exactly as the six blocks do.
    assert peaks["one unit"] == padded_bytes(shapes * BLOCKS, world)  # everything at once
    assert padded_bytes(shapes * BLOCKS, world) == BLOCKS * block_bytes
    assert peaks["per block"] == block_bytes                   # one block at a time
    assert peaks["per block + prefetch"] <= 2 * block_bytes    # this one and the next
    pad = block_bytes - 4 * block_numel
    assert pad == 4 * (-WIDTH % world) * (WIDTH + 1), pad  # rows short of a multiple of N, x2
    say(f"\nA block is {block_numel:,} fp32 elements ({4 * block_numel:,} bytes); gathered on "
        f"{world} rank(s) it is {block_bytes:,} bytes, {pad:,} of them padding\n(each "
        f"parameter's {WIDTH} rows become {world} chunks of {math.ceil(WIDTH / world)} rows); "
        "the gather lands in one buffer and is copied out\nparameter by parameter.")
    say(f"\nPer-block units cut the peak from {fmt_bytes(peaks['one unit'])} to "
        f"{fmt_bytes(peaks['per block'])} ({peaks['one unit'] / peaks['per block']:.2f}x); "
        "prefetch holds at most two blocks. All assertions held.")
    for name, run in runs.items():
        say(f"   {name:<22} step {1000 * (run['end'] - run['start']):6.2f} ms, of which "
            f"{1000 * run['blocked_s']:6.2f} ms waiting for collectives (not asserted: timing)")

    dtensor = optimizer_cost(per_block)
    say("\nWhat DTensor parameters cost (FSDP2's, and minishard's at stages 1-3): each op on a "
        "parameter passes DTensor's\nPython dispatch first. One AdamW step over this rank's "
        f"{len(list(per_block.parameters()))} parameters (median ms, not asserted: timing):")
    for foreach, (d, p) in dtensor.items():
        say(f"   foreach={foreach!s:<5}  over the DTensors {d:6.2f} ms, over plain copies of "
            f"their local rows {p:6.2f} ms")

    persisting(say, world)

    if rank == 0:  # model.trace(path): every rank's step in one file (minishard/observe/trace.py)
        with open(trace) as f:
            assert {e["pid"] for e in json.load(f)["traceEvents"]} == set(range(world))
        say(f"\nThe prefetched step, every rank, as a Chrome trace: {trace}\n"
            "  Open it in ui.perfetto.dev (or chrome://tracing), a process per rank. Look for:\n"
            "  each 'forward N' after its 'gather N' landed, before 'free N'; 'gather N+1'\n"
            "  starting inside 'forward N' (prefetch); 'reduce N' overlapping the next units'\n"
            "  backward; the 'waits' track, where a rank sat idle. No browser: python -m\n"
            f"  minishard.observe.trace {trace} trace.png (needs matplotlib).")
    if plot and rank == 0:
        draw(plot, runs, world)


def draw(path: str, runs: dict, world: int) -> None:
    """The three runs stacked, on one time axis: bytes held, phases, units, waits."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.2 * len(runs)), sharex=True)
    for ax, (name, run) in zip(axes, runs.items()):
        t0 = run["start"]
        ms = lambda t: 1000 * (t - t0)  # noqa: E731
        ev = run["events"]
        ax.axvspan(0, ms(run["backward_at"]), color="tab:blue", alpha=0.07, lw=0)
        ax.axvspan(ms(run["backward_at"]), ms(run["end"]), color="tab:orange", alpha=0.07, lw=0)
        for i, (a, b) in enumerate(run["waits"]):
            ax.axvspan(ms(a), ms(b), color="tab:red", alpha=0.35, lw=0,
                       label="waiting for a collective" if i == 0 else None)
        xs = [0.0] + [ms(e["t"]) for e in ev] + [ms(run["end"])]
        # Nothing is gathered when a stage-3 step starts: the previous one freed everything.
        ys = [0.0] + [e["gathered_bytes"] / 1024 for e in ev] + [ev[-1]["gathered_bytes"] / 1024]
        ax.step(xs, ys, where="post", color="black", lw=1.2, label="full params held")
        top = max(ys) or 1.0
        for e in ev:
            if e["event"] in ("forward", "backward") and e["unit"] != "<root>":
                ax.annotate(("f" if e["event"] == "forward" else "b") + e["unit"],
                            (ms(e["t"]), top * 1.02), fontsize=7, ha="center")
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("KiB")
        ax.set_title(f"{name}: peak {fmt_bytes(max(e['gathered_bytes'] for e in ev))}, "
                     f"{1000 * run['blocked_s']:.1f} ms of "
                     f"{ms(run['end']):.1f} ms waiting", fontsize=9, loc="left")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("ms into one stage-3 step (rank 0); blue: forward, orange: backward; "
                        "fN/bN: unit N computes")
    fig.suptitle(f"Stage 3, {BLOCKS} blocks, {world} ranks: full parameters held over one step")
    fig.tight_layout()
    fig.savefig(path)
    print(f"saved {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="also save a PNG of the three timelines (needs matplotlib)")
    args = parser.parse_args()
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session() as (rank, world):
        main(rank, world, args.plot)
