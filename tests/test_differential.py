"""The net: random small models trained by the engine vs the same model trained by plain torch.

Hypothesis draws a model and a way of training it, and every rank checks the engine against an
UNMODIFIED oracle: the plain ``nn.Module`` built from the same seed, in ONE process, on the
concatenation of every rank's rows, with a stock ``torch.optim`` optimizer. What is drawn:

  model      stem -> blocks -> head at one width; a block is lin [-> BatchNorm] -> tanh [-> inner]
             [+ a module shared with another block]; nesting (units = blocks, or blocks and their
             inner modules); a block called twice; ties inside a unit (head IS stem, a block's
             inner IS its lin) and across units (two blocks' lin weights); one module object under
             two names in two units (``blocks.a.shared is blocks.b.shared``); a layer frozen
             before wrapping (not the head: every rank needs a loss to call backward on); fp32, fp64, or fp32 with one fp64 block
  training   stages 0-3, prefetch or not; SGD(momentum) / Adam / AdamW(weight_decay), optionally
             with a second param group (biases: no weight decay, half the lr) given to the engine
             by the original Parameters (``ZeRO(param_groups=...)``) or formed by name over
             ``model.module`` after wrapping, as any torch optimizer's; world sizes 1-4 with uneven
             per-rank batches, an empty rank included (BatchNorm is minishard's SyncBatchNorm on
             the engine's side, so statistics are global, as the oracle's are); blocks skipped on
             some steps (the same on every rank; or, with ``find_unused_parameters=True`` at
             stages 0-2, different blocks on different ranks, sometimes one that NO rank runs
             in a step); a whole block, or only its lin.weight, frozen AFTER wrapping through
             its original name at some step, and unfrozen at a later one

The loss is a global mean: rank r's loss is its SUM of squared errors times W / (N * out) (W
ranks, N rows in all), so the engine's average of the ranks' gradients is the gradient of the
oracle's ``F.mse_loss`` on the global batch, whatever the per-rank sizes.

What is compared, after each backward and after each step:
  * gradients, by original name (the engine's shard gradients, assembled by ``full_state_dict``):
    ``None`` exactly where the oracle's is ``None``, else allclose. Every step for SGD; the first
    step for Adam/AdamW (later, Adam's own noise amplification below makes the runs differ);
  * the whole state dict (every parameter name, every buffer: the key sets must be equal).
    fp32 (and fp32 with an fp64 block): atol 1e-5, rtol 1e-4; fp64: atol 1e-10, rtol 1e-8 (only
    the order of additions differs; gradients: atol times the step's largest oracle gradient).
    Adam moves an element by about lr whatever its gradient's size, so where the ORACLE's gradient
    is tiny (below 1e-4 of the step's largest, 1e-10 in fp64: summation-order noise can flip its
    sign) the element may differ by up to 2 lr per such step (and the step after). Nowhere else,
    and never where the oracle's gradient is None: there the engine must not move it at all. A
    BatchNorm's running mean includes the bias before it, and gets that bias's slack.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import assume, given, strategies as st
from torch import nn

import minishard
from minishard import ZeRO

STEPS = 3
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}
TINY = {torch.float32: 1e-4, torch.float64: 1e-10}   # "tiny" gradient, relative to the step's max
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


# ------------------------------------------------------------------------------------ the model
class Inner(nn.Module):
    def __init__(self, w: int, bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w, bias=bias)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    """``lin [-> bn] -> tanh [-> inner]`` in the block's own dtype, then ``+ shared(.)`` in the
    caller's dtype when the block shares a module with another block."""

    def __init__(self, w: int, bias: bool, bn: bool, inner: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w, bias=bias)
        self.bn = nn.BatchNorm1d(w) if bn else None
        self.inner = Inner(w, bias) if inner else None
        self.shared = None

    def forward(self, h):
        x = h.to(self.lin.weight.dtype)
        y = self.lin(x)
        if self.bn is not None:
            y = self.bn(y)
        y = torch.tanh(y)
        if self.inner is not None:
            y = self.inner(y)
        y = y.to(h.dtype)
        if self.shared is not None:
            y = y + torch.tanh(self.shared(y))
        return y


class Net(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        w, bias = spec["w"], spec["bias"]
        self.stem = nn.Linear(spec["in_dim"], w, bias=bias)
        self.blocks = nn.ModuleList(Block(w, bias, i in spec["bn"], i in spec["inner"])
                                    for i in range(spec["depth"]))
        self.head = nn.Linear(w, spec["out"], bias=bias)
        self.twice = spec["twice"]
        if spec["dtype"] == "fp64":
            self.double()
        elif spec["dtype"] == "mixed":
            self.blocks[spec["mixed"]].double()
        tie = spec["tie"]
        if tie == "stem_head":
            self.head.weight = self.stem.weight
        elif tie == "inside":
            block = self.blocks[spec["tie_at"]]
            block.inner.lin.weight = block.lin.weight
        elif tie == "across":
            a, b = spec["tie_at"]
            self.blocks[b].lin.weight = self.blocks[a].lin.weight
        if spec["share"] is not None:
            a, b = spec["share"]
            shared = nn.Linear(w, w, bias=bias).to(self.stem.weight.dtype)
            self.blocks[a].shared = self.blocks[b].shared = shared
        frozen = spec["frozen"]
        if frozen is not None:
            layer = self.blocks[frozen[1]].lin if frozen[0] == "lin" else getattr(self, frozen[0])
            layer.requires_grad_(False)

    def forward(self, x, skip=frozenset()):
        h = torch.tanh(self.stem(x))
        for i, block in enumerate(self.blocks):
            if i in skip:
                continue
            h = block(h)
            if i == self.twice:
                h = block(h)
        return self.head(h)


def build(spec: dict) -> Net:
    torch.manual_seed(spec["seed"])
    return Net(spec)


def unit_arg(units):
    if units == "blocks":
        return {Block}
    if units == "nested":
        return {Block, Inner}
    return None


def dtype_of(spec: dict) -> torch.dtype:
    return torch.float64 if spec["dtype"] == "fp64" else torch.float32


def data(spec: dict, step: int, rows: list[int]):
    """The global batch of a step, and rank r's rows of it."""
    g = torch.Generator().manual_seed(7919 * spec["seed"] + step)
    n = sum(rows)
    x = torch.randn(n, spec["in_dim"], generator=g).to(dtype_of(spec))
    y = torch.randn(n, spec["out"], generator=g).to(dtype_of(spec))
    return x, y


def bias_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in module.named_parameters() if n.endswith("bias")]


def make_optimizer(spec: dict, params_or_groups):
    cls, kwargs = OPTIMIZERS[spec["opt"]]
    return cls(params_or_groups, **kwargs)


def second_group(spec: dict, module: nn.Module) -> list[dict]:
    lr = OPTIMIZERS[spec["opt"]][1]["lr"]
    return [{"params": bias_params(module), "weight_decay": 0.0, "lr": lr / 2}]


# --------------------------------------------------------------------------------- strategies
@st.composite
def specs(draw, share=True, skip=True, freeze_after=True, groups=True, bn=True, rank_skip=True):
    """A model and a way to train it. The keyword switches narrow the draw (the report on
    today's code uses them to show which defect each feature finds)."""
    depth = draw(st.integers(1, 4))
    w = draw(st.integers(3, 5))
    spec = dict(seed=draw(st.integers(0, 2**16)), w=w, depth=depth, bias=draw(st.booleans()),
                in_dim=draw(st.integers(2, 5)), out=draw(st.integers(2, 5)),
                dtype=draw(st.sampled_from(["fp32", "fp64", "mixed"])), mixed=depth - 1,
                twice=draw(st.none() | st.integers(0, depth - 1)),
                units=draw(st.sampled_from([None, "blocks", "nested"])),
                stage=draw(st.sampled_from([0, 1, 2, 3])), prefetch=draw(st.booleans()),
                world=draw(st.integers(1, 4)), opt=draw(st.sampled_from(sorted(OPTIMIZERS))),
                groups=draw(st.sampled_from([None, "at wrap", "after"])) if groups else None)
    blocks = range(depth)
    spec["bn"] = draw(st.sets(st.sampled_from(blocks))) if bn else set()
    if not (spec["bias"] or spec["bn"]):  # the second group lists the biases
        spec["groups"] = None
    spec["inner"] = draw(st.sets(st.sampled_from(blocks)))
    pairs = [(a, b) for a in blocks for b in blocks if a < b]
    same_dtype = [(a, b) for a, b in pairs if spec["dtype"] != "mixed" or depth - 1 not in (a, b)]
    tie = draw(st.sampled_from([None, "stem_head", "inside", "across"]))
    spec["tie"], spec["tie_at"] = None, None
    if tie == "stem_head":
        spec.update(tie=tie, in_dim=w, out=w)
    elif tie == "inside" and spec["inner"]:
        spec.update(tie=tie, tie_at=draw(st.sampled_from(sorted(spec["inner"]))))
    elif tie == "across" and same_dtype:
        spec.update(tie=tie, tie_at=draw(st.sampled_from(same_dtype)))
    spec["share"] = draw(st.none() | st.sampled_from(pairs)) if share and pairs else None
    # The head stays trainable: with every block skipped or frozen, a rank's loss would need no
    # gradient at all and backward would refuse to run (in plain torch too)
    frozen_stem = [("stem",)] if spec["tie"] != "stem_head" else []
    spec["frozen"] = draw(st.sampled_from([None] + frozen_stem + [("lin", i) for i in blocks]))
    # Blocks whose parameters some other unit owns (a tie or a module shared across blocks) are
    # never skipped or frozen alone: the engine's unit of "used" and "frozen" is a flat buffer.
    pinned = set(spec["tie_at"] if spec["tie"] == "across" else ()) | set(spec["share"] or ())
    free = [i for i in blocks if i not in pinned] if spec["units"] else []
    spec["skips"] = [frozenset(draw(st.sets(st.sampled_from(free)))) if skip and free
                     else frozenset() for _ in range(STEPS)]
    # find_unused_parameters=True (stages 0-2): ranks may skip DIFFERENT blocks. The oracle then
    # runs each rank's rows through the model with that rank's skips (BatchNorm would see
    # per-rank statistics there, so none is drawn with it).
    spec["find_unused"] = bool(rank_skip and free and spec["stage"] < 3 and not spec["bn"]
                               and draw(st.booleans()))
    spec["rank_skips"] = [[frozenset(draw(st.sets(st.sampled_from(free))))
                           for _ in range(spec["world"])] if spec["find_unused"] else None
                          for _ in range(STEPS)]
    if spec["find_unused"] and draw(st.booleans()):  # a block NO rank runs in one step: its
        s, b = draw(st.integers(0, STEPS - 1)), draw(st.sampled_from(free))  # grad stays None
        spec["rank_skips"][s] = [skip | {b} for skip in spec["rank_skips"][s]]
    spec["freeze_after"] = None
    if freeze_after and free and draw(st.booleans()):
        k1 = draw(st.integers(0, STEPS - 1))
        k2 = draw(st.none() | st.integers(k1 + 1, STEPS))
        spec["freeze_after"] = (draw(st.sampled_from(free)), k1, k2,
                                draw(st.sampled_from([None, "lin.weight"])))  # one parameter
    rows = draw(st.lists(st.integers(0, 3), min_size=spec["world"], max_size=spec["world"]))
    # BatchNorm needs two rows in all (an empty rank is fine); with exactly two its output is
    # +-1 whatever the input, so every gradient before it is noise: at least four rows then
    assume(sum(rows) >= (4 if spec["bn"] else 2))
    spec["rows"] = rows
    return spec


# --------------------------------------------------------------------------- one rank's check
def grads_by_name(model: ZeRO) -> dict[str, torch.Tensor]:
    """The engine's gradients under the original names: each shard's gradient is copied into the
    shard (NaN where the gradient is None), ``full_state_dict`` assembles them, the shards are
    restored."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            saved.append(p.detach().clone())
            p.copy_(p.grad if p.grad is not None else torch.full_like(p, float("nan")))
        grads = model.full_state_dict()
        for p, value in zip(model.parameters(), saved):
            p.copy_(value)
    return grads


def compare(got: torch.Tensor, want: torch.Tensor, tol: dict, slack=0.0):
    """None if close (per element |diff| <= atol + rtol |want| + slack), else the worst diff."""
    diff = (got.double() - want.double()).abs()
    bound = tol["atol"] + tol["rtol"] * want.double().abs() + slack
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)}/{got.dtype} vs {tuple(want.shape)}/{want.dtype}"
    if torch.isnan(diff).any() or (diff > bound).any():
        return f"max |diff| {diff.max().item():.3g}"
    return None


def train_and_compare(spec: dict) -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = spec["rows"]
    start = sum(rows[:rank])
    net = minishard.convert_sync_batchnorm(build(spec))
    kwargs = {}
    if spec["groups"] == "at wrap":
        kwargs["param_groups"] = second_group(spec, net)
    if spec["find_unused"]:
        kwargs["find_unused_parameters"] = True
    model = ZeRO(net, stage=spec["stage"], units=unit_arg(spec["units"]),
                 prefetch=spec["prefetch"], **kwargs)
    oracle = build(spec)
    both = (model.module, oracle) if spec["groups"] == "after" else (oracle,)
    groups = [second_group(spec, m) + [{"params": [p for p in m.parameters()
                                                   if all(p is not q for q in bias_params(m))]}]
              for m in both]  # formed by name, like any torch optimizer's, after wrapping too
    opt = make_optimizer(spec, groups[0] if spec["groups"] == "after" else
                         model.param_groups() if spec["groups"] else model.parameters())
    oracle_opt = make_optimizer(spec, groups[-1] if spec["groups"] else oracle.parameters())
    lr_of = {id(p): g["lr"] for g in oracle_opt.param_groups for p in g["params"]}
    names = [n for n, _ in oracle.named_parameters(remove_duplicate=False)]
    param_of = dict(oracle.named_parameters(remove_duplicate=False))
    slack = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in param_of.items()}
    was_tiny = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in param_of.items()}
    adam = spec["opt"] != "sgd"
    # the least precise dtype the model computes in (an fp64 block's gradients pass through fp32)
    low = dtype_of(spec)
    tol, tiny_at = TOL[low], TINY[low]
    bad = []
    for step in range(STEPS):
        where = f"rank {rank} step {step}"
        if spec["freeze_after"] is not None:
            block, k1, k2, part = spec["freeze_after"]
            if step in (k1, k2):
                for m in (model.module, oracle):
                    what = m.blocks[block] if part is None else m.blocks[block].get_parameter(part)
                    what.requires_grad_(step == k2)
        skips = spec["rank_skips"][step] or [spec["skips"][step]] * world
        xg, yg = data(spec, step, rows)
        x, y = xg[start:start + rows[rank]], yg[start:start + rows[rank]]
        n_all = sum(rows) * spec["out"]
        loss = F.mse_loss(model(x, skip=skips[rank]), y, reduction="sum") * (world / n_all)
        loss.backward()
        got_grads = grads_by_name(model)
        opt.step()
        opt.zero_grad()

        if spec["find_unused"]:  # the global mean over every rank's rows, each its own path
            bounds = [sum(rows[:r]) for r in range(world + 1)]
            sum(F.mse_loss(oracle(xg[a:b], skip=skips[r]), yg[a:b], reduction="sum")
                for r, (a, b) in enumerate(zip(bounds, bounds[1:]))).div(n_all).backward()
        else:
            F.mse_loss(oracle(xg, skip=skips[0]), yg).backward()
        want_grads = {n: param_of[n].grad for n in names}
        top = max((g.abs().max().item() for g in want_grads.values()
                   if g is not None and g.numel()), default=0.0)
        if adam:  # where the oracle's gradient is tiny, Adam may turn noise into +-lr (this
            for n, g in want_grads.items():  # step, and through its moments, the next one)
                if g is not None:
                    tiny = g.abs() <= tiny_at * top
                    slack[n] += 2 * lr_of[id(param_of[n])] * (tiny | was_tiny[n]).double()
                    was_tiny[n] = tiny
        oracle_opt.step()
        oracle_opt.zero_grad()

        if not adam or step == 0:
            for n in names:
                want, got = want_grads[n], got_grads[n]
                if want is None:
                    if not torch.isnan(got).all():
                        bad.append(f"{where} grad {n}: the oracle's is None, the engine has one")
                    continue
                if torch.isnan(got).any():
                    bad.append(f"{where} grad {n}: the engine's is None, the oracle has one")
                    continue
                err = compare(got, want, tol, tol["atol"] * top)
                if err:
                    bad.append(f"{where} grad {n}: {err}")
        state, want_state = model.full_state_dict(), oracle.state_dict()
        if set(state) != set(want_state):
            bad.append(f"{where}: state dict keys differ: {sorted(set(state) ^ set(want_state))}")
        for n, want in want_state.items():
            if n not in state:
                continue
            if not want.is_floating_point():
                err = None if torch.equal(state[n], want) else f"{state[n]} vs {want}"
            else:  # a running mean includes the bias before it: that bias's slack
                owner = n.replace("bn.running_mean", "lin.bias")
                err = compare(state[n], want, tol, slack.get(n, slack.get(owner, 0.0)))
            if err:
                bad.append(f"{where} {n}: {err}")
    return bad


@given(spec=specs())
def test_engine_trains_like_plain_torch_on_the_global_batch(pools, spec):
    results = pools(spec["world"]).run(train_and_compare, spec)
    assert results == [[]] * spec["world"], (spec, results)
