"""Parameters kept whole on every rank beside sharded ones (``replicate=``, ``persist_below=``).

The oracles, unmodified:
  * One process on the global batch: test_state's Net (a tied weight, a frozen parameter, a
    3-element unit: an empty shard at 4 ranks) with a LayerNorm, trained with torch's
    ``clip_grad_norm_`` on ``model.parameters()`` and SGD with momentum or Adam. The wrapped
    model, at stages 1-3 and 1-4 ranks (a 2x2 mesh too), with LayerNorms replicated, or every
    parameter under ``persist_below`` elements, or both through a predicate, with prefetch,
    buckets and accumulation, ends with the same parameters.
  * FSDP2 composed with torch's ``replicate`` (``fully_shard`` on the sharded units,
    ``replicate`` on the LayerNorm): the same steps give the same parameters and the same
    replicated gradients, with and without mixed precision.
  * The uninterrupted run: a checkpoint (minishard's format or DCP) saved with some parameters
    replicated loads at another world size, with or without them replicated, and finishes as
    the run that never stopped. DCP both ways with FSDP2 + replicate: bit for bit.
  * Without an oracle, as a property of the all-reduce: a replicated gradient is bit-identical on
    every rank; the optimizer's state for it is whole.
  * memory.zero_bytes(replicated=) against what ``memory_report`` measures held.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from minishard import MixedPrecision, ZeRO
from minishard.observe.memory import zero_bytes
from minishard.checkpoint.state import full_optimizer_state_dict, load_checkpoint, save_checkpoint

from test_dcp import assert_same_optimizer_state
from test_state import (GLOBAL_BATCH, Block, Gate, Net, assert_same_state, fresh, global_batch,
                        ws_rank)

TIGHT = dict(rtol=1e-10, atol=1e-12)
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


class Normed(Net):
    """test_state's Net with a LayerNorm first (owned by the root unit)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return super().forward(self.norm(x))


# What is kept whole: LayerNorms; every parameter of fewer than 9 elements (the biases, the
# frozen scale, Gate's 3, the LayerNorm's); everything (the tied weight too: DDP at any stage);
# a predicate (the LayerNorm and the Gate unit, whose unit then has no sharded buffer at all).
KEEP = {"sharded": {}, "layernorm": dict(replicate=nn.LayerNorm),
        "small": dict(persist_below=9), "everything": dict(persist_below=10**6),
        "predicate": dict(replicate=lambda m: isinstance(m, (nn.LayerNorm, Gate)))}


def wrap(keep, stage, seed=0, mesh=None, **kw):
    torch.manual_seed(seed)
    return ZeRO(Normed().double(), stage=stage, units=(Block, Gate), mesh=mesh, **KEEP[keep], **kw)


def train(model, opt, steps, world=1, rank=0, micro=False):
    """Steps on the global batch (this rank's slice), gradients clipped by torch's
    clip_grad_norm_ on model.parameters(); ``micro``: two micro-batches, the first accumulated
    without communication (DDP's flag)."""
    for step in steps:
        x, y = global_batch(step)
        n = GLOBAL_BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        if micro:
            h = n // 2
            model.require_backward_grad_sync = False
            (((model(x[:h]) - y[:h]) ** 2).sum() / y.numel()).backward()
            model.require_backward_grad_sync = True
            (((model(x[h:]) - y[h:]) ** 2).sum() / y.numel()).backward()
        else:
            ((model(x) - y) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()


def weights(state_dict):
    """The parameters of a state dict (the blocks' call counters count micro-batches)."""
    return {k: v for k, v in state_dict.items() if not k.endswith("calls")}


def one_process(opt_name, steps=3):
    torch.manual_seed(0)
    net = Normed().double()
    train(net, OPTIMIZERS[opt_name](net.parameters()), range(steps))
    return net.state_dict()


def replicated_grads(model) -> dict[str, torch.Tensor]:
    """This rank's gradient of every parameter that is whole on every rank."""
    return {name: p.grad.to_local().clone() for name, p in model.module.named_parameters()
            if p.grad is not None and all(isinstance(pl, Replicate) for pl in p.placements)}


def trained(keep, stage, opt_name, prefetch=False, bucket_bytes=0, micro=False, hybrid=False):
    world, rank = ws_rank()
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, world // 2))
    model = wrap(keep, stage, mesh=mesh, prefetch=prefetch, bucket_bytes=bucket_bytes)
    opt = OPTIMIZERS[opt_name](model.parameters())
    train(model, opt, range(3), world, rank, micro)
    placements = {name: tuple(map(repr, p.placements))
                  for name, p in model.module.named_parameters()}
    whole_state = all(v.to_local().shape == p.shape for p, s in opt.state.items()
                      if all(isinstance(pl, Replicate) for pl in p.placements)
                      for v in s.values() if isinstance(v, DTensor) and v.dim())
    flats = [f.name for u in model.units for f in u.flats if f.name.endswith("/replicated")]
    return model.full_state_dict(), replicated_grads(model), placements, whole_state, flats


def expected_whole(keep) -> set[str]:
    """The parameters KEEP[keep] replicates, from the unwrapped model alone."""
    net = Normed()
    kw = KEEP[keep]
    matches = kw.get("replicate", lambda m: False)
    if isinstance(matches, type):
        cls = matches
        matches = lambda m: isinstance(m, cls)  # noqa: E731
    out = set()
    for mname, m in net.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            if matches(m) or p.numel() < kw.get("persist_below", 0):
                out.add(f"{mname}.{attr}" if mname else attr)
    return out & {name for name, _ in net.named_parameters()}  # a tied one: its first name


@settings(max_examples=10)
@given(world=st.integers(1, 4), stage=st.integers(1, 3),
       keep=st.sampled_from(["layernorm", "small", "everything", "predicate"]),
       opt_name=st.sampled_from(sorted(OPTIMIZERS)), prefetch=st.booleans(),
       bucket_bytes=st.sampled_from([0, 4096]), micro=st.booleans(), hybrid=st.booleans())
@example(world=3, stage=3, keep="small", opt_name="sgd", prefetch=True, bucket_bytes=4096,
         micro=False, hybrid=False)
@example(world=4, stage=2, keep="predicate", opt_name="adam", prefetch=False, bucket_bytes=0,
         micro=True, hybrid=False)
@example(world=4, stage=3, keep="layernorm", opt_name="adam", prefetch=False, bucket_bytes=0,
         micro=False, hybrid=True)
@example(world=2, stage=1, keep="small", opt_name="adam", prefetch=False, bucket_bytes=0,
         micro=True, hybrid=False)
@example(world=3, stage=3, keep="everything", opt_name="sgd", prefetch=True, bucket_bytes=0,
         micro=False, hybrid=False)
def test_training_with_replicated_parameters_equals_one_process(pools, world, stage, keep,
                                                                opt_name, prefetch, bucket_bytes,
                                                                micro, hybrid):
    hybrid = hybrid and world == 4
    want = one_process(opt_name)
    results = pools(world).run(trained, keep, stage, opt_name, prefetch, bucket_bytes, micro,
                               hybrid)
    whole = expected_whole(keep)
    for sd, grads, placements, whole_state, flats in results:
        assert_same_state(weights(sd), weights(want), **TIGHT)
        assert whole_state, "a replicated parameter's optimizer state is not whole"
        assert flats, "no replicated flat buffer was built"
        for name, pl in placements.items():
            replicated = name in whole or not Normed().get_parameter(name).dim()
            assert set(pl) == ({"Replicate()"} if replicated else {"Shard(dim=0)", "Replicate()"}
                               if hybrid else {"Shard(dim=0)"}), (name, pl)
        assert {n for n in grads if Normed().get_parameter(n).dim()} == \
            {n for n in whole if Normed().get_parameter(n).requires_grad}
    for name, grad in results[0][1].items():  # bit-identical on every rank
        for r, (_, other, *_) in enumerate(results[1:], 1):
            assert torch.equal(grad, other[name]), f"{name}'s gradient differs on rank {r}"


def test_a_tied_parameter_replicated_on_one_side_only_is_refused(pools):
    for message in pools(2).run(_tied_refusal):
        assert "tied" in message and "inp.weight" in message and "out.weight" in message


def _tied_refusal():
    net = Normed()
    try:
        ZeRO(net, stage=3, units=(Block, Gate), replicate=lambda m: m is net.inp)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def placements_at_the_threshold(n):
    """A model whose parameters have n-1, n and n+1 elements, wrapped with persist_below=n."""
    net = nn.Sequential(nn.Linear(1, n - 1, bias=False), nn.Linear(1, n, bias=False),
                        nn.Linear(1, n + 1, bias=False))
    model = ZeRO(net, stage=3, persist_below=n)
    return [(p.numel(), type(p.placements[-1]).__name__) for p in model.parameters()]


@pytest.mark.parametrize("n", [4, 9])
def test_persist_below_n_keeps_exactly_the_parameters_of_fewer_than_n_elements(pools, n):
    """"Below n" is strict, as DeepSpeed's persistence threshold: a parameter of exactly n
    elements is sharded."""
    for got in pools(2).run(placements_at_the_threshold, n):
        assert got == [(n - 1, "Replicate"), (n, "Shard"), (n + 1, "Shard")]


def clip_norm(keep, stage, norm_type):
    """The norm clip_grad_norm_ returns after one backward on the global batch (this rank's
    slice): model.clip_grad_norm_ when wrapped (``keep``), torch's on the plain model (None)."""
    world, rank = ws_rank() if keep else (1, 0)
    torch.manual_seed(0)
    model = wrap(keep, stage) if keep else Normed().double()
    x, y = global_batch(0)
    n = GLOBAL_BATCH // world
    ((model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
    if keep:
        return float(model.clip_grad_norm_(1e-3, norm_type))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_model_clip_counts_a_replicated_gradient_once(pools, stage, norm_type):
    want = clip_norm(None, stage, norm_type)
    for got in pools(3).run(clip_norm, "small", stage, norm_type):
        assert got == pytest.approx(want, rel=1e-6)  # model.clip_grad_norm_ returns float32


# ------------------------------------------------------------------- FSDP2 + replicate
def fsdp2_replicate(mixed):
    """FSDP2: fully_shard on the units, torch's replicate on the LayerNorm."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    net = Normed().double()
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    # one mesh for both: torch's clip_grad_norm_ stacks the norms, which must share a mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    replicate(net.norm, mesh=mesh, mp_policy=mp)
    for m in net.modules():
        if isinstance(m, (Block, Gate)):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    return net


def both_trained(stage, mixed):
    world, rank = ws_rank()
    mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32) if mixed else None
    engine = wrap("layernorm", stage, mixed_precision=mp)  # kept alive: it runs the hooks
    out = []
    for model in (engine.module, fsdp2_replicate(mixed)):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        train(model, opt, range(2), world, rank)
        out.append(({n: p.full_tensor() for n, p in model.named_parameters()},
                    {n: p.grad.to_local().clone() for n, p in model.named_parameters()
                     if n.startswith("norm.")}))
    return out


@pytest.mark.parametrize("world, stage, mixed", [(2, 1, False), (3, 3, False), (4, 2, False),
                                                 (2, 3, True)])
def test_replicate_equals_fsdp2_composed_with_torch_replicate(pools, world, stage, mixed):
    tol = dict(rtol=1e-6, atol=1e-7) if mixed else TIGHT
    for (ours, our_grads), (fsdp2, fsdp2_grads) in pools(world).run(both_trained, stage, mixed):
        assert_same_state(ours, fsdp2, **tol)
        assert_same_state(our_grads, fsdp2_grads, **tol)


# -------------------------------------------------------------------------- checkpoints
def oracle_and_save(keep, stage, opt_name, ckpt, fmt):
    world, rank = ws_rank()
    model = wrap(keep, stage)
    opt = OPTIMIZERS[opt_name](model.parameters())
    train(model, opt, range(4), world, rank)
    oracle = model.full_state_dict()
    model = wrap(keep, stage)
    opt = OPTIMIZERS[opt_name](model.parameters())
    train(model, opt, range(2), world, rank)
    save_checkpoint(ckpt, model, opt, format=fmt)
    return oracle


def load_and_finish(keep, stage, opt_name, ckpt):
    world, rank = ws_rank()
    model = wrap(keep, stage, seed=99)  # other initial values: the load must replace them
    opt = OPTIMIZERS[opt_name](model.parameters())
    load_checkpoint(ckpt, model, opt)
    train(model, opt, range(2, 4), world, rank)
    return model.full_state_dict()


@settings(max_examples=8)
@given(a=st.integers(1, 4), b=st.integers(1, 4), stage_a=st.integers(1, 3),
       stage_b=st.integers(0, 3), keep_a=st.sampled_from(["layernorm", "small", "predicate",
                                                           "everything"]),
       keep_b=st.sampled_from(sorted(KEEP)), opt_name=st.sampled_from(sorted(OPTIMIZERS)),
       fmt=st.sampled_from(["minishard", "dcp"]))
@example(a=3, b=2, stage_a=3, stage_b=3, keep_a="small", keep_b="sharded", opt_name="adam",
         fmt="minishard")
@example(a=2, b=4, stage_a=2, stage_b=3, keep_a="layernorm", keep_b="predicate",
         opt_name="sgd", fmt="dcp")
@example(a=4, b=1, stage_a=3, stage_b=1, keep_a="predicate", keep_b="small", opt_name="adam",
         fmt="dcp")
def test_resume_with_replicated_parameters_equals_uninterrupted_run(
        pools, tmp_path, a, b, stage_a, stage_b, keep_a, keep_b, opt_name, fmt):
    ckpt = fresh(tmp_path)
    oracle = pools(a).run(oracle_and_save, keep_a, stage_a, opt_name, ckpt, fmt)[0]
    for resumed in pools(b).run(load_and_finish, keep_b, stage_b, opt_name, ckpt):
        assert_same_state(resumed, oracle, **TIGHT)


def by_index(osd_by_name):
    """DCP's optimizer layout (keyed by name) keyed by index in ``Normed().parameters()``."""
    index = {name: i for i, (name, _) in enumerate(Normed().named_parameters())}
    return {"state": {index[n]: s for n, s in osd_by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in osd_by_name["param_groups"]]}


def fsdp2_full_state(net, opt):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(net, opt, options=full)  # rank 0's only (cpu_offload)
    return copy.deepcopy((get_model_state_dict(net, options=full), osd and by_index(osd)))


def dcp_side(who, ckpt, save):
    """Train two steps and save (``save``), or load, through DCP: minishard with the LayerNorm
    replicated, or FSDP2 + torch's replicate. Returns the full model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    world, rank = ws_rank()
    seed = 0 if save else 99
    if who == "minishard":
        model = wrap("layernorm", 3, seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if save:
            train(model, opt, range(2), world, rank)
            save_checkpoint(ckpt, model, opt, format="dcp")
        else:
            load_checkpoint(ckpt, model, opt)
        return model.full_state_dict(), full_optimizer_state_dict(model, opt)
    torch.manual_seed(seed)
    net = fsdp2_replicate(False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    if save:
        train(net, opt, range(2), world, rank)
    model_sd, optim_sd = get_state_dict(net, opt)
    content = {"model": model_sd, "optim": optim_sd}
    if save:
        dcp.save(content, checkpoint_id=ckpt)
    else:
        dcp.load(content, checkpoint_id=ckpt)
        set_state_dict(net, opt, model_state_dict=content["model"],
                       optim_state_dict=content["optim"])
    return fsdp2_full_state(net, opt)


@pytest.mark.parametrize("saver, loader", [("minishard", "fsdp2"), ("fsdp2", "minishard")])
def test_dcp_with_replicated_parameters_both_ways_with_fsdp2(pools, tmp_path, saver, loader):
    ckpt = fresh(tmp_path)
    saved_sd, saved_osd = pools(3).run(dcp_side, saver, ckpt, True)[0]
    loaded_sd, loaded_osd = pools(2).run(dcp_side, loader, ckpt, False)[0]  # rank 0: full
    assert_same_state(loaded_sd, saved_sd, rtol=0, atol=0)
    assert_same_optimizer_state(loaded_osd, saved_osd)


# ------------------------------------------------------------------------------- memory
def held(stage):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)).double()
    model = ZeRO(net, stage=stage, replicate=nn.LayerNorm)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    report = model.memory_report(opt)
    return {k: report[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bytes_counts_replicated_parameters_whole(pools, stage):
    # 2 Linear(8, 8): 144 parameters, sharded; the LayerNorm's 16, whole. fp64: twice fp32's.
    want = {k: 2 * v for k, v in zero_bytes(160, 2, stage, "adam", replicated=16).items()}
    for got in pools(2).run(held, stage):
        assert got == want
