"""torch's own tools on a wrapped model's parameters (DTensors at stages 1-3, zero/params.py).

The oracles, unmodified:
  * One process on the global batch: torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on the
    plain model, then an SGD step. The wrapped model, at any stage and world size 1-4 (3 and 4:
    uneven rows and empty shards), with a tied weight, a frozen parameter and a 0-dim one, with
    or without prefetch, buckets or accumulation (``no_sync()`` or DDP's
    ``require_backward_grad_sync`` flag, nanoGPT's spelling), and on a 2x2 mesh, calls the SAME
    torch function on ``model.parameters()``: its return value is the true norm, and the
    parameters after the step are one process's.
  * FSDP2, through torch's state-dict API and DCP (test_dcp.py's helpers): what minishard
    saves with ``get_state_dict(model.module, opt)`` + ``dcp.save``, FSDP2 loads at another
    world size holding exactly minishard's full export; and the other way.
"""
import contextlib
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, example, given, settings, strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

from minishard import ZeRO, comm
from minishard.checkpoint.state import full_optimizer_state_dict

from test_dcp import (assert_same_optimizer_state, by_index, fsdp2_load_and_step,
                      fsdp2_train_and_save, one_more_step)
from test_state import Block, Gate, Net, assert_same_state, fresh, global_batch, ws_rank, GLOBAL_BATCH

TIGHT = dict(rtol=1e-9, atol=1e-12)


class Scaled(Net):
    """test_state's Net (tied weight, frozen parameter, a 3-element unit) and a 0-dim one."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return super().forward(x) * self.temperature


def weights(state_dict):
    """The parameters of a state dict (the blocks' call counters count micro-batches)."""
    return {k: v for k, v in state_dict.items() if not k.endswith("calls")}


def plain(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def step_with(model, clip, world=1, rank=0, no_sync=None):
    """One SGD step on the global batch (this rank's slice), gradients clipped by ``clip``;
    with ``no_sync`` (the wrapper's), in two micro-batches, the first accumulated locally."""
    x, y = global_batch(0)
    n = GLOBAL_BATCH // world
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    if no_sync is None:
        ((model(xs) - ys) ** 2).mean().backward()
    else:  # the slice's mean, as two sums over its halves
        h = n // 2
        with no_sync():
            (((model(xs[:h]) - ys[:h]) ** 2).sum() / ys.numel()).backward()
        (((model(xs[h:]) - ys[h:]) ** 2).sum() / ys.numel()).backward()
    out = clip(model.parameters())
    opt.step()
    return out


def clip_fn(kind, value, norm_type):
    if kind == "value":
        return lambda params: torch.nn.utils.clip_grad_value_(params, value)
    return lambda params: torch.nn.utils.clip_grad_norm_(params, value, norm_type)


def one_process(kind, value, norm_type):
    torch.manual_seed(0)
    net = Scaled().double()
    out = step_with(net, clip_fn(kind, value, norm_type))
    return (None if out is None else float(out)), weights(net.state_dict())


def by_flag(model):
    """DDP's other spelling of no_sync, the one nanoGPT's train.py uses: the flag, set per
    micro-batch."""
    @contextlib.contextmanager
    def no_sync():
        model.require_backward_grad_sync = False
        yield
        model.require_backward_grad_sync = True
    return no_sync


def wrapped(stage, kind, value, norm_type, hybrid=False, prefetch=False, bucket_bytes=0,
            no_sync="no"):
    world, rank = ws_rank()
    torch.manual_seed(0)
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, world // 2))
    model = ZeRO(Scaled().double(), stage=stage, units=(Block, Gate), mesh=mesh, prefetch=prefetch,
                 bucket_bytes=bucket_bytes if stage >= 2 else 0)
    with comm.ledger() as led:
        out = step_with(model, clip_fn(kind, value, norm_type), world, rank,
                        {"no": None, "context": model.no_sync, "flag": by_flag(model)}[no_sync])
    seen = [e.tag for e in led.entries if e.tag.startswith("torch ")]
    return (None if out is None else float(plain(out))), weights(model.full_state_dict()), seen


@settings(max_examples=12)
@given(world=st.integers(1, 4), stage=st.integers(0, 3), kind=st.sampled_from(["norm", "value"]),
       norm_type=st.sampled_from([1.0, 2.0, math.inf]), value=st.sampled_from([1e-3, 0.05, 1e3]),
       prefetch=st.booleans(), bucket_bytes=st.sampled_from([0, 4096]),
       no_sync=st.sampled_from(["no", "context", "flag"]))
@example(world=3, stage=3, kind="norm", norm_type=2.0, value=0.05, prefetch=False,
         bucket_bytes=4096, no_sync="context")
@example(world=3, stage=1, kind="norm", norm_type=math.inf, value=1e-3, prefetch=True,
         bucket_bytes=0, no_sync="no")
@example(world=2, stage=2, kind="value", norm_type=2.0, value=1e-3, prefetch=False,
         bucket_bytes=4096, no_sync="flag")
@example(world=3, stage=0, kind="norm", norm_type=2.0, value=0.05, prefetch=False,
         bucket_bytes=0, no_sync="flag")
def test_torch_clip_on_model_parameters_equals_one_process(pools, world, stage, kind, norm_type,
                                                           value, prefetch, bucket_bytes,
                                                           no_sync):
    # torch's inf-norm raises on a rank holding an empty shard (4 ranks: Gate's 3 rows), as
    # under FSDP2 (measured: the other ranks then wait in the all-reduce); model.clip_grad_norm_
    # handles it (the test below)
    assume(not (kind == "norm" and norm_type == math.inf and world == 4 and stage > 0))
    want_norm, want_sd = one_process(kind, value, norm_type)
    for norm, sd, seen in pools(world).run(wrapped, stage, kind, value, norm_type, False,
                                           prefetch, bucket_bytes, no_sync):
        if want_norm is not None:
            assert norm == pytest.approx(want_norm, rel=1e-9)
        assert_same_state(sd, want_sd, **TIGHT)
        if kind == "norm" and stage > 0 and world > 1:  # DTensor's all-reduce, in the ledger
            assert seen, "the norm's collective was not counted"


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_torch_clip_on_a_hybrid_mesh_equals_one_process(pools, norm_type):
    want_norm, want_sd = one_process("norm", 0.05, norm_type)
    for norm, sd, _ in pools(4).run(wrapped, 3, "norm", 0.05, norm_type, True):
        assert norm == pytest.approx(want_norm, rel=1e-9)
        assert_same_state(sd, want_sd, **TIGHT)


def both_norms(stage, norm_type):
    """model.clip_grad_norm_ (minishard's own sum) and torch's, on the same gradients."""
    world, rank = ws_rank()
    torch.manual_seed(0)
    model = ZeRO(Scaled().double(), stage=stage, units=(Block, Gate))
    x, y = global_batch(1)
    n = GLOBAL_BATCH // world
    ((model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
    ours = float(model.clip_grad_norm_(math.inf, norm_type))  # never clips
    return ours, float(plain(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf,
                                                            norm_type)))


def own_clip(stage, norm_type, max_norm):
    world, rank = ws_rank()
    torch.manual_seed(0)
    model = ZeRO(Scaled().double(), stage=stage, units=(Block, Gate))
    out = step_with(model, lambda _: model.clip_grad_norm_(max_norm, norm_type), world, rank)
    return float(out), weights(model.full_state_dict())


@pytest.mark.parametrize("stage", [1, 3])
def test_model_clip_grad_norm_inf_with_an_empty_shard_equals_one_process(pools, stage):
    want_norm, want_sd = one_process("norm", 1e-3, math.inf)
    for norm, sd in pools(4).run(own_clip, stage, math.inf, 1e-3):
        assert norm == pytest.approx(want_norm, rel=1e-7)  # it returns float32
        assert_same_state(sd, want_sd, **TIGHT)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_model_clip_grad_norm_agrees_with_torch(pools, stage, norm_type):
    for ours, torchs in pools(3).run(both_norms, stage, norm_type):
        assert ours == pytest.approx(torchs, rel=1e-7)  # model.clip_grad_norm_ returns float32


def parameters_are_dtensors(stage):
    world, _ = ws_rank()
    model = ZeRO(Scaled(), stage=stage, units=(Block, Gate))
    return [(name, type(p).__name__, tuple(p.shape), p.dim()) for name, p in
            model.module.named_parameters()], [tuple(p.shape) for p in Scaled().parameters()]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_parameters_keep_global_shapes_and_dims(pools, stage):
    for described, shapes in pools(3).run(parameters_are_dtensors, stage):
        assert [s for _, _, s, _ in described] == shapes
        assert all(d == len(s) for _, _, s, d in described)  # a 0-dim parameter stays 0-dim
        assert {t for _, t, _, _ in described} == ({"Parameter"} if stage == 0 else {"DTensor"})


def full_tensors_in_the_ledger(stage):
    """Each parameter's ``p.full_tensor()`` alone in a ledger: what the ledger recorded."""
    model = ZeRO(Scaled().double(), stage=stage, units=(Block, Gate))
    out = []
    for name, p in model.module.named_parameters():
        with comm.ledger() as led:
            p.full_tensor()
        out.append((tuple(p.shape), [(e.op, e.numel, e.bytes_sent) for e in led.entries
                                     if e.tag.startswith("torch ")]))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_full_tensor_is_in_the_ledger_at_its_full_size(pools, world):
    """A user's ``full_tensor()`` all-gathers every rank's rows, padded as DTensor pads them
    (each rank's chunk is ceil(R/N) rows): the ledger records N such chunks, and sends
    (N-1)/N of their bytes (float64 here) in the ring model. A 0-dim parameter is replicated:
    no collective."""
    for rank, rows in enumerate(pools(world).run(full_tensors_in_the_ledger, 2)):
        for shape, entries in rows:
            if not shape:
                assert entries == [], (rank, shape, entries)
                continue
            numel = world * -(-shape[0] // world) * math.prod(shape[1:])
            assert entries == [("all_gather", numel, Fraction((world - 1) * 8 * numel, world))], \
                (rank, shape, entries)


# ------------------------------------------------------------ torch's state-dict API and DCP
def minishard_torch_save(ckpt, stage):
    """Train 2 steps, save with torch's API and dcp.save (as torchtitan does, over FSDP2)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from test_dcp import minishard
    from test_state import train
    world, rank = ws_rank()
    model, opt = minishard(stage, seed=0)
    train(model, opt, range(2), world, rank)
    model_sd, optim_sd = get_state_dict(model.module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    return model.full_state_dict(), full_optimizer_state_dict(model, opt)


def minishard_torch_load(ckpt, stage):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from test_dcp import minishard
    from test_state import train
    world, rank = ws_rank()
    model, opt = minishard(stage, seed=99, lr=0.5)  # the checkpoint's lr must replace it
    model_sd, optim_sd = get_state_dict(model.module, opt)
    content = {"model": model_sd, "optim": optim_sd}
    dcp.load(content, checkpoint_id=ckpt)
    set_state_dict(model.module, opt, model_state_dict=content["model"],
                   optim_state_dict=content["optim"])
    loaded = model.full_state_dict(), full_optimizer_state_dict(model, opt)
    train(model, opt, [2], world, rank)
    return loaded, model.full_state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_state_dict_api_saves_what_fsdp2_loads_at_another_world_size(pools, tmp_path,
                                                                         stage):
    ckpt = fresh(tmp_path)
    model_sd, osd = pools(3).run(minishard_torch_save, ckpt, stage)[0]
    oracle = one_more_step(model_sd, osd)
    (loaded_sd, loaded_osd), after = pools(2).run(fsdp2_load_and_step, ckpt)[0]
    assert_same_state(loaded_sd, model_sd, rtol=0, atol=0)
    assert_same_optimizer_state(by_index(loaded_osd), osd)
    assert_same_state(after, oracle)


@pytest.mark.parametrize("world, stage", [(3, 3), (1, 1), (4, 2)])
def test_torch_state_dict_api_loads_what_fsdp2_saved(pools, tmp_path, world, stage):
    ckpt = fresh(tmp_path)
    model_sd, osd = pools(2).run(fsdp2_train_and_save, ckpt, 2, "fsdp2")[0]
    oracle = one_more_step(model_sd, by_index(osd))
    for (loaded_sd, loaded_osd), after in pools(world).run(minishard_torch_load, ckpt, stage):
        assert_same_state(loaded_sd, model_sd, rtol=0, atol=0)
        assert_same_optimizer_state(loaded_osd, by_index(osd))
        assert_same_state(after, oracle)


def rank0_saves_module_state_dict(path, stage):
    """The habit ``if rank == 0: torch.save(model.module.state_dict(), f)``: no collective in
    state_dict() (nothing hangs), and the file does not load into a plain model as whole."""
    _, rank = ws_rank()
    model = ZeRO(Net(), stage=stage, units=(Block, Gate))
    if rank == 0:
        torch.save(model.module.state_dict(), path)
    dist.barrier()
    try:
        Net().load_state_dict(torch.load(path, weights_only=False))
    except Exception as exc:  # noqa: BLE001: any error is the point; silence is the bug
        return type(exc).__name__
    return None


def test_rank0_saving_the_module_state_dict_never_hangs_nor_loads_wrong(pools, tmp_path):
    path = str(tmp_path / "sd.pt")
    assert all(err is not None for err in pools(2).run(rank0_saves_module_state_dict, path, 3))


def traced_clip(path):
    """torch's clip inside model.trace() and a ledger: its all-reduce in both, counted once."""
    import json
    model = ZeRO(Scaled().double(), stage=3, units=(Block, Gate))
    x, y = global_batch(0)
    with model.trace(path):
        ((model(x) - y) ** 2).mean().backward()
        with comm.ledger() as outer, comm.ledger() as inner:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    names = [e["name"] for e in json.load(open(path))["traceEvents"]] if ws_rank()[1] == 0 \
        else None
    return [e.tag for e in outer.entries], [e.tag for e in inner.entries], names


def test_dtensor_collectives_are_in_the_ledger_and_the_trace(pools, tmp_path):
    path = str(tmp_path / "trace.json")
    for r, (outer, inner, names) in enumerate(pools(2).run(traced_clip, path)):
        assert outer == inner == ["torch all_reduce"], (outer, inner)
        if r == 0:
            assert any("torch all_reduce" in n for n in names), names
