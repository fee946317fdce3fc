"""After wrapping, the module's parameters keep the user's names and shapes (FSDP2's contract).

The oracle is always the unwrapped model (a deepcopy made before wrapping) trained in one process
on the global batch; the expected shard of a parameter is ``torch.chunk(full, N, dim=0)[rank]``
(empty when torch.chunk gives fewer chunks than ranks), FSDP2's cut, computed here by torch and
never by minishard; a 0-dim parameter is whole on every rank (FSDP2 refuses one; minishard
replicates it). Contract items, each checked at stages 0-3 and 1-4 ranks (3 and 4 pad; a
parameter with fewer rows than ranks leaves some ranks empty):

1. ``named_parameters()`` keeps the names, the order, the global shapes and ``p.dim()``; stage 0
   keeps the objects, stages 1-3 give DTensors whose local tensor is the rank's dim-0 chunk;
   after backward ``p.grad`` holds that chunk of the global-batch gradient.
2. an ordinary optimizer built by name or ``p.dim()`` (nanoGPT's ``configure_optimizers``,
   verbatim) trains as the unwrapped model, built after wrapping or before (nanoGPT's order;
   under FSDP2 that one would train nothing), for-loop and foreach; state loaded into it
   before wrapping (nanoGPT's resume) carries on as the unwrapped model's would.
3. ``requires_grad_(False)`` on one parameter freezes exactly it.
4. inside ``gathered()`` the module shows the full parameters; edits persist.
5. ``module.state_dict()`` holds this rank's chunks (DTensors at stages 1-3) with no collective
   (rank 0 alone calling it cannot hang); ``load_state_dict`` of a full state dict loads at
   every stage.
"""
from torch.distributed.tensor import DTensor
import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard

TOL = 1e-6


class Net(nn.Module):
    """Rows per parameter drawn small so that 3-4 ranks pad and some hold nothing; ``scale`` is
    a 0-dim parameter (one row: rank 0 holds it)."""

    def __init__(self, d_in: int, hidden: int, out: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.75))
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, out)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def chunk(full: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """FSDP2's shard of ``full`` on rank r of n: torch.chunk along dim 0 (0-dim: all of it)."""
    if full.dim() == 0:
        return full
    pieces = torch.chunk(full, n, dim=0)
    return pieces[r] if r < len(pieces) else full[:0]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a user parameter or gradient (a DTensor's local tensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def batch(n: int, d_in: int, step: int) -> torch.Tensor:
    return torch.randn(4 * n, d_in, generator=torch.Generator().manual_seed(100 + step))


def shards_differ(model, oracle, n, r) -> float:
    """Largest difference between each user parameter and its chunk of the oracle's."""
    want = dict(oracle.named_parameters())
    return max(((local(p) - chunk(want[k], n, r)).abs().max().item() if local(p).numel()
                else 0.0) for k, p in model.module.named_parameters())


def contract(stage: int, dims: tuple, frozen: str | None, seed: int) -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    sharded = stage > 0 and n > 1
    torch.manual_seed(seed)
    oracle = Net(*dims)
    module = copy.deepcopy(oracle)
    objects = [p for p in module.parameters()]
    model = minishard.ZeRO(module, stage=stage, units={nn.Linear})
    out: dict = {}
    # 1. names, order, shapes, dims; FSDP2's chunk on this rank (a DTensor's local tensor)
    out["names"] = [k for k, _ in model.named_parameters()] == \
        ["module." + k for k, _ in oracle.named_parameters()]
    same = [a is b for a, b in zip(model.module.parameters(), objects)]
    out["objects"] = all(same) if stage == 0 else not any(same)
    out["dtensors"] = all(isinstance(p, DTensor) == (stage > 0) for p in model.parameters())
    want = dict(oracle.named_parameters())
    out["shapes"] = all(p.shape == want[k].shape and local(p).shape ==
                        (chunk(want[k], n, r).shape if sharded else want[k].shape)
                        for k, p in model.module.named_parameters())
    out["dims"] = all(p.dim() == want[k].dim() for k, p in model.module.named_parameters())
    out["values"] = shards_differ(model, oracle, n if sharded else 1, r if sharded else 0)
    # 3. freeze one parameter after wrapping (and the oracle's)
    if frozen:
        model.module.get_parameter(frozen).requires_grad_(False)
        oracle.get_parameter(frozen).requires_grad_(False)
    # 2. an ordinary optimizer, built after wrapping, over the wrapper's parameters
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    ref = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    out["grads"] = 0.0
    for step in range(2):
        x = batch(n, dims[0], step)
        model(x[4 * r:4 * (r + 1)]).square().mean().backward()
        oracle(x).square().mean().backward()
        for k, p in model.module.named_parameters():
            g = want[k].grad
            if g is None or frozen == k:
                out.setdefault("frozen_grad_none", p.grad is None)
                continue
            mine = chunk(g, n, r) if sharded else g
            out["grads"] = max(out["grads"], (local(p.grad) - mine).abs().max().item()
                               if local(p).numel() else 0.0)
            out["grad_shape"] = out.get("grad_shape", True) and p.grad.shape == p.shape \
                and local(p.grad).shape == local(p).shape
        opt.step(), opt.zero_grad(), ref.step(), ref.zero_grad()
    out["trained"] = shards_differ(model, oracle, n if sharded else 1, r if sharded else 0)
    # 4. gathered(): the full parameters under their names; an edit persists
    with model.gathered():
        full = dict(model.module.named_parameters())
        out["gathered"] = max((full[k] - q).abs().max().item() for k, q in want.items())
        out["gathered_shapes"] = all(full[k].shape == q.shape for k, q in want.items())
        with torch.no_grad():
            model.module.a.weight.mul_(0.5)
    with torch.no_grad():
        oracle.a.weight.mul_(0.5)
    out["edited"] = shards_differ(model, oracle, n if sharded else 1, r if sharded else 0)
    # 5. state_dict: this rank's chunks, no collective; a full one loads everywhere
    if r == 0:
        model.module.state_dict()
    dist.barrier()  # the other ranks never entered a collective: reaching here proves no hang
    got, want_sd = model.module.state_dict(), oracle.state_dict()
    out["state_dict"] = got.keys() == want_sd.keys()  # 2 ranks vs 1: summation order only
    out["state_dict_values"] = max(
        ((local(got[k]) - chunk(v, n if sharded else 1, r if sharded else 0)).abs().max().item()
         if local(got[k]).numel() else 0.0) for k, v in want_sd.items())
    torch.manual_seed(seed + 1)
    fresh = Net(*dims).state_dict()
    model.module.load_state_dict(fresh)
    oracle.load_state_dict(fresh)
    x = batch(n, dims[0], 9)
    model(x[4 * r:4 * (r + 1)]).square().mean().backward()
    oracle(x).square().mean().backward()
    opt.step(), ref.step()
    out["loaded"] = shards_differ(model, oracle, n if sharded else 1, r if sharded else 0)
    return out


@given(stage=st.sampled_from([0, 1, 2, 3]), world=st.sampled_from([1, 2, 3, 4]),
       dims=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 3)),
       frozen=st.sampled_from([None, "a.bias", "b.weight", "scale"]),
       seed=st.integers(0, 2**16))
def test_the_parameters_stay_the_users(pools, stage, world, dims, frozen, seed):
    for r, out in enumerate(pools(world).run(contract, stage, dims, frozen, seed)):
        flags = {k: v for k, v in out.items() if isinstance(v, bool)}
        assert all(flags.values()), (r, [k for k, v in flags.items() if not v], out)
        assert out["state_dict"] is True, (r, out)
        numbers = {k: v for k, v in out.items() if not isinstance(v, bool)}
        assert max(numbers.values()) < TOL, (r, out)


# ------------------------------------------------------------- nanoGPT, verbatim in its habits
class GPT(nn.Module):
    """nanoGPT's shape in miniature: tied embedding and head, LayerNorms, a 0-dim-free MLP."""

    def __init__(self, vocab=11, d=6, n_layer=2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.h = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                             nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = x + block(x)
        return self.lm_head(self.ln_f(x))

    def configure_optimizers(self, weight_decay, learning_rate, betas, optimizer=None):
        """nanoGPT's, verbatim but for ``optimizer`` (AdamW there; SGD too, for exact checks)."""
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        if optimizer is not None:
            return optimizer(optim_groups, lr=learning_rate)
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def gpt_loss(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       idx[:, 1:].reshape(-1))


def nanogpt(stage: int, when: str, optimizer: str) -> dict:
    """Train 3 steps, the optimizer from ``configure_optimizers`` called ``when`` = "after"
    wrapping (on ``model.module``) or "before" (nanoGPT's own order), against one process."""
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    oracle = GPT()
    module = copy.deepcopy(oracle)
    kind = {"sgd": torch.optim.SGD, "adamw": None,
            "sgd foreach": functools.partial(torch.optim.SGD, foreach=True)}[optimizer]
    args = dict(weight_decay=0.1, learning_rate=0.05 if kind else 1e-3, betas=(0.9, 0.95),
                optimizer=kind)
    opt = module.configure_optimizers(**args) if when == "before" else None
    model = minishard.ZeRO(module, stage=stage, units={nn.Sequential})
    if when == "after":
        opt = model.module.configure_optimizers(**args)
    ref = oracle.configure_optimizers(**args)
    sizes = [len(g["params"]) for g in opt.param_groups]
    idx = torch.randint(0, 11, (2 * n, 6), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        gpt_loss(model, idx[2 * r:2 * (r + 1)]).backward()
        opt.step(), opt.zero_grad()
        gpt_loss(oracle, idx).backward()
        ref.step(), ref.zero_grad()
    got, want = model.full_state_dict(), oracle.state_dict()
    return {"groups": sizes == [len(g["params"]) for g in ref.param_groups],
            "error": max((got[k] - v).abs().max().item() for k, v in want.items())}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("when", ["after", "before"])
def test_nanogpt_configure_optimizers_decays_by_dim(pools, world, stage, when):
    for kind in ("sgd", "sgd foreach"):
        for out in pools(world).run(nanogpt, stage, when, kind):
            assert out["groups"] and out["error"] < TOL, (kind, out)
    # AdamW, nanoGPT's own: near-zero gradients make its update ~ +-lr under summation-order
    # noise (the guide's note), so allow lr per step; groups must still match exactly.
    for out in pools(world).run(nanogpt, stage, when, "adamw"):
        assert out["groups"] and out["error"] < 3 * 1e-3 + TOL, out


def nanogpt_resume(stage: int, foreach: bool) -> dict:
    """nanoGPT's resume: a fresh plain model and optimizer load a checkpoint of one process's
    run (``model.load_state_dict``, ``optimizer.load_state_dict``: full tensors), THEN the
    model is wrapped; two more steps must match that process's, and DDP's after the same
    resume (nanoGPT's own order under DDP). SGD with momentum: exact."""
    n, r = dist.get_world_size(), dist.get_rank()
    kind = functools.partial(torch.optim.SGD, momentum=0.9, foreach=foreach)
    args = dict(weight_decay=0.1, learning_rate=0.05, betas=(0.9, 0.95), optimizer=kind)
    idx = torch.randint(0, 11, (2 * n, 6), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    oracle = GPT()
    ref = oracle.configure_optimizers(**args)

    def oracle_step():
        gpt_loss(oracle, idx).backward()
        ref.step(), ref.zero_grad()

    oracle_step(), oracle_step()
    ckpt = copy.deepcopy({"model": oracle.state_dict(), "optimizer": ref.state_dict()})
    def resumed(wrap):
        torch.manual_seed(1)  # other initial values: the checkpoint must overwrite them
        module = GPT()
        module.load_state_dict(ckpt["model"])
        opt = module.configure_optimizers(**args)
        opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))  # torch's load keeps its tensors
        model = wrap(module)
        for _ in range(2):
            gpt_loss(model, idx[2 * r:2 * (r + 1)]).backward()
            opt.step(), opt.zero_grad()
        return model, opt

    model, opt = resumed(lambda m: minishard.ZeRO(m, stage=stage, units={nn.Sequential}))
    ddp, _ = resumed(DDP)
    oracle_step(), oracle_step()
    got, want = model.full_state_dict(), oracle.state_dict()
    saved = minishard.full_optimizer_state_dict(model, opt)  # what nanoGPT's save then writes
    return {"error": max((got[k] - v).abs().max().item() for k, v in want.items()),
            "ddp error": max((got[k] - v).abs().max().item()
                             for k, v in ddp.module.state_dict().items()),
            "state error": max((saved["state"][i]["momentum_buffer"] - s["momentum_buffer"])
                               .abs().max().item() for i, s in ref.state_dict()["state"].items()),
            "same keys": saved["state"].keys() == ref.state_dict()["state"].keys()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nanogpt_resume_loads_the_optimizer_before_wrapping(pools, world, stage):
    foreach = (world + stage) % 2 == 1  # each world and each stage meets both (suite time)
    for out in pools(world).run(nanogpt_resume, stage, foreach):
        assert out["same keys"] and out["state error"] < TOL, out
        assert out["error"] < TOL and out["ddp error"] < TOL, out


def grads_under_mixed_precision(stage: int) -> list:
    torch.manual_seed(0)
    model = minishard.ZeRO(Net(3, 5, 2), stage=stage, units={nn.Linear},
                           mixed_precision=minishard.MixedPrecision(param_dtype=torch.bfloat16))
    model(torch.randn(4, 3)).square().mean().backward()
    return [(p.dtype, p.grad.dtype, p.grad.shape == p.shape
             and local(p.grad).shape == local(p).shape) for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grads_are_the_shards_in_the_master_dtype(pools, stage):
    for rows in pools(3).run(grads_under_mixed_precision, stage):
        assert rows and all(row == (torch.float32, torch.float32, True) for row in rows), rows
