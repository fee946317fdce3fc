"""Deferred (meta-device) init and the state dicts that never hold the whole model everywhere.

What each test trusts (never the engine's own numbers):
  * the EAGER build: ``torch.manual_seed(s); Net(spec)`` in plain torch. A model built under
    ``torch.device("meta")`` and wrapped with the same seed on rank 0 (the other ranks seeded
    differently: rank 0's values must win) must equal it bit for bit at every stage, and after
    training on the ranks' rows equal the eager model trained in ONE process on the global batch.
  * for ``param_init_fn`` and mixed real/meta models: the same initialiser applied by hand, in
    ``modules()`` order, to a plain eager model (the documented rule: each module initialises its
    own tensors; a tied parameter keeps its first user's value).
  * for state dicts: the plain module's ``state_dict()``, and the gather-everywhere path.
  * for bytes: the wrap-time accounting recomputed here from the layout (padding ceil(n/N)*N).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from torch import nn

import minishard
from minishard import ZeRO

ATOL, RTOL = 1e-5, 1e-4
WORLD_SIZES = (1, 2, 3, 4)
STAGES = (0, 1, 2, 3)


# ---------------------------------------------------------------------------------- models
class Rotary(nn.Module):
    """A buffer computed from the shape, like RoPE's ``inv_freq``: on the meta device it is
    lost, so ``reset_parameters`` recomputes it (without it, deferred init must refuse)."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.d = d
        self.register_buffer("inv_freq", 1.0 / 10.0 ** (torch.arange(d) / d), persistent=False)
        if recompute:
            self.reset_parameters = self._recompute

    def _recompute(self) -> None:
        self.inv_freq.copy_(1.0 / 10.0 ** (torch.arange(self.d, device=self.inv_freq.device)
                                           / self.d))


class Block(nn.Module):
    def __init__(self, i: int, o: int, bias: bool, norm: str) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o, bias=bias)
        self.norm = nn.BatchNorm1d(o) if norm == "batch" else nn.LayerNorm(o)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


class Net(nn.Module):
    """stem (Linear, or Embedding for "lm") -> rotary scale -> blocks -> head; "lm" may tie the
    head to the embedding (``head.weight = stem.weight`` after construction, as HF does)."""

    def __init__(self, spec: dict, tie: bool | None = None) -> None:
        super().__init__()
        ws, bias = spec["widths"], spec["bias"]
        self.lm = spec["kind"] == "lm"
        self.stem = (nn.Embedding(spec["vocab"], ws[0]) if self.lm
                     else nn.Linear(spec["in_dim"], ws[0], bias=bias))
        self.rope = Rotary(ws[0])
        self.blocks = nn.ModuleList(Block(ws[i], ws[i + 1], bias, spec["norm"])
                                    for i in range(len(ws) - 1))
        self.head = nn.Linear(ws[-1], spec["vocab"] if self.lm else spec["out"], bias=bias)
        if spec["tie"] if tie is None else tie:
            self.head.weight = self.stem.weight

    def forward(self, x):
        h = self.stem(x) * self.rope.inv_freq
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@st.composite
def specs(draw, norms=("layer", "batch"), ties=True):
    kind = draw(st.sampled_from(["mlp", "lm"]))
    depth = draw(st.integers(1, 3))
    # widths >= 3: a LayerNorm over 2 features outputs +-1 up to eps, its gradient is rounding
    # noise amplified by 1/sqrt(eps), and the global-batch oracle sums in another order
    ws = draw(st.lists(st.integers(3, 13), min_size=depth + 1, max_size=depth + 1))
    spec = dict(kind=kind, widths=ws, bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                in_dim=draw(st.integers(2, 9)), out=draw(st.integers(2, 9)),
                vocab=draw(st.integers(3, 13)), norm=draw(st.sampled_from(norms)), tie=False)
    if ties and kind == "lm" and draw(st.booleans()):
        ws[-1] = ws[0]
        spec["tie"] = True
    return spec


UNITS = {None: None, "blocks": {Block}, "linears": {nn.Linear}, "lin+blocks": {Block, nn.Linear}}


def batch(spec: dict, step: int, rows: int):
    g = torch.Generator().manual_seed(1000 * spec["seed"] + step)
    if spec["kind"] == "lm":
        x, out = torch.randint(0, spec["vocab"], (rows,), generator=g), spec["vocab"]
    else:
        x, out = torch.randn(rows, spec["in_dim"], generator=g), spec["out"]
    return x, torch.randn(rows, out, generator=g)


def mismatches(got: dict, ref: dict, where: str, atol: float = 0.0, rtol: float = 0.0) -> list:
    bad = [f"{where}: keys differ {sorted(set(got) ^ set(ref))}"] if set(got) != set(ref) else []
    for k in ref:
        if k in got:
            a, b = got[k].detach(), ref[k].detach()
            if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(
                    a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=False):
                bad.append(f"{where} {k}: {a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()}")
    return [f"rank {dist.get_rank()}: {m}" for m in bad]


def trained_mismatches(got: dict, ref32: dict, ref64: dict, where: str) -> list:
    """After training, every tensor as close to the float64 single-process run (the answer) as
    ATOL + RTOL·|answer|, or, where the model is so ill-conditioned that torch's own float32
    single-process run misses that, no farther from the answer than 3x that run is. N ranks sum
    in another order than one process, so neither float32 run is the answer; the float64 one is,
    and torch's distance to it measures how much rounding this model amplifies. (Comparing with
    the float32 run alone failed a correct engine: widths [10, 12, 4, 3], 3 ranks, after 3 SGD
    steps the engine was 1.4e-6 from the answer and torch's float32 run 1.9e-5.)"""
    bad = []
    for k, answer in ref64.items():
        err = (got[k].detach().double() - answer).abs()
        torch_err = (ref32[k].detach().double() - answer).abs().max()
        if not ((err <= ATOL + RTOL * answer.abs()).all() or err.max() <= 3 * torch_err):
            bad.append(f"rank {dist.get_rank()}: {where} {k}: {err.max():.3g} from the float64 run "
                       f"(torch's float32 run: {torch_err:.3g})")
    return bad


def meta_build(spec: dict, seed: int, **kwargs) -> Net:
    """Build on the meta device; rank 0's generator is seeded with ``seed``, the others with
    something else (their values must not matter)."""
    with torch.device("meta"):
        module = Net(spec, **kwargs)
    rank = dist.get_rank()
    torch.manual_seed(seed if rank == 0 else seed + 7919 * rank)
    return module


# ================================================ 1. deferred init = the eager build, trained
def deferred_vs_eager(spec, stage, units, per_rank, steps, persist=0):
    n = dist.get_world_size()
    model = ZeRO(meta_build(spec, spec["seed"]), stage=stage, units=UNITS[units], device="cpu",
                 persist_below=persist)
    torch.manual_seed(spec["seed"])
    ref = Net(spec)
    bad = mismatches(model.full_state_dict(), ref.state_dict(), "at wrap")
    bad += mismatches({"inv_freq": model.module.rope.inv_freq},
                      {"inv_freq": ref.rope.inv_freq}, "non-persistent buffer")
    if spec["norm"] == "batch":  # per-rank BatchNorm statistics: no global-batch oracle
        return bad
    # SGD: a gradient that is exactly zero in math (a LayerNorm over 2 features feeds none back)
    # is rounding noise here, and Adam would turn that noise into steps of +-lr. Adam training
    # through the engine is compared with the global-batch oracle in test_zero.py.
    ref64 = copy.deepcopy(ref).double()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref, ref64)]
    r = dist.get_rank()
    for step in range(steps):
        x, y = batch(spec, step, n * per_rank)
        F.mse_loss(model(x[r * per_rank:(r + 1) * per_rank]),
                   y[r * per_rank:(r + 1) * per_rank]).backward()
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ref64(x if spec["kind"] == "lm" else x.double()), y.double()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        bad += trained_mismatches(model.full_state_dict(), ref.state_dict(), ref64.state_dict(),
                                  f"step {step}")
    return bad


@example(spec={"kind": "mlp", "widths": [10, 12, 4, 3], "bias": False, "seed": 0, "in_dim": 2,
               "out": 5, "vocab": 3, "norm": "layer", "tie": False},
         stage=0, world=3, units=None, per_rank=3, persist=0)  # float32: 1.9e-5 off after 3 steps
@example(spec={"kind": "mlp", "widths": [10, 12, 4, 3], "bias": True, "seed": 0, "in_dim": 2,
               "out": 5, "vocab": 3, "norm": "layer", "tie": False},
         stage=3, world=3, units=None, per_rank=2, persist=16)
@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from(list(UNITS)), per_rank=st.integers(1, 3),
       persist=st.sampled_from([0, 16]))  # 16: small parameters replicated (ZeRO persist_below)
def test_deferred_init_equals_eager_build_and_trains_like_it(pools, spec, stage, world, units,
                                                               per_rank, persist):
    results = pools(world).run(deferred_vs_eager, spec, stage, units, per_rank, 3, persist)
    assert results == [[]] * world, results


def deferred_on_a_group_without_rank_0(spec, stage, units):
    """Global ranks 1 and 2 wrap over their own group; global rank 0 is not in it. The group's
    rank 0 (global 1) initialises and broadcasts: the eager build seeded as it is."""
    group = dist.new_group([1, 2])  # every rank creates it; only its members use it
    if dist.get_rank() == 0:
        return []
    with torch.device("meta"):
        module = Net(spec)
    torch.manual_seed(spec["seed"] if dist.get_rank() == 1 else spec["seed"] + 7919)
    model = ZeRO(module, stage=stage, units=UNITS[units], process_group=group, device="cpu")
    torch.manual_seed(spec["seed"])
    return mismatches(model.full_state_dict(), Net(spec).state_dict(), "group [1, 2]")


@settings(max_examples=8)
@given(spec=specs(), stage=st.sampled_from(STAGES), units=st.sampled_from(list(UNITS)))
def test_deferred_init_on_a_group_without_global_rank_0(pools, spec, stage, units):
    results = pools(3).run(deferred_on_a_group_without_rank_0, spec, stage, units)
    assert results == [[]] * 3, results


# ============================================================== 2. param_init_fn, mixed models
def small_init(module: nn.Module) -> None:
    """An initialiser in FSDP1's style: only the module's OWN tensors, cased on its type."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, 0.02)
        if getattr(module, "bias", None) is not None:
            module.bias.uniform_(-0.1, 0.1)
    elif isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
        module.reset_parameters()
        module.weight.normal_(1.0, 0.1)
    elif isinstance(module, Rotary):
        module.reset_parameters()


def with_param_init_fn(spec, stage, units, seed):
    model = ZeRO(meta_build(spec, seed), stage=stage, units=UNITS[units], device="cpu",
                 param_init_fn=small_init)
    # oracle: a plain model built untied, the initialiser applied by hand in modules() order,
    # then tied: the tied tensor keeps its first user's (the embedding's) values
    ref = Net(spec, tie=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in ref.modules():
            if any(True for _ in m.parameters(recurse=False)) or any(
                    True for _ in m.buffers(recurse=False)):
                small_init(m)
    if spec["tie"]:
        ref.head.weight = ref.stem.weight
    return mismatches(model.full_state_dict(), ref.state_dict(), "param_init_fn")


@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from(list(UNITS)), seed=st.integers(0, 2**16))
def test_param_init_fn_initialises_each_module_in_order(pools, spec, stage, world, units, seed):
    results = pools(world).run(with_param_init_fn, spec, stage, units, seed)
    assert results == [[]] * world, results


def mixed_real_and_meta(spec, stage, units, to_meta, seed):
    """Some modules real (built with a different seed on every rank: rank 0's values must be
    kept and broadcast), the ones named in ``to_meta`` moved to the meta device."""
    torch.manual_seed(spec["seed"] + 31 * dist.get_rank())
    module = Net(spec)
    for name in to_meta:
        module.get_submodule(name).to("meta")
    torch.manual_seed(seed)
    model = ZeRO(module, stage=stage, units=UNITS[units], device="cpu")
    torch.manual_seed(spec["seed"])  # rank 0's real values
    ref = Net(spec)
    torch.manual_seed(seed)
    for name, m in ref.named_modules():  # the meta modules' own initialisers, in order
        if any(name == t or name.startswith(t + ".") for t in to_meta) and hasattr(
                m, "reset_parameters"):
            m.reset_parameters()
    return mismatches(model.full_state_dict(), ref.state_dict(), "mixed")


@given(spec=specs(ties=False), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from(list(UNITS)), seed=st.integers(0, 2**16), data=st.data())
def test_mixed_real_and_meta_modules(pools, spec, stage, world, units, seed, data):
    names = ["stem", "head"] + [f"blocks.{i}" for i in range(len(spec["widths"]) - 1)] + [
        f"blocks.{i}.lin" for i in range(len(spec["widths"]) - 1)]
    to_meta = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    results = pools(world).run(mixed_real_and_meta, spec, stage, units, to_meta, seed)
    assert results == [[]] * world, results


# ================================================== 3. what no initialiser wrote is an error
class Custom(nn.Module):
    """Every way to leave a meta tensor unwritten, one per ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.randn(4))  # drawn in __init__, no reset_parameters
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))
        if kind == "rope":
            self.rope = Rotary(4, recompute=False)

    def reset_parameters(self) -> None:
        if self.kind == "partial":
            self.scale[:2] = 1.0
            self.mask.fill_(True)
        elif self.kind == "raises":
            raise ValueError("a broken initialiser")
        elif self.kind == "shape":
            self.scale = nn.Parameter(torch.ones(5))
            self.mask.fill_(True)
        elif self.kind == "int-untouched":
            self.scale.fill_(1.0)
        elif self.kind == "allocate":  # fresh storage, never written (defect 4 of issue 28)
            self.to_empty(device="cpu", recurse=False)
            self.mask.fill_(True)
        else:  # "rope": Custom's own tensors are fine, Rotary's buffer is lost
            self.scale.fill_(1.0)
            self.mask.fill_(True)


def wrap_broken(kind: str, stage: int):
    with torch.device("meta"):
        module = Custom(kind)
    try:
        ZeRO(module, stage=stage, units={nn.Linear}, device="cpu")
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return None


EXPECTED = {"partial": ["parameter scale", "'<root>'", "Custom"],
            "raises": ["'<root>'", "ValueError: a broken initialiser"],
            "shape": ["parameter scale", "(5,)"],
            "int-untouched": ["buffer mask", "'<root>'"],
            "allocate": ["parameter scale", "'<root>'"],
            "rope": ["buffer rope.inv_freq", "'rope'", "Rotary has no reset_parameters()"]}


@given(kind=st.sampled_from(list(EXPECTED)), stage=st.sampled_from(STAGES),
       world=st.sampled_from(WORLD_SIZES))
@example(kind="allocate", stage=3, world=2)
def test_unwritten_meta_tensor_is_an_error_on_every_rank(pools, kind, stage, world):
    results = pools(world).run(wrap_broken, kind, stage)
    for r, message in enumerate(results):
        assert message is not None, f"rank {r} wrapped a model with unwritten tensors"
        for part in EXPECTED[kind]:
            assert part in message, (r, part, message)
    assert len(set(results)) == 1, results  # the same verdict everywhere: rank 0's


def test_materialising_on_the_meta_device_is_refused(pools):
    assert "device='meta'" in pools(1).run(wrap_on_meta)[0]


def wrap_on_meta():
    with torch.device("meta"):
        module = nn.Linear(2, 2)
    try:
        ZeRO(module, stage=3, device="meta")
    except ValueError as exc:
        return str(exc)


# ====================================================== 4. rank-0-only state dicts
def rank0_state_dicts(spec, stage, units, other_seed):
    rank = dist.get_rank()
    torch.manual_seed(spec["seed"])
    model = ZeRO(Net(spec), stage=stage, units=UNITS[units])
    everywhere = model.full_state_dict()
    only = model.full_state_dict(rank0_only=True)
    bad = (mismatches(only, everywhere, "rank0_only") if rank == 0 else
           ([] if only == {} else [f"rank {rank}: rank0_only returned {list(only)}"]))
    # load from rank 0 only: the others pass None; equals the plain module's state dict
    torch.manual_seed(other_seed)
    source = Net(spec).state_dict()
    model.load_full_state_dict(source if rank == 0 else None, from_rank0=True)
    bad += mismatches(model.full_state_dict(), source, "from_rank0")
    twin = ZeRO(Net(spec), stage=stage, units=UNITS[units])
    twin.load_full_state_dict(source)  # the gather-everywhere path
    bad += mismatches(model.full_state_dict(), twin.full_state_dict(), "vs everywhere")
    bad += mismatches({k: v for k, v in model.module.named_buffers()},
                      {k: v for k, v in twin.module.named_buffers()}, "buffers")
    return bad


@given(spec=specs(), stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES),
       units=st.sampled_from(list(UNITS)), other_seed=st.integers(0, 2**16))
def test_rank0_only_export_and_from_rank0_import(pools, spec, stage, world, units, other_seed):
    results = pools(world).run(rank0_state_dicts, spec, stage, units, other_seed)
    assert results == [[]] * world, results


def load_bad_from_rank0(kind):
    model = ZeRO(nn.Linear(3, 2), stage=3)
    sd = {"weight": torch.zeros(2, 3)} if kind == "missing" else {
        "weight": torch.zeros(4, 4), "bias": torch.zeros(2)}
    try:
        model.load_full_state_dict(sd if dist.get_rank() == 0 else None, from_rank0=True)
    except (KeyError, ValueError) as exc:
        return str(exc)


@pytest.mark.parametrize("kind, part", [("missing", "missing keys ['bias']"),
                                        ("shape", "weight has shape (4, 4)")])
def test_from_rank0_refusal_reaches_every_rank(pools, kind, part):
    results = pools(3).run(load_bad_from_rank0, kind)
    assert all(r is not None and part in r for r in results), results


# ==================================================== 5. bytes held while wrapping, exactly
def wrap_peak(dims, stage, meta):
    """A Sequential of Linear layers, each its own unit; returns memory_report's peak."""
    layers = lambda: nn.Sequential(*[nn.Linear(i, o) for i, o in zip(dims, dims[1:])])  # noqa
    if meta:
        with torch.device("meta"):
            module = layers()
    else:
        module = layers()
    return ZeRO(module, stage=stage, units={nn.Linear}, device="cpu").memory_report()[
        "peak_wrapping"]


@given(dims=st.lists(st.integers(1, 40), min_size=2, max_size=6),
       stage=st.sampled_from(STAGES), world=st.sampled_from(WORLD_SIZES))
def test_wrapping_peak_is_shards_plus_one_unit(pools, dims, stage, world):
    """fp32, 4 bytes an element; unit u = one Linear of n_u = i*o + o elements; each of its
    parameters is cut on dim 0 (o rows) into N chunks of ceil(o / N) rows, so a rank holds
    k_u = ceil(o / N) * (i + 1) elements (weight rows of i, bias rows of 1), padded: N*k_u. What the stage keeps per unit: stage 0 n_u (no
    padding), 1-2 N*k_u (the full buffer), 3 k_u (the shard). A meta build lays every kept
    buffer out first (stage 3 also allocates each unit's full buffer and frees it at once), then
    materialises one Linear at a time: peak = kept + the largest layer, or the layout's moment.
    An eager build starts from the whole model. Stage 0's buffers end with a stamp's room
    (comm.SUM_STAMP_NUMEL elements: comm.py's [Note: stamps])."""
    n = world
    numels = [i * o + o for i, o in zip(dims, dims[1:])]
    ks = [math.ceil(o / n) * (i + 1) for i, o in zip(dims, dims[1:])]
    kept = [x + minishard.comm.SUM_STAMP_NUMEL if stage == 0 else k * n if stage in (1, 2)
            else k for x, k in zip(numels, ks)]
    walk = sum(kept) + max(numels)
    layout = max(sum(kept[:u + 1]) + ks[u] * n for u in range(len(numels))) if stage == 3 else 0
    expected = 4 * max(walk, layout)
    for r, peak in enumerate(pools(world).run(wrap_peak, dims, stage, True)):
        assert peak == expected, (r, peak, expected)
        if stage == 3:  # the formula of the issue: shards + the largest unit
            assert peak <= 4 * (sum(ks) + max(ks) * n), (peak, sum(ks), max(ks))
    for r, peak in enumerate(pools(world).run(wrap_peak, dims, stage, False)):
        assert peak >= 4 * sum(numels), (r, peak)  # eager: the whole model, at least
