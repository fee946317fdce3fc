"""Tutorial 13: nanoGPT's model and training step, ported to ZeRO stage 3, line by line.

    torchrun --standalone --nproc_per_node=2 tutorials/13_port_nanogpt.py     (1 to 4 ranks)

nanoGPT (github.com/karpathy/nanoGPT, MIT licence) trains with DDP. Its model.py is written out
below in its own shape (smaller, the same modules, the same initialisation, the same
``configure_optimizers``), and its train.py's loop as ``train()``, shortened: left out are the
GradScaler and autocast (a float64 run on the CPU has neither: ``scaler.scale(loss)`` is
``loss``), timing and MFU, wandb, the config system (the model is built from
module constants), devices, and the checkpoint's ``model_args`` and ``config``; names are
shortened (``GRAD_ACCUM`` for ``gradient_accumulation_steps``, ``say`` for rank 0's ``print``).
Every line that is kept but differs from train.py is marked: ``# PORT:`` where DDP becomes
minishard (the port), ``# LESSON:`` where this lesson checks itself (each says why). The port,
and why:

    nanoGPT (DDP)                                       minishard stage 3
    model = DDP(model, device_ids=[ddp_local_rank])     model = minishard.ZeRO(model, stage=3,
                                                        units={Block})  (each Block gathers and
                                                        frees on its own; the tied wte/lm_head
                                                        weight lives in the root unit)
    if iter_num % eval_interval == 0 and                the same without ``and master_process``:
      master_process:  (evaluate, then save)            at stage 3 every rank must run each
                                                        forward (its gathers); rank 0 alone
                                                        would wait for the others
    'model': raw_model.state_dict(),                    'model': model.full_state_dict(
                                                        rank0_only=True), the full tensors
    'optimizer': optimizer.state_dict(),                'optimizer': minishard.
                                                        full_optimizer_state_dict(model,
                                                        optimizer): torch's own format, the
                                                        plain optimizer's numbering
    torch.save(checkpoint, path)                        if master_process: torch.save(...), the
                                                        gathers above having run on every rank

train.py compiles by default (``compile = True``: ``model = torch.compile(model)``, then the
wrap); part 4 runs that, the same port. What is compiled is the model's math; the engine's hooks
(the gather before each Block, the free after it, the stamps, the flight record) are marked
``torch.compiler.disable`` (engine.py's ``_weak_hook``), so dynamo breaks the graph at each and
they run eagerly between the compiled pieces, as FSDP2's hooks do. torchtitan's order (wrap,
then ``block.compile()`` for each Block) and ``torch.compile`` of the wrapped model train the
same (tests/test_compile.py).

Two habits of a DDP script that break at stage 3, and what you will see. Keep ``and
master_process`` on the evaluation, and rank 0's gathers are answered by the others' training
gathers: the stamps raise ``CollectiveMismatch`` on every rank before rank 0 prints a loss. Decide
to save from each rank's OWN validation loss (``estimate_loss`` averages this rank's batches
only) with ``always_save_checkpoint = False``, and the ranks may disagree: ``full_state_dict`` is
collective, so the ranks that skip it time out (``MINISHARD_TIMEOUT``). Decide from something
every rank shares (here ``ALWAYS_SAVE_CHECKPOINT``; or rank 0's loss, broadcast). Either way,
``python -m minishard.doctor $MINISHARD_FLIGHT_DIR`` reads the ranks' flight records (lesson 15).

The checkpoint is nanoGPT's own file, full tensors under nanoGPT's names, so the resume is
nanoGPT's, unchanged: ``model.load_state_dict(checkpoint['model'])`` into the plain model and
``optimizer.load_state_dict(checkpoint['optimizer'])`` BEFORE wrapping. The optimizer too is
built before wrapping, as nanoGPT does: before ``ZeRO(...)`` returns, minishard points it at the
DTensors that replaced the parameters, each state tensor keeping this rank's rows (under FSDP2 such an
optimizer would silently train nothing: there it must move after ``fully_shard``). Each rank
seeds itself (``1337 + rank``, as train.py): ZeRO starts every rank from rank 0's weights, as
DDP does.

Unchanged, and why that is right: ``model.require_backward_grad_sync = (micro_step ==
gradient_accumulation_steps - 1)`` (ZeRO honours DDP's flag: False accumulates as ``no_sync()``);
``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)`` (DTensor gradients: the global
norm, one factor on every rank); ``configure_optimizers``'s ``p.dim() >= 2`` (a DTensor's dim is
the parameter's); ``estimate_loss()`` under ``torch.no_grad()`` at stage 3 (forward-only gathers);
the logged loss, rank 0's last micro-batch's, as nanoGPT logs it. On CPU, where nanoGPT does not
pass ``fused=True`` (it does on CUDA), give AdamW ``foreach=True``: each op on a DTensor pays a
Python dispatch (tutorials/zero_reference.md, "torch's tools see the shards").

This lesson's loop is not train.py itself: ``bench/nanogpt_port.py`` ports nanoGPT's own train.py
to minishard and to FSDP2, each as tightly as it allows, right in one process as under torchrun
and with every config nanoGPT ships, and runs both beside DDP at 1-4 ranks (losses equal to
DDP's at every iteration, the clip active, and after a resume). Counted as a unified diff counts
(every + and every - line; PEP 8's layout):

    lines of the diff from train.py under DDP     minishard (stage 1, 2 or 3)   FSDP2
    imports                                       1 (minishard)                 2
    the wrap                                      2 (DDP's line, ZeRO's)        6 (moved before the
                                                                                optimizer: each
                                                                                Block, the root)
    every rank starts from rank 0's weights       0 (ZeRO broadcasts, as DDP)   2
    the optimizer's state loaded                  0 (nanoGPT's order works)     2 (set_optimizer_
                                                                                state_dict)
    raw_model = model.module                      0                             2
    every rank evaluates, rank 0's loss decides   7                             7
    wandb on rank 0                               2                             2
    the checkpoint's model and optimizer          4                             4
    torch.save on rank 0                          3                             3
    total                                         19                            30

The evaluation's seven: two lines replaced by ``if iter_num % eval_interval == 0:``, ``with
torch.random.fork_rng(enabled=not master_process):`` around ``estimate_loss()`` (the other
ranks keep their RNG for their training batches, as under DDP), and ``if ddp:
torch.distributed.broadcast(losses['val'], 0)`` (the save decided from rank 0's loss, as DDP
decides it). This lesson needs neither: its batches are not drawn from the RNG, and it always
saves.

This lesson's own changes (``# LESSON:``) serve one check: a batch is a function of (iteration,
micro-batch number over ALL ranks), not of a per-rank seed, so that the run can be compared with
ONE process doing every micro-batch of an iteration: the port must give the same weights
(float64, so only the order of sums differs: about 1e-13). Then a resume: save at iteration 3,
load into a fresh model, finish: bit for bit the uninterrupted run.
"""
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minishard

# ------------------------------------------------------------------- nanoGPT's model.py, small
N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, VOCAB = 2, 2, 32, 16, 64


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's: torch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(N_EMBD, bias=True), CausalSelfAttention()
        self.ln_2, self.mlp = LayerNorm(N_EMBD, bias=True), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(BLOCK_SIZE, N_EMBD),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]), ln_f=LayerNorm(N_EMBD, bias=True)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]     # matmuls and embeddings
        nodecay = [p for p in params.values() if p.dim() < 2]   # biases and layernorms
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)  # fused=True on CUDA


# ------------------------------------------------------------------- nanoGPT's train.py, short
BATCH_SIZE, GRAD_ACCUM, MAX_ITERS, EVAL_INTERVAL, EVAL_ITERS, GRAD_CLIP = 2, 12, 5, 3, 2, 0.25
LEARNING_RATE, WEIGHT_DECAY, BETAS, ALWAYS_SAVE_CHECKPOINT = 1e-2, 0.1, (0.9, 0.95), True
WARMUP_ITERS, LR_DECAY_ITERS, MIN_LR = 2, 5, 1e-3
DATA = torch.Generator().manual_seed(7)
TOKENS = {split: torch.randint(VOCAB, (4000,), generator=DATA) for split in ("train", "val")}


def get_batch(split, it, sample):  # LESSON: batch number ``sample`` of iteration ``it``
    g = torch.Generator().manual_seed(1000 * it + sample + (500_000 if split == "val" else 0))
    ix = torch.randint(len(TOKENS[split]) - BLOCK_SIZE, (BATCH_SIZE,), generator=g)
    x = torch.stack([TOKENS[split][i:i + BLOCK_SIZE] for i in ix])
    y = torch.stack([TOKENS[split][i + 1:i + 1 + BLOCK_SIZE] for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss(model, it, rank, world):  # LESSON: which batches (this rank's share)
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            X, Y = get_batch(split, it, k * world + rank)  # LESSON: (get_batch(split))
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):  # nanoGPT's warmup and cosine decay
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > LR_DECAY_ITERS:
        return MIN_LR
    decay_ratio = (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (LEARNING_RATE - MIN_LR)


def train(rank, world, ddp, out_dir, resume=False, say=print, compile=False):
    """nanoGPT's loop. ``ddp``: run the ported version (else one process, every micro-batch);
    ``compile``: train.py's default, the model compiled before the wrap."""
    torch.manual_seed(1337 + rank)  # each rank its own seed, as train.py
    master_process = rank == 0
    ckpt_path = os.path.join(out_dir, "ckpt.pt") if out_dir else None  # LESSON: the oracle's
    # is None (train.py joins out_dir and 'ckpt.pt' where it loads and where it saves)
    model = GPT()
    iter_num, best_val_loss = 0, 1e9
    if resume:  # nanoGPT's resume, unchanged: every rank reads the full checkpoint
        checkpoint = torch.load(ckpt_path)
        model.load_state_dict(checkpoint["model"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    grad_accum = GRAD_ACCUM // world if ddp else GRAD_ACCUM  # as nanoGPT: tokens/iter fixed
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS)
    if resume:
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
    if compile:
        model = torch.compile(model)
    if ddp:
        model = minishard.ZeRO(model, stage=3, units={Block})  # PORT: was DDP(model, ...)
    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if iter_num % EVAL_INTERVAL == 0:  # PORT: nanoGPT adds "and master_process": at
            # stage 3 every rank must run the forwards (their gathers)
            losses = estimate_loss(model, iter_num, rank, world)  # LESSON: (estimate_loss())
            say(f"  step {iter_num}: train loss {losses['train']:.4f}, val {losses['val']:.4f}")
            if losses["val"] < best_val_loss or ALWAYS_SAVE_CHECKPOINT:
                best_val_loss = losses["val"]
                if iter_num > 0 and ddp:  # LESSON: "and ddp": the one-process oracle saves not
                    checkpoint = {
                        "model": model.full_state_dict(rank0_only=True),  # PORT: raw_model's
                        "optimizer": minishard.full_optimizer_state_dict(model, optimizer),  # PORT
                        "iter_num": iter_num, "best_val_loss": best_val_loss}
                    if master_process:  # PORT: the gathers above ran on every rank
                        torch.save(checkpoint, ckpt_path)
        for micro_step in range(grad_accum):
            if ddp:
                model.require_backward_grad_sync = (micro_step == grad_accum - 1)
            X, Y = get_batch("train", iter_num, rank * grad_accum + micro_step)  # LESSON: the
            # batch for this micro-step, drawn here (nanoGPT prefetches the next after forward)
            logits, loss = model(X, Y)
            loss = loss / grad_accum
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)  # LESSON: "norm ="
        assert norm > GRAD_CLIP, norm  # LESSON: the clip is active on every step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * grad_accum
        say(f"  iter {iter_num}: loss {lossf:.4f}")
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    return model


def weights(model) -> dict:
    """Full tensors under nanoGPT's own names, on every rank (a plain model: its state dict;
    a compiled one's names begin ``_orig_mod.``, which nanoGPT's resume strips too)."""
    if isinstance(model, minishard.ZeRO):
        return {k.removeprefix("_orig_mod."): v for k, v in model.full_state_dict().items()}
    return {k: v.clone() for k, v in model.state_dict().items()}


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.set_default_dtype(torch.float64)  # so the comparison sees only the order of sums
    out_dir = tempfile.mkdtemp() if rank == 0 else None
    box = [out_dir]
    dist.broadcast_object_list(box, src=0)
    out_dir = box[0]
    try:
        say(f"1. nanoGPT's loop at stage 3, {world} rank(s), {GRAD_ACCUM // world} micro-batches "
            "each per iteration:")
        ported = weights(train(rank, world, ddp=True, out_dir=out_dir, say=say))
        say("2. one process, all 12 micro-batches of each iteration (the oracle; as nanoGPT, "
            "each log line is its last micro-batch's loss, another sample than rank 0's):")
        single = weights(train(0, 1, ddp=False, out_dir=None, say=say))
        gap = max((ported[k] - single[k]).abs().max().item() for k in single)
        say(f"   largest weight difference, port vs one process: {gap:.1e}")
        assert ported.keys() == single.keys() and gap < 1e-10, gap
        say("3. resume: a fresh model loads the iteration-3 checkpoint and finishes")
        resumed = weights(train(rank, world, ddp=True, out_dir=out_dir, resume=True, say=say))
        assert all(torch.equal(resumed[k], ported[k]) for k in ported)
        say("   resumed == uninterrupted, bit for bit (nanoGPT's own checkpoint file: full "
            "weights and AdamW state, loaded before wrapping)")
        say("4. train.py's default, compile = True: torch.compile(model), then the wrap")
        compiled = weights(train(rank, world, ddp=True, out_dir=out_dir, say=say, compile=True))
        gap = max((compiled[k] - single[k]).abs().max().item() for k in single)
        say(f"   largest weight difference, compiled port vs one process: {gap:.1e}")
        assert compiled.keys() == single.keys() and gap < 1e-10, gap
        say("\nAll assertions held.")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


if __name__ == "__main__":
    with minishard.launch.session(world_sizes={1, 2, 3, 4}, why="12 micro-batches split evenly") \
            as (rank, world):
        main(rank, world)
