"""minishard's ZeRO stages side by side with the stock systems, in ONE run, interleaved.

    torchrun --standalone --nproc_per_node=2 bench/zero_vs_stock.py [--model mlp|gpt] [--steps 30]
        [--phases] [--blocks-per-unit K] [--systems "minishard stage 3,..."] [--compile]

Every system trains the same model on the same data. After a warm-up, the systems take turns one
step at a time (so drift in the machine's speed hits all of them alike), and we report the median
step time, the ratio to the stock equivalent, and the bytes each rank sends per step (minishard's
ledger; for the stock systems the same ring formula applied to what they communicate).

    floor     the same local batch with no communication at all (a lower bound)
    control   "torch DDP per-block buckets": DDP with one bucket per block (8 all-reduces per
              step on the MLP instead of 1), what each collective costs here in torch's own C++
    stage 0   vs torch DDP
    stage 1   vs DDP + ZeroRedundancyOptimizer
    stage 2   vs FSDP1 SHARD_GRAD_OP, FSDP2 reshard_after_forward=False
    stage 3   vs FSDP1 FULL_SHARD, FSDP2 (default), and stage 3 with prefetch (and with
              prefetch and bucket_bytes=4 MiB: several units per collective)
    +debug    stage 3 with the MINISHARD_DEBUG collective-consistency check on, vs off

"ms blocked" (minishard only) is the time a step spent waiting for collectives to finish (the
ledger's ``blocked_s``): the communication NOT hidden behind computation. Prefetch is judged by
how much of it disappears.

"limit" is what this machine allows for the system's communication pattern, by the alpha-beta
model of costs.py (ALPHA per message, BETA per byte sent, measured by bench/alpha_beta.py)::

    compute = floor's forward + backward + optimizer step (times 1/N when the optimizer
              state is sharded: stages 1-3, ZeroRedundancyOptimizer, FSDP)
    comm    = sum over the step's collectives of (messages * ALPHA + bytes sent * BETA),
              each in its cheapest algorithm (all_reduce: ring, direct or doubling;
              all_gather and reduce_scatter: an exchange, N-1 messages of S/N bytes)
    hide    = the computation those collectives can run under: the backward for reductions,
              plus the forward for systems that gather parameters in it (stage 3, and the
              re-gathers of stages 1-2)
    tail    = what nothing can hide: the last reduction of the step (after the last gradient),
              and for stage 3 also the first gather (before the first layer)
    limit   = compute + max(comm - hide, tail)

taken from minishard's ledger for each design; each stock system is given the limit of the
minishard design it matches (DDP: stage 0, +ZeRO-opt: stage 1, SHARD_GRAD_OP / no-reshard:
stage 2, FULL_SHARD / FSDP2: stage 3). "vs limit" = measured / limit. The model lets
communication overlap computation for free; on 2 cores, where gloo's loopback copies run on the
same cores as the computation, no system reaches it.

``--phases`` also prints, per system, the median forward, backward and optimizer-step times, the
ms blocked in each, and the CPU time the rank used per step (all its threads: gloo's included).

minishard runs with one unit per block (as FSDP is wrapped), and stage 0 also with the whole
model as one unit (one all-reduce per step, as DDP's large buckets nearly do).

``--compile``: every system's blocks compiled in place after the wrap (``block.compile()``,
torchtitan's recipe; inductor), FSDP1 left out (its flat parameters are not compiled so);
"compile s" is the first step's time, the compiling, once per block class and system.
"""
import argparse
import copy
import gc
import inspect
import json
import resource
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard import comm


# ------------------------------------------------------------------------------------ models
class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return nn.functional.gelu(self.linear(x))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Group(nn.Sequential):
    """``--blocks-per-unit K``: K consecutive blocks, wrapped (FSDP) and sharded (minishard)
    as one."""


def build(kind: str, blocks_per_unit: int = 1):
    torch.manual_seed(0)
    if kind == "mlp":
        blocks, block = [MLPBlock(512) for _ in range(8)], MLPBlock
        make_batch = lambda g: torch.randn(32, 512, generator=g)
    else:
        blocks, block = [GPTBlock(256) for _ in range(6)], GPTBlock
        make_batch = lambda g: torch.randn(8, 64, 256, generator=g)
    if blocks_per_unit > 1:  # the same blocks and values, grouped: only the units change
        k = blocks_per_unit
        blocks, block = [Group(*blocks[i:i + k]) for i in range(0, len(blocks), k)], Group
    return nn.Sequential(*blocks), block, make_batch


# ----------------------------------------------------------------------------------- systems
def systems(kind: str, world: int, blocks_per_unit: int = 1, foreach: bool | None = None):
    """name -> (build() -> (model, optimizer), stock equivalent or None, bytes sent per step per
    rank for the stock systems: the ring formula of what they communicate; None = our ledger)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    base, block, _ = build(kind, blocks_per_unit)
    psi = sum(p.numel() for p in base.parameters())
    ring = (world - 1) / world * 4 * psi
    fresh = lambda: copy.deepcopy(base)
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-4, foreach=foreach)
    with_adam = lambda m: (m, adam(m))

    def fsdp1(strategy):
        return with_adam(FSDP(fresh(), sharding_strategy=strategy, use_orig_params=False,
                              auto_wrap_policy=ModuleWrapPolicy({block}),
                              device_id=torch.device("cpu")))

    def fsdp2(reshard):
        m = fresh()
        for sub in m.modules():
            if isinstance(sub, block):
                fully_shard(sub, reshard_after_forward=reshard)
        return with_adam(fully_shard(m, reshard_after_forward=reshard))

    def ours(stage, units, prefetch=False, bucket_bytes=0, persist_below=0):
        extra = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}  # older trees lack them
        extra.update({"persist_below": persist_below} if persist_below else {})
        return lambda: with_adam(minishard.ZeRO(fresh(), stage=stage, units=units,
                                                prefetch=prefetch, **extra))

    def leaves(m):  # every layer its own unit, as DeepSpeed fetches (attention's out_proj is
        return (type(m) is nn.Linear  # read by its parent, not called: it stays the parent's)
                or isinstance(m, (nn.LayerNorm, nn.MultiheadAttention)))

    def ddp_zero_opt():
        m = DDP(fresh())
        return m, ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=1e-4, foreach=foreach)

    def ddp_sharded_opt():
        m = DDP(fresh())
        return m, minishard.ShardedOptimizer(m.parameters(), torch.optim.Adam, lr=1e-4,
                                             foreach=foreach)

    table = {
        "floor": (lambda: with_adam(fresh()), None, 0),
        "torch DDP": (lambda: with_adam(DDP(fresh())), None, 2 * ring),
        # A control: DDP made to issue one all-reduce per block (8 on the MLP) instead of one
        # for the whole model: what each collective costs this machine in torch's own C++.
        "torch DDP per-block buckets": (lambda: with_adam(DDP(fresh(), bucket_cap_mb=0.01)),
                                        "torch DDP", 2 * ring),
        # DDP's all-reduce (two passes) and the owners' broadcasts of the updates (one)
        "torch DDP+ZeRO-opt": (ddp_zero_opt, None, 3 * ring),
        "DDP+minishard ShardedOptimizer": (ddp_sharded_opt, "torch DDP+ZeRO-opt", 3 * ring),
        "FSDP1 SHARD_GRAD_OP": (lambda: fsdp1(ShardingStrategy.SHARD_GRAD_OP), None, 2 * ring),
        "FSDP1 FULL_SHARD": (lambda: fsdp1(ShardingStrategy.FULL_SHARD), None, 3 * ring),
        "FSDP2 no-reshard": (lambda: fsdp2(False), None, 2 * ring),
        "FSDP2": (lambda: fsdp2(True), None, 3 * ring),
        "minishard stage 0": (ours(0, {block}), "torch DDP", None),
        "minishard stage 0 one unit": (ours(0, None), "torch DDP", None),
        "minishard stage 1": (ours(1, {block}), "torch DDP+ZeRO-opt", None),
        "minishard stage 2": (ours(2, {block}), "FSDP1 SHARD_GRAD_OP", None),
        "minishard stage 3": (ours(3, {block}), "FSDP1 FULL_SHARD", None),
        "minishard stage 3 +prefetch": (ours(3, {block}, True), "FSDP1 FULL_SHARD", None),
        "minishard stage 3 +prefetch +4MiB": (ours(3, {block}, True, 4 * 2**20),
                                               "FSDP1 FULL_SHARD", None),
        "minishard stage 3 +debug": (ours(3, {block}), "minishard stage 3", None),
        # DeepSpeed's stage3_param_persistence_threshold default (1e5 elements): the LayerNorms
        # and biases stay whole, their gradients all-reduced in one bucket
        "minishard stage 3 +persist 1e5": (ours(3, {block}, persist_below=100_000),
                                           "minishard stage 3", None),
        "minishard stage 3 per layer": (ours(3, leaves), "minishard stage 3", None),
        "minishard stage 3 per layer +persist 1e5": (ours(3, leaves, persist_below=100_000),
                                                     "minishard stage 3 per layer", None),
    }
    parameters = inspect.signature(minishard.ZeRO).parameters  # bench/ab.py's REF may lack them
    if "bucket_bytes" not in parameters:
        del table["minishard stage 3 +prefetch +4MiB"]
    if "persist_below" not in parameters:
        for name in [n for n in table if "persist" in n]:
            del table[name]
    return table


def _resident_kib() -> float:
    """Resident memory of this process now (Linux /proc), in KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1024


def _cpu_s() -> float:
    """CPU seconds this process has used (all threads: gloo's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def step(model, opt, x) -> dict[str, float]:
    """One training step; returns the seconds of each phase, the seconds blocked on collectives
    in each, and the CPU seconds used."""
    cpu0, t0 = _cpu_s(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with minishard.ledger() as fwd:
        loss = model(x).square().mean()
    t1 = time.perf_counter()
    with minishard.ledger() as bwd:
        loss.backward()
    t2 = time.perf_counter()
    with minishard.ledger() as upd:
        opt.step()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "cpu": _cpu_s() - cpu0,
            "blocked forward": fwd.blocked_s, "blocked backward": bwd.blocked_s,
            "blocked step": upd.blocked_s}


# ------------------------------------------------------------------------ the alpha-beta limit
_MATCHING_DESIGN = {"torch DDP": "minishard stage 0", "torch DDP+ZeRO-opt": "minishard stage 1",
                    "DDP+minishard ShardedOptimizer": "minishard stage 1",
                    "FSDP1 SHARD_GRAD_OP": "minishard stage 2",
                    "FSDP2 no-reshard": "minishard stage 2",
                    "FSDP1 FULL_SHARD": "minishard stage 3", "FSDP2": "minishard stage 3"}


def _cost(entry) -> float:
    """Seconds the alpha-beta model gives one collective, in its cheapest algorithm."""
    full = entry.numel * torch.empty((), dtype=entry.dtype).element_size()
    n = entry.group_size
    if entry.op == "all_reduce":
        return min(comm.all_reduce_cost(a, full, n) for a in comm.all_reduce_algorithms(n))
    return (n - 1) * comm.ALPHA + float(comm.ring_bytes(entry.op, full, n)) * comm.BETA


def limit_ms(name: str, entries, floor: dict[str, float], world: int) -> float | None:
    """The bench docstring's limit, in ms, for minishard system ``name`` with the collectives
    ``entries`` of one step (in issue order) and the floor's median phase times (seconds); None
    for a tree whose comm has no alpha-beta model (an older one, run by bench/ab.py)."""
    if not hasattr(comm, "all_reduce_cost"):
        return None
    sharded = "stage 0" not in name  # sharded optimizer state, and parameters gathered in forward
    compute = floor["forward"] + floor["backward"] + floor["step"] / (world if sharded else 1)
    comm_s = sum(_cost(e) for e in entries)
    hide = floor["backward"] + (floor["forward"] if sharded else 0.0)
    reductions = [e for e in entries if e.op in ("all_reduce", "reduce_scatter")]
    tail = _cost(reductions[-1]) if reductions else 0.0
    if "stage 3" in name:
        tail += next((_cost(e) for e in entries if e.op == "all_gather"), 0.0)
    return 1000 * (compute + max(comm_s - hide, tail))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", help="run one system alone (a fresh process: for its peak RSS)")
    parser.add_argument("--systems", help="comma-separated names: run only these (and the floor)")
    parser.add_argument("--blocks-per-unit", type=int, default=1,
                        help="wrap / shard K consecutive blocks as one unit (granularity)")
    parser.add_argument("--foreach", action="store_true",
                        help="every system's Adam with foreach=True (torch's CPU default is a "
                             "for-loop: one DTensor dispatch per op per parameter for FSDP2's "
                             "and minishard's stages 1-3)")
    parser.add_argument("--phases", action="store_true",
                        help="also print each system's forward / backward / step times")
    parser.add_argument("--compile", action="store_true",
                        help="compile every block of every system after the wrap (inductor)")
    parser.add_argument("--json", help="also write each system's median ms and ms blocked here "
                                       "(rank 0; bench/ab.py reads it)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    table = systems(args.model, world, args.blocks_per_unit, True if args.foreach else None)
    if args.only:
        table = {args.only: table[args.only]}
    elif args.systems:
        keep = {"floor", *args.systems.split(",")} & set(table)  # an older tree may lack some
        keep |= {table[name][1] for name in keep if table[name][1]}  # and their stock equivalents
        table = {name: row for name, row in table.items() if name in keep}
    if args.compile:
        table = {name: row for name, row in table.items() if not name.startswith("FSDP1")}
    rss_before = _resident_kib()
    built = {name: factory() for name, (factory, _, _) in table.items()}
    _, block, make_batch = build(args.model, args.blocks_per_unit)
    for model, _ in built.values() if args.compile else ():
        for sub in [m for m in model.modules() if isinstance(m, block)]:
            sub.compile()
    first = {}  # name -> the first step's seconds (with --compile: the compiling)
    gen = torch.Generator().manual_seed(rank)
    batches = [make_batch(gen) for _ in range(4)]
    times = {name: [] for name in table}
    phases = {name: [] for name in table}
    sent, entries = {}, {}
    for i in range(args.warmup + args.steps):
        for name, (model, opt) in built.items():
            x = batches[i % len(batches)]
            dist.barrier()
            t0 = time.perf_counter()
            comm.set_debug(name.endswith("+debug"))  # MINISHARD_DEBUG's cost
            with minishard.ledger() as led:
                phase = step(model, opt, x)
            dt = time.perf_counter() - t0
            comm.set_debug(False)
            first.setdefault(name, dt)
            if i >= args.warmup:
                times[name].append(dt)
                phases[name].append(phase)
                sent[name], entries[name] = float(led.total_bytes()), led.entries
    if args.only:  # one system in a fresh process: the memory it holds is its own
        gc.collect()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # high-water mark (Linux)
        grown = torch.tensor([_resident_kib() - rss_before, peak_kib - rss_before],
                             dtype=torch.float64)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        say(f"RSS {args.only}: resident growth {grown[0].item() / 1024:.1f} MiB after the steps, "
            f"peak growth {grown[1].item() / 1024:.1f} MiB (max over ranks), "
            f"median {1000 * statistics.median(times[args.only]):.1f} ms/step, first step "
            f"{first[args.only]:.1f} s")
        dist.barrier()
        dist.destroy_process_group()
        return
    psi = sum(p.numel() for p in build(args.model)[0].parameters())
    say(f"model {args.model}: {psi:,} params, {world} ranks (gloo, CPU, 1 thread/rank), "
        f"Adam, {args.steps} interleaved steps after {args.warmup} warm-up, "
        f"{args.blocks_per_unit} block(s) per unit"
        f"{', every block compiled (inductor)' if args.compile else ''}\n")
    say(f"{'system':<36}{'median ms':>10}{'vs stock':>10}{'vs floor':>10}{'MiB sent/step':>15}"
        f"{'ms blocked':>12}{'limit ms':>10}{'vs limit':>10}"
        + (f"{'compile s':>11}" if args.compile else ""))
    med = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
    blocked = ("blocked forward", "blocked backward", "blocked step")  # minishard only
    waited = {name: statistics.median(sum(p[k] for k in blocked) for p in rows) * 1000
              for name, rows in phases.items()}
    phase_med = {name: {k: statistics.median(p[k] for p in rows) for k in rows[0]}
                 for name, rows in phases.items()}
    limits = {name: limit_ms(name, entries[name], phase_med["floor"], world)
              for name in table if name.startswith("minishard")}
    limits["floor"] = med["floor"]
    # medians agree across ranks only roughly; report rank 0's, the slowest-rank max is similar
    for name, (_, stock, formula) in table.items():
        ratio = f"{med[name] / med[stock]:.2f}x" if stock in med else ""
        mib = (sent[name] if formula is None else formula) / 2**20
        wait = f"{waited[name]:.1f}" if formula is None else "-"
        limit = limits.get(name, limits.get(_MATCHING_DESIGN.get(name, ""), None))
        bound = f"{limit:>10.1f}{med[name] / limit:>9.2f}x" if limit else f"{'':>20}"
        say(f"{name:<36}{med[name]:>10.1f}{ratio:>10}{med[name] / med['floor']:>9.2f}x{mib:>15.2f}"
            f"{wait:>12}{bound}" + (f"{first[name]:>11.1f}" if args.compile else ""))
    if args.phases:
        keys = ["forward", "backward", "step", "blocked forward", "blocked backward",
                "blocked step", "cpu"]
        say(f"\nper phase, median ms (blocked: waiting on minishard's collectives; cpu: all "
            f"threads of the rank)\n{'system':<36}" + "".join(f"{k:>11}" for k in
                                                            ["fwd", "bwd", "step", "blk fwd",
                                                             "blk bwd", "blk step", "cpu"]))
        for name in table:
            say(f"{name:<36}" + "".join(f"{1000 * phase_med[name][k]:>11.1f}" for k in keys))
    off, on = "minishard stage 3", "minishard stage 3 +prefetch"
    if off in table and on in table and waited[off] > 0:
        say(f"\nprefetch: stage 3 blocked {waited[off]:.1f} ms/step waiting on collectives "
            f"without it, {waited[on]:.1f} with it: {100 * (1 - waited[on] / waited[off]):.0f}% "
            f"of the exposed communication hidden; step {med[off]:.1f} -> {med[on]:.1f} ms")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"minishard": minishard.__file__,
                       "systems": {name: {"median_ms": med[name], "blocked_ms": waited[name]}
                                   for name in table}}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
