"""Property tests for the ZeRO engine (stages 0-3) against independent oracles.

What each test trusts, and what it checks:
  * the single-process oracle: the same model, built from the same seed, trained in ONE process on
    the concatenation of every rank's batch. With equal per-rank batches and a mean loss, the
    average of the per-rank gradients is the global-batch gradient, so after every step the
    engine's ``full_state_dict()`` must equal the oracle's ``state_dict()`` (fp32, allclose with
    ATOL/RTOL below: only the order of the additions differs).
  * the ledger: the numbers of elements the stage table says move per step, computed HERE from the
    unwrapped model's parameter shapes, the unit/tie ownership rule of the design and FSDP2's cut
    (each parameter's dim 0 in N chunks as torch.chunk makes them, padded to the largest), never
    read from the engine.
  * the memory report: the ZeRO formulas for fp32 Adam, per rank, from the same independent layout.
The comparisons with DDP, ZeroRedundancyOptimizer and FSDP1/FSDP2 are in test_zero_oracles.py.

Rank functions are module-level (RankPool pickles them by reference). Every rank builds the same
model from a seed; every rank computes the oracle itself and returns a list of mismatches (empty =
pass), so a failure message names the rank, the step and the tensor.
"""
from __future__ import annotations

import copy
import math
import operator
import unittest.mock
from fractions import Fraction

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import assume, example, given, settings, strategies as st
from torch import nn

import minishard
from minishard import ZeRO, comm
from minishard.zero import config

ATOL, RTOL = 1e-5, 1e-4          # engine vs the single-process oracle (fp32, 3 steps)
WORLD_SIZES = (1, 2, 3, 4)       # 3 (and 4 with odd widths) exercise the padding
STAGES = (0, 1, 2, 3)


# ---------------------------------------------------------------------------------- models
class Block(nn.Module):
    """``act(sq(act(lin(x))))``: ``lin`` maps i -> o, ``sq`` is square (o -> o), so two blocks
    with the same output width can share ``sq.weight`` (a tie across units)."""

    def __init__(self, kind: str, i: int, o: int, bias: bool) -> None:
        super().__init__()
        if kind == "conv":
            self.lin = nn.Conv2d(i, o, 3, padding=1, bias=bias)
            self.sq = nn.Conv2d(o, o, 1, bias=bias)
        else:
            self.lin = nn.Linear(i, o, bias=bias)
            self.sq = nn.Linear(o, o, bias=bias)
        self.sq._is_sq = True  # lets the "nested" unit predicate find it

    def forward(self, x):
        return torch.tanh(self.sq(torch.tanh(self.lin(x))))


class Net(nn.Module):
    """stem -> blocks -> head, times a buffer. kind "mlp" (float features), "lm" (token ids,
    Embedding stem whose weight the head may share), "conv" (images, mean-pooled before the head).
    """

    def __init__(self, spec: dict) -> None:
        super().__init__()
        kind, ws, bias = spec["kind"], spec["widths"], spec["bias"]
        self.kind, self.reuse = kind, spec.get("reuse")
        if kind == "lm":
            self.stem = nn.Embedding(spec["vocab"], ws[0])
            out = spec["vocab"]
        elif kind == "conv":
            self.stem = nn.Conv2d(spec["channels"], ws[0], 3, padding=1, bias=bias)
            out = spec["out"]
        else:
            self.stem = nn.Linear(spec["in_dim"], ws[0], bias=bias)
            out = spec["out"]
        self.blocks = nn.ModuleList(Block(kind, ws[i], ws[i + 1], bias) for i in range(len(ws) - 1))
        self.head = nn.Linear(ws[-1], out, bias=bias)
        self.register_buffer("out_scale", torch.rand(out) + 0.5)
        tie = spec.get("tie")
        if tie == "embed":
            self.head.weight = self.stem.weight
        elif tie == "blocks":
            a, b = spec["tie_pair"]
            self.blocks[b].sq.weight = self.blocks[a].sq.weight
        frozen = spec.get("frozen")
        if frozen is not None:
            layer = self.blocks[frozen[1]].lin if frozen[0] == "lin" else getattr(self, frozen[0])
            for p in layer.parameters():
                p.requires_grad_(False)

    def forward(self, x):
        h = self.stem(x)
        if self.kind != "lm":
            h = torch.tanh(h)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == self.reuse:  # the same unit called twice in one forward
                h = block(h)
        if self.kind == "conv":
            h = h.mean((2, 3))
        return self.head(h) * self.out_scale


def build(spec: dict, seed: int | None = None) -> Net:
    torch.manual_seed(spec["seed"] if seed is None else seed)
    return Net(spec)


def unit_arg(units: str | None):
    """The ``units`` argument for a name: None (one unit), a class set, or a predicate that also
    makes every Block's ``sq`` a unit nested in its Block."""
    if units is None:
        return None
    if units == "blocks":
        return {Block}
    if units == "nested":
        return lambda m: isinstance(m, Block) or getattr(m, "_is_sq", False)
    raise ValueError(units)


def unit_names(spec: dict, units: str | None) -> list[str]:
    depth = len(spec["widths"]) - 1
    names = [""]
    if units in ("blocks", "nested"):
        names += [f"blocks.{i}" for i in range(depth)]
    if units == "nested":
        names += [f"blocks.{i}.sq" for i in range(depth)]
    return names


def expected_buffers(spec: dict, units: str | None) -> list[tuple[str, bool, list[torch.Size]]]:
    """(unit, requires_grad, parameter shapes) of every flat buffer, from the UNWRAPPED model and
    the design's rule: a parameter belongs to the innermost unit that contains every module using
    it; a unit keeps one buffer per requires_grad group (all fp32 here)."""
    net = build(spec)
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in net.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    groups: dict[tuple[str, bool], list[torch.Size]] = {}
    for pid, names in names_of.items():
        owner = max((u for u in unit_names(spec, units)
                     if all(u == "" or n.startswith(u + ".") for n in names)), key=len)
        groups.setdefault((owner, params[pid].requires_grad), []).append(params[pid].shape)
    return [(u, rg, shapes) for (u, rg), shapes in groups.items()]


def numel(shapes: list[torch.Size]) -> int:
    return sum(math.prod(s) for s in shapes)


def my_rows(shape: torch.Size, world: int, r: int) -> int:
    """Rows of a parameter rank r holds when dim 0 is cut into ``world`` chunks as torch.chunk
    cuts it (FSDP2's cut; a 0-dim parameter is one row)."""
    rows = shape[0] if len(shape) else 1
    chunks = torch.empty(rows, 0).chunk(world) if rows else ()
    return chunks[r].shape[0] if r < len(chunks) else 0


def padded(shapes: list[torch.Size], world: int) -> int:
    """Elements one buffer of these parameters moves per collective: every parameter padded to
    ``world`` chunks of its largest chunk's rows (per-parameter padding, up to world-1 rows each)."""
    return sum(world * my_rows(s, world, 0) * math.prod(s[1:]) for s in shapes)


def batch(spec: dict, step: int, rows: int):
    """The GLOBAL batch of a step (every rank makes the same one and takes its rows)."""
    g = torch.Generator().manual_seed(10_000 * spec["seed"] + step)
    if spec["kind"] == "lm":
        x = torch.randint(0, spec["vocab"], (rows,), generator=g)
        out = spec["vocab"]
    elif spec["kind"] == "conv":
        s = spec["size"]
        x = torch.randn(rows, spec["channels"], s, s, generator=g)
        out = spec["out"]
    else:
        x = torch.randn(rows, spec["in_dim"], generator=g)
        out = spec["out"]
    return x, torch.randn(rows, out, generator=g)


def rows_of(t: torch.Tensor, per_rank: int) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * per_rank:(r + 1) * per_rank]


def loss_fn(out, y):
    return F.mse_loss(out, y)  # a mean: equal per-rank batches => mean of rank losses = global


# Adam's update is about lr * g/(|g| + eps): with the default eps=1e-8 a gradient element that is
# ~1e-9 in one summation order and ~-1e-9 in another moves its weight by +-lr either way, so two
# correct implementations differ by 2 lr (seen at 4 ranks on an embedding). eps=1e-3 keeps Adam's
# state and step logic under test while an element that small moves by ~lr*1e-6.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, eps=1e-3)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=1e-3)),
}


def make_opt(name: str, params):
    cls, kwargs = OPTIMIZERS[name]
    return cls(list(params), **kwargs)


def mismatches(got: dict, ref: dict, where: str, atol: float = ATOL, rtol: float = RTOL) -> list:
    bad = []
    if set(got) != set(ref):
        bad.append(f"{where}: keys differ: {sorted(set(got) ^ set(ref))}")
    for k in ref:
        if k not in got:
            continue
        a, b = got[k].detach(), ref[k].detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{where} {k}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
        elif not torch.allclose(a, b, atol=atol, rtol=rtol):
            bad.append(f"{where} {k}: max|diff| {(a - b).abs().max().item():.3g}")
    return [f"rank {dist.get_rank()}: {m}" for m in bad]


def full_view(module: nn.Module, fqn: str) -> torch.Tensor:
    return operator.attrgetter(fqn)(module)


# ------------------------------------------------------------------------------ strategies
@st.composite
def specs(draw, kinds=("mlp", "lm", "conv"), ties=(None, "blocks", "embed"), frozen=True,
          reuse=False, min_depth=1, max_depth=3):
    kind = draw(st.sampled_from(kinds))
    depth = draw(st.integers(min_depth, max_depth))
    width = st.integers(3, 17) if kind != "conv" else st.integers(2, 6)
    ws = draw(st.lists(width, min_size=depth + 1, max_size=depth + 1))
    spec = dict(kind=kind, widths=ws, bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                in_dim=draw(st.integers(3, 17)), out=draw(st.integers(3, 17)),
                vocab=draw(st.integers(3, 17)), channels=draw(st.integers(1, 3)),
                size=draw(st.integers(3, 5)), tie=None, frozen=None, reuse=None)
    if reuse:
        i = draw(st.integers(0, depth - 1))
        ws[i + 1] = ws[i]  # block i maps w -> w, so it can be applied twice
        spec["reuse"] = i
    tie = draw(st.sampled_from(ties))
    if tie == "embed" and kind == "lm":
        ws[-1] = ws[0]
        spec["tie"] = "embed"
    elif tie == "blocks" and depth >= 2:
        a, b = sorted(draw(st.lists(st.integers(0, depth - 1), min_size=2, max_size=2,
                                    unique=True)))
        ws[b + 1] = ws[a + 1]
        spec.update(tie="blocks", tie_pair=(a, b))
    if spec["reuse"] is not None:
        assume(ws[spec["reuse"] + 1] == ws[spec["reuse"]])  # a tie may have broken squareness
    if spec["tie"] == "embed":
        assume(ws[-1] == ws[0])
    if frozen:
        spec["frozen"] = draw(st.sampled_from(
            [None, ("stem",), ("head",)] + [("lin", i) for i in range(depth)]))
    return spec


# ============================================ 1. single-process oracle, all stages and sizes
def train_vs_oracle(spec, stage, units, opt_name, per_rank, steps=3, prefetch=False):
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units), prefetch=prefetch)
    ref = build(spec)
    opt, ref_opt = make_opt(opt_name, model.parameters()), make_opt(opt_name, ref.parameters())
    bad = mismatches(model.full_state_dict(), ref.state_dict(), "init", atol=0, rtol=0)
    for step in range(steps):
        xg, yg = batch(spec, step, n * per_rank)
        loss = loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(xg), yg)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the oracle's own collective: the global mean loss
        if not torch.allclose(mean_loss / n, ref_loss.detach(), atol=ATOL, rtol=RTOL):
            bad.append(f"rank {dist.get_rank()} step {step}: loss {mean_loss.item() / n} vs "
                       f"{ref_loss.item()}")
        bad += mismatches(model.full_state_dict(), ref.state_dict(), f"step {step}")
    return bad


@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]),
       opt_name=st.sampled_from(["sgd", "adam", "adamw"]), per_rank=st.integers(2, 4),
       prefetch=st.booleans())
def test_matches_single_process_training(pools, spec, stage, world, units, opt_name, per_rank,
                                         prefetch):
    results = pools(world).run(train_vs_oracle, spec, stage, units, opt_name, per_rank,
                               prefetch=prefetch)
    assert results == [[]] * world, results


# ============================================================ 3. the ledger, exactly
def ledger_one_step(spec, stage, units, per_rank, prefetch):
    """Steady state: one full step first (the optimizer has state, stage 1-2 shards are now
    newer than the full buffers, stage 3 buffers are freed). Then record exactly
    forward + backward + step + zero_grad. The window contains, for stages 1-2, the
    all-gather of the PREVIOUS step's update (issued by this forward), which is the one all-gather
    per step of the stage table; every step in a loop looks like this window. Prefetching only
    moves gathers earlier (asynchronous), so the ledger is the same with it."""
    led = steady_state_ledger(spec, stage, units, per_rank, prefetch=prefetch)
    return [(e.op, str(e.dtype), e.numel, e.group_size, e.bytes_sent) for e in led.entries]


def steady_state_ledger(spec, stage, units, per_rank, **zero_kwargs) -> minishard.comm.Ledger:
    """The ledger of the second of two training steps (see ledger_one_step)."""
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units), **zero_kwargs)
    opt = make_opt("adam", model.parameters())
    for step in range(2):
        xg, yg = batch(spec, step, n * per_rank)
        with minishard.ledger() as led:
            loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
            opt.step()
            opt.zero_grad()
    return led


@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]), prefetch=st.booleans())
def test_ledger_one_step_is_the_stage_formula(pools, spec, stage, world, units, prefetch):
    bufs = expected_buffers(spec, units)
    trainable = [n for _, rg, n in bufs if rg]
    every = [n for _, _, n in bufs]
    n = world
    # Stages 0-1 coalesce the ready buffers' reductions into collectives of up to 4 MiB: these
    # models are far smaller, so ONE reduction per step carries every trainable buffer.
    if stage == 0:  # one all-reduce of every trainable buffer, unpadded
        expect = {"all_reduce": [sum(map(numel, trainable))] if trainable else []}
        psi = sum(map(numel, trainable))
        total = Fraction(2 * (n - 1) * 4 * psi, n)
    elif stage in (1, 2):  # reduce-scatter of each trainable buffer + the forward's re-gather of
        # every buffer (frozen ones too: the user may have written any shard since), padded and
        # coalesced into one collective (stage 2 reduces per unit)
        psi = sum(padded(t, n) for t in trainable)
        psi_all = sum(padded(t, n) for t in every)
        scatters = [psi] if stage == 1 and trainable else sorted(padded(t, n) for t in trainable)
        expect = {"reduce_scatter": scatters, "all_gather": [psi_all] if every else []}
        total = Fraction((n - 1) * 4 * (psi + psi_all), n)
    else:  # all-gather before forward and before backward (frozen buffers too: backward
        # through a frozen layer needs its weight), reduce-scatter of the trainable ones.
        # Every unit of these models has an output that requires grad, so every unit's buffers
        # are gathered again for backward.
        psi_all = sum(padded(t, n) for t in every)
        psi = sum(padded(t, n) for t in trainable)
        expect = {"all_gather": sorted(2 * [padded(t, n) for t in every]),
                  "reduce_scatter": sorted(padded(t, n) for t in trainable)}
        total = Fraction((n - 1) * 4 * (2 * psi_all + psi), n)
    results = pools(world).run(ledger_one_step, spec, stage, units, 2, prefetch)
    for rank, entries in enumerate(results):
        got: dict[str, list[int]] = {}
        for op, dtype, count, group, _ in entries:
            got.setdefault(op, []).append(count)
            assert (dtype, group) == ("torch.float32", n), entries
        assert {op: sorted(v) for op, v in got.items()} == \
            {op: v for op, v in expect.items() if v}, (rank, entries)
        assert sum((e[4] for e in entries), Fraction(0)) == total, (rank, entries)
    if units is None and all(rg for _, rg, _ in bufs):  # cross-check: the headline formula
        shapes = [p.shape for p in build(spec).parameters()]  # tied weights once
        factor = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
        size = numel(shapes) if stage == 0 else padded(shapes, n)
        assert total == Fraction(factor * (n - 1) * 4 * size, n)


def ledger_forwards(spec, stage, units, per_rank):
    """After a step: two no_grad forwards, each recorded on its own."""
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    opt = make_opt("sgd", model.parameters())
    xg, yg = batch(spec, 0, n * per_rank)
    loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
    opt.step()
    opt.zero_grad()
    out = []
    for _ in range(2):
        with torch.no_grad(), minishard.ledger() as led:
            model(rows_of(xg, per_rank))
        out.append(sorted((e.op, e.numel) for e in led.entries))
    return out


@settings(max_examples=15)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_ledger_of_forwards_after_a_step(pools, spec, stage, world, units):
    """Stage 0: no collective in forward. Stages 1-2: every forward all-gathers every buffer
    once, frozen ones too (between forwards the user may write any shard, however spelled),
    coalesced: these models are far below the 4 MiB bucket, so in ONE collective. Stage 3:
    every forward all-gathers every buffer once, unit by unit."""
    bufs = expected_buffers(spec, units)
    psi_all = sum(padded(b, world) for _, _, b in bufs)
    coalesced = [("all_gather", psi_all)] if psi_all else []
    every = sorted(("all_gather", padded(b, world)) for _, _, b in bufs)
    expect = {0: [[], []], 1: [coalesced] * 2, 2: [coalesced] * 2, 3: [every, every]}[stage]
    for rank, got in enumerate(pools(world).run(ledger_forwards, spec, stage, units, 2)):
        assert got == expect, (rank, got, expect)


# ============================================================ 4. memory report
def memory_after_step(spec, stage, units, per_rank):
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xg, yg = batch(spec, 0, n * per_rank)
    loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
    opt.step()
    after_step = model.memory_report(opt)
    opt.zero_grad()
    xg, yg = batch(spec, 1, n * per_rank)
    loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
    after_backward = model.memory_report(opt)
    return after_step, after_backward, sorted(  # this rank's rows: a DTensor's local tensor
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def zero_formula(bufs, stage: int, n: int, r: int) -> dict[str, int]:
    """Bytes rank r holds, fp32 Adam, from the design's formulas applied per flat buffer: k
    padded elements per rank, of which its real rows are what the optimizer keeps state for."""
    params = grads = optim = 0
    for _, rg, shapes in bufs:
        k = padded(shapes, n) // n
        real = sum(my_rows(s, n, r) * math.prod(s[1:]) for s in shapes)
        if stage == 0:
            params += 4 * numel(shapes)
            grads += 4 * numel(shapes) if rg else 0
            optim += 8 * numel(shapes) if rg else 0
        else:
            params += 4 * k * n if stage < 3 else 4 * k
            grads += 4 * k if rg else 0
            optim += 8 * real if rg else 0
    # stage 0's buffers end with a stamp's room, and so does each bucket of gradients it
    # all-reduces (buckets of config.BUCKET_BYTES, joined: one room each; these models fill one)
    assert 4 * sum(numel(b) for _, _, b in bufs) < config.BUCKET_BYTES
    buckets = any(rg for _, rg, _ in bufs)
    stamps = 4 * comm.SUM_STAMP_NUMEL * (len(bufs) + buckets) if stage == 0 else 0
    return {"params": params, "grads": grads, "optimizer": optim, "stamps": stamps}


@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_memory_report_is_the_zero_formula(pools, spec, stage, world, units):
    bufs = expected_buffers(spec, units)
    reports = pools(world).run(memory_after_step, spec, stage, units, 2)
    for r, (after_step, after_backward, shard_numels) in enumerate(reports):
        want = zero_formula(bufs, stage, world, r)
        for when, rep in (("after step", after_step), ("after next backward", after_backward)):
            assert {k: rep[k] for k in want} == want, (r, when, rep, want, bufs)
        # what the optimizer sees: the module's parameters, each only this rank's real rows
        shapes = [s for _, _, b in bufs for s in b]
        if stage == 0:
            assert shard_numels == sorted(map(math.prod, shapes)), (r, shard_numels, bufs)
        else:
            real = [my_rows(s, world, r) * math.prod(s[1:]) for s in shapes]
            assert shard_numels == sorted(real), (r, shard_numels, bufs)
    trainable = sum(numel(b) for _, rg, b in bufs if rg)
    assert sum(a["optimizer"] for a, _, _ in reports) == \
        8 * trainable * (world if stage == 0 else 1)
    if stage > 0:  # every element is owned by exactly one rank
        assert sum(sum(s) for _, _, s in reports) == sum(numel(b) for _, _, b in bufs)


def stage3_peak(spec, units, per_rank):
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=3, units=unit_arg(units))
    opt = make_opt("sgd", model.parameters())
    peaks = []
    for step in range(2):
        xg, yg = batch(spec, step, n * per_rank)
        loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
        peaks.append(model.memory_report(opt)["peak_gathered_params"])
        opt.step()
        opt.zero_grad()
    return peaks


@given(spec=specs(ties=(None, "embed"), min_depth=3), world=st.sampled_from((2, 3, 4)))
def test_stage3_peak_gathered_params_is_one_unit_at_a_time(pools, spec, world):
    """Per-block units: the root's buffers plus ONE block's at most (and at least the largest
    single unit, which must be whole while it computes); strictly less than one unit for the
    whole model, whose peak is exactly all of its padded buffers. Frozen layers included: a
    frozen unit is gathered for backward too and must be freed after it like the others."""
    bufs = expected_buffers(spec, "blocks")
    unit_bytes: dict[str, int] = {}
    for unit, _, shapes in bufs:
        unit_bytes[unit] = unit_bytes.get(unit, 0) + 4 * padded(shapes, world)
    root = unit_bytes.pop("", 0)
    bound = root + max(unit_bytes.values())
    whole = sum(4 * padded(shapes, world) for _, _, shapes in expected_buffers(spec, None))
    per_block = pools(world).run(stage3_peak, spec, "blocks", 2)
    one_unit = pools(world).run(stage3_peak, spec, None, 2)
    for r in range(world):
        for peak in per_block[r]:
            # a unit must be whole while it computes; never more than root + one block
            assert max(max(unit_bytes.values()), root) <= peak <= bound, (r, peak, bound, bufs)
            assert peak < whole
        assert one_unit[r] == [whole, whole], (r, one_unit[r], whole)


def stage3_frozen_unit_peak():
    """Minimal: three Linear(4, 4) units, the middle one frozen, stage 3, one backward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    net[1].requires_grad_(False)
    model = ZeRO(net, stage=3, units={nn.Linear})
    model(torch.randn(2, 4)).sum().backward()
    return model.memory_report()["peak_gathered_params"]


def test_stage3_frozen_unit_is_freed_after_its_backward(pools):
    """Stage 3 keeps a unit's full params only while it computes. A unit with frozen params
    is gathered again for backward (its weight is needed for the input gradient); it must be
    freed once its backward is done, so that at most ONE Linear(4, 4) (20 elements, padded to 20
    for 2 ranks = 80 bytes; the root owns nothing) is ever gathered."""
    one_unit = 4 * padded([torch.Size([4, 4]), torch.Size([4])], 2)
    assert pools(2).run(stage3_frozen_unit_peak) == [one_unit, one_unit]


# ====================================== 5. gathered(), state dicts, reuse, eval forward
def gathered_and_state_dict(spec, stage, units, per_rank):
    """After a step: gathered() shows exactly full_state_dict()'s tensors, both match the oracle;
    writes inside gathered() persist (state dict, next forward, next step all follow them)."""
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    ref = build(spec)
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())

    def train(step):
        xg, yg = batch(spec, step, n * per_rank)
        loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref(xg), yg).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    train(0)
    sd = model.full_state_dict()
    bad = mismatches(sd, ref.state_dict(), "after step 0")
    names = [name for name, _ in ref.named_parameters(remove_duplicate=False)]
    with model.gathered() as m:
        assert m is model.module
        seen = {name: full_view(m, name).detach().clone() for name in names}
    bad += mismatches(seen, {k: sd[k] for k in names}, "gathered vs full_state_dict", 0, 0)

    # write new values inside gathered() (identical on every rank, tied weights written once)
    g = torch.Generator().manual_seed(spec["seed"] + 7)
    new = {name: torch.randn(p.shape, generator=g) for name, p in ref.named_parameters()}
    with model.gathered() as m, torch.no_grad():
        for name, value in new.items():
            full_view(m, name).copy_(value)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(new[name])
    bad += mismatches(model.full_state_dict(), ref.state_dict(), "after writes", 0, 0)
    xg, _ = batch(spec, 5, n * per_rank)
    bad += mismatches({"out": model(rows_of(xg, per_rank))},
                      {"out": rows_of(ref(xg), per_rank)}, "forward after writes")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    train(1)
    bad += mismatches(model.full_state_dict(), ref.state_dict(), "step after writes")
    return bad


@settings(max_examples=20)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_gathered_matches_state_dict_and_writes_persist(pools, spec, stage, world, units):
    results = pools(world).run(gathered_and_state_dict, spec, stage, units, 2)
    assert results == [[]] * world, results


def load_round_trip(spec, other_seed, stage, units, per_rank):
    """Load a DIFFERENT model's full state dict; it comes back out exactly and trains like it."""
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    source = build(spec, seed=other_seed)
    model.load_full_state_dict(source.state_dict())
    bad = mismatches(model.full_state_dict(), source.state_dict(), "loaded", 0, 0)
    opt, ref_opt = make_opt("adam", model.parameters()), make_opt("adam", source.parameters())
    for step in range(2):
        xg, yg = batch(spec, step, n * per_rank)
        loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(source(xg), yg).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        bad += mismatches(model.full_state_dict(), source.state_dict(), f"step {step}")
    # and back: a wrapped model's full_state_dict loads into a plain module
    plain = build(spec, seed=other_seed + 1)
    sd = model.full_state_dict()
    plain.load_state_dict(sd)  # strict: exactly the plain module's keys and shapes
    bad += mismatches(plain.state_dict(), sd, "into a plain module", 0, 0)
    return bad


@settings(max_examples=15)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]), other=st.integers(0, 2**16))
def test_load_full_state_dict_round_trips(pools, spec, stage, world, units, other):
    assume(other != spec["seed"])
    results = pools(world).run(load_round_trip, spec, other, stage, units, 2)
    assert results == [[]] * world, results


@settings(max_examples=15)
@given(spec=specs(ties=(None, "blocks", "embed"), reuse=True), stage=st.sampled_from(STAGES),
       world=st.sampled_from((2, 3, 4)), units=st.sampled_from(["blocks", "nested", None]),
       opt_name=st.sampled_from(["sgd", "adamw"]), prefetch=st.booleans())
def test_unit_called_twice_in_one_forward(pools, spec, stage, world, units, opt_name, prefetch):
    results = pools(world).run(train_vs_oracle, spec, stage, units, opt_name, 2,
                               prefetch=prefetch)
    assert results == [[]] * world, results


def eval_forward(spec, stage, units, per_rank):
    """no_grad/eval forwards (before any step, between steps) give the oracle's outputs and do
    not disturb training."""
    n = dist.get_world_size()
    model = ZeRO(build(spec), stage=stage, units=unit_arg(units))
    ref = build(spec)
    opt, ref_opt = make_opt("adam", model.parameters()), make_opt("adam", ref.parameters())
    bad = []
    for step in range(3):
        xe, _ = batch(spec, 100 + step, n * per_rank)
        model.eval()
        ref.eval()
        with torch.no_grad():
            out = model(rows_of(xe, per_rank))
            bad += mismatches({"out": out}, {"out": rows_of(ref(xe), per_rank)}, f"eval {step}")
            if out.requires_grad:
                bad.append("no_grad forward produced an output that requires grad")
        model.train()
        ref.train()
        xg, yg = batch(spec, step, n * per_rank)
        loss_fn(model(rows_of(xg, per_rank)), rows_of(yg, per_rank)).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref(xg), yg).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        bad += mismatches(model.full_state_dict(), ref.state_dict(), f"step {step}")
    return bad


@settings(max_examples=15)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_eval_no_grad_forward_matches_oracle(pools, spec, stage, world, units):
    results = pools(world).run(eval_forward, spec, stage, units, 2)
    assert results == [[]] * world, results


class ABC(nn.Module):
    """Three units; a forward runs any subset of them, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x, use: str = "abc"):
        for name in use:
            x = getattr(self, name)(x)
        return x


def partial_forwards_use_current_params(stage, uses, steps_a, steps_b, cap_units):
    """Stages 1-2 re-gather updated shards lazily, coalesced into buckets of ``cap_units``
    units, at most two in flight. Whatever units a forward skips (their gathers left pending)
    and whichever shards were updated since, every unit a forward runs must compute with the
    parameters the oracle (the plain model, one process, the global batch, the same two
    optimizers) has at that step."""
    n = dist.get_world_size()
    torch.manual_seed(0)
    oracle = ABC()
    model = ZeRO(copy.deepcopy(oracle), stage=stage, units=nn.Linear)
    flats = {name: model.units[i + 1].flats[0] for i, name in enumerate("abc")}
    # Momentum moves even a unit a forward skipped, so a pending gather of it goes stale.
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    mine = {name: list(getattr(model.module, name).parameters()) for name in "abc"}
    opts = [(sgd(mine["a"] + mine["c"]), steps_a), (sgd(mine["b"]), steps_b)]
    ran_with = {}  # the weight each unit computed with: read inside its forward
    for name in "abc":
        getattr(model.module, name).register_forward_pre_hook(
            lambda m, _, name=name: ran_with.__setitem__(name, m.weight.detach().clone()))
    ref_opts = [(sgd([*oracle.a.parameters(), *oracle.c.parameters()]), steps_a),
                (sgd(list(oracle.b.parameters())), steps_b)]
    xg = torch.randn(3 * n, 5, generator=torch.Generator().manual_seed(1))
    x = xg[3 * dist.get_rank():3 * dist.get_rank() + 3]
    bad = []
    cap = cap_units * flats["a"].full_bytes
    with unittest.mock.patch.object(minishard.zero.config, "BUCKET_BYTES", cap):
        for step, use in enumerate(uses):
            model(x, use=use).sum().backward()       # gradients averaged over the ranks
            (oracle(xg, use=use).sum() / n).backward()  # a skipped unit keeps grad None
            for name in use:  # the weights this forward computed with, vs the oracle's
                if not torch.allclose(ran_with[name], getattr(oracle, name).weight, atol=1e-5):
                    bad.append(f"step {step} ({use}): unit {name} ran with stale parameters")
            for opt, steps in opts + ref_opts:
                if steps[step]:
                    opt.step()
                opt.zero_grad()
    return bad


@example(stage=1, world=2, uses=["abc", "c", "ab"], steps=[(True, True), (True, False)] + 3 * [
    (False, False)], cap_units=2)  # {a,b} left pending, then a re-gathered before b lands it
@settings(max_examples=15)
@given(stage=st.sampled_from([1, 2]), world=st.sampled_from(WORLD_SIZES),
       uses=st.lists(st.sampled_from(["abc", "ab", "bc", "ac", "a", "b", "c"]), min_size=2,
                     max_size=5),
       steps=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=5, max_size=5),
       cap_units=st.sampled_from([1, 2, 3]))
def test_forwards_that_skip_units_never_see_stale_parameters(pools, stage, world, uses, steps,
                                                             cap_units):
    steps_a, steps_b = [s[0] for s in steps], [s[1] for s in steps]
    results = pools(world).run(partial_forwards_use_current_params, stage, uses, steps_a,
                               steps_b, cap_units)
    assert results == [[]] * world, results


def regathers_ahead_of_forward(stage, units, cap_units):
    """How many coalesced re-gathers have been issued when each unit starts computing."""
    model = ZeRO(nn.Sequential(*[nn.Linear(5, 5) for _ in range(units)]), stage=stage,
                 units=nn.Linear)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5)
    model(x).sum().backward()
    opt.step()
    issued = []
    with minishard.ledger() as led:
        for layer in model.module:  # runs after the engine's own pre-forward hook
            layer.register_forward_pre_hook(lambda *_: issued.append(led.count("all_gather")))
        cap = cap_units * model.units[1].flats[0].full_bytes
        with unittest.mock.patch.object(minishard.zero.config, "BUCKET_BYTES", cap):
            model(x)
    return issued, led.count("all_gather")


@given(stage=st.sampled_from([1, 2]), world=st.sampled_from([2, 3]), units=st.integers(1, 6),
       cap_units=st.integers(1, 3))
def test_regathers_run_at_most_two_buckets_ahead(pools, stage, world, units, cap_units):
    """Each in-flight re-gather holds a staging buffer: at most two may be alive."""
    buckets = math.ceil(units / cap_units)
    for issued, total in pools(world).run(regathers_ahead_of_forward, stage, units, cap_units):
        assert total == buckets
        for k, count in enumerate(issued):  # unit k has waited for buckets 0 .. k // cap_units
            landed = k // cap_units + 1
            assert landed <= count <= landed + 2, (issued, cap_units)  # in flight: at most 2


def rank0_values_win(spec, stage, units):
    """Every rank builds from a different seed; after wrapping all hold rank 0's model."""
    r = dist.get_rank()
    model = ZeRO(build(spec, seed=spec["seed"] + r), stage=stage, units=unit_arg(units))
    return mismatches(model.full_state_dict(), build(spec).state_dict(), "wrap", 0, 0)


@settings(max_examples=10)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from((2, 3)),
       units=st.sampled_from([None, "blocks", "nested"]))
def test_wrapping_broadcasts_rank0_values(pools, spec, stage, world, units):
    results = pools(world).run(rank0_values_win, spec, stage, units)
    assert results == [[]] * world, results


# ====================================================================== 6. errors
SMALL = dict(kind="mlp", widths=[5, 4, 3], bias=True, seed=3, in_dim=4, out=3, vocab=5,
             channels=1, size=3, tie=None, frozen=None, reuse=None)


def error_message(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test checks type and text
        return type(exc).__name__, str(exc)
    return None


def optimizer_built_before_wrapping(stage):
    """nanoGPT's and DDP's order: the optimizer is built over the plain module, then the module
    is wrapped. It trains exactly (bitwise) as one built after wrapping: at stage 0 the module
    keeps its parameter objects; at stages 1-3 (DTensors, as FSDP2's, where such an optimizer
    trains nothing) it steps the parameters that replaced them. One that already STEPPED
    before wrapping carries on as over the unwrapped model (its state keeps this rank's rows)."""
    x, y = batch(SMALL, 0, 2)
    finals = []
    for built_before in (True, False):
        net = build(SMALL)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2) if built_before else None
        model = ZeRO(net, stage=stage)
        opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            loss_fn(model(x), y).backward()
            opt.step(), opt.zero_grad()
        finals.append(model.full_state_dict())
    same = all(torch.equal(finals[0][k], finals[1][k]) for k in finals[1])
    net = build(SMALL)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # exact: no Adam noise
    oracle = copy.deepcopy(net)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    for m, o in ((net, opt), (oracle, ref)):  # one step over the plain module
        loss_fn(m(x), y).backward()
        o.step(), o.zero_grad()
    model = ZeRO(net, stage=stage)
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(2):  # then every rank its part of the batch, the oracle all of it
        xs, ys = batch(SMALL, step + 1, 2 * n)
        loss_fn(model(xs[2 * r:2 * r + 2]), ys[2 * r:2 * r + 2]).backward()
        opt.step(), opt.zero_grad()
        loss_fn(oracle(xs), ys).backward()
        ref.step(), ref.zero_grad()
    got = model.full_state_dict()
    return same, max((got[k] - v).abs().max().item() for k, v in oracle.state_dict().items())


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_built_before_wrapping_trains(pools, stage):
    for same, stepped_error in pools(2).run(optimizer_built_before_wrapping, stage):
        assert same is True, same  # bitwise: the same updates as one built after wrapping
        assert stepped_error < 1e-6, stepped_error


def wrap_twice(stage):
    net = build(SMALL)
    inner = ZeRO(net, stage=stage, units={Block})
    return [error_message(ZeRO, inner, stage),                # the wrapper itself
            error_message(ZeRO, net, stage),                  # the same module again
            error_message(ZeRO, nn.Sequential(net.blocks[0]), stage),  # a wrapped part
            error_message(ZeRO, nn.Sequential(inner), stage)]  # a parent of the wrapper


@pytest.mark.parametrize("stage", STAGES)
def test_wrapping_twice_is_refused(pools, stage):
    for results in pools(2).run(wrap_twice, stage):
        for result in results:
            assert result is not None and result[0] == "ValueError", results
            assert "already wrapped" in result[1], results


def bad_stage(stage):
    return error_message(ZeRO, build(SMALL), stage)


@pytest.mark.parametrize("stage", [5, -1, 4, "3", None, 1.5])
def test_invalid_stage_is_refused(pools, stage):
    for result in pools(2).run(bad_stage, stage):
        assert result is not None and result[0] == "ValueError", result


def disagreeing_stages(stages):
    return error_message(ZeRO, build(SMALL), stages[dist.get_rank()])


@pytest.mark.parametrize("stages", [(0, 3), (1, 2), (3, 3, 2), (2, 1, 2)])
def test_ranks_disagreeing_on_the_stage_fail_everywhere(pools, stages):
    for result in pools(len(stages)).run(disagreeing_stages, stages):
        assert result is not None and result[0] == "RuntimeError", result
        assert "disagree" in result[1], result


def disagreeing_models():
    spec = dict(SMALL, widths=[5, 4 + dist.get_rank(), 3])
    return error_message(ZeRO, build(spec), 2)


def test_ranks_wrapping_different_models_fail_everywhere(pools):
    for result in pools(2).run(disagreeing_models):
        assert result is not None and result[0] == "RuntimeError", result
        assert "disagree" in result[1], result
