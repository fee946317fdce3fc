"""Tutorial 06: a complete stage-3 training loop, and a checkpoint that outlives its world size.

    torchrun --standalone --nproc_per_node=4 tutorials/06_training_loop.py    (saves at 2, resumes at 4)
    torchrun --standalone --nproc_per_node=3 tutorials/06_training_loop.py    (saves at 1, resumes at 3)
    torchrun --standalone --nproc_per_node=2 tutorials/06_training_loop.py    (saves at 1, resumes at 2)

Everything a real loop needs, each piece with the reason it is there:

  * bf16 mixed precision: compute and all-gathers in bf16 (half the bytes), fp32 master shards
    in the optimizer, gradients reduced in fp32 here (reduce_dtype) for accuracy;
  * gradient accumulation, and the choice it hides. Under ``no_sync()`` a micro-batch's backward
    skips the reduce-scatter and keeps the unit's FULL gradient; the last micro-batch's backward
    reduce-scatters the sum. At stage 3 that is not "no communication": every micro-batch still
    all-gathers every unit's parameters, in forward and again in backward (the shards are all a
    rank has). It saves the reduce-scatters of M-1 micro-batches and pays with the full gradients
    of the WHOLE model held until the last one, the very memory stage 3 exists to save. Part 1
    measures both ways (ledger bytes, memory_report peaks), asserts them, and gives the rule;
  * clipping by the GLOBAL gradient norm, over every rank's shard: model.clip_grad_norm_ (one
    all-reduce); torch.nn.utils.clip_grad_norm_(model.parameters()) gives the same, its
    DTensor gradients running that all-reduce themselves;
  * a checkpoint: one file per rank plus meta.pt written last (atomic), reloadable at another
    world size. The first half of the ranks train, save, and carry on to make a reference; then
    ALL ranks load the checkpoint (resharded to the new world size) and must reach the same
    parameters;
  * the same checkpoint for the tools you go on to: ``format="dcp"`` writes a
    torch.distributed.checkpoint directory laid out as FSDP2's state-dict API gives it, each parameter
    under its own name, each rank only its rows. Part 3 saves the resumed model that way and
    loads it into FSDP2 with torch's own calls (``get_state_dict``, ``dcp.load``,
    ``set_state_dict``): FSDP2's parameters must equal minishard's bit for bit.
    ``minishard.load_checkpoint`` reads such a directory too, whoever wrote it.
"""
import contextlib
import math
import os
import shutil
import tempfile
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

import minishard
from minishard.observe.memory import fmt_bytes

# 24 samples: an equal share for 1, 2, 3 or 4 ranks, and two equal micro-batches of it.
GLOBAL_BATCH, MICRO_BATCHES, STEPS, SAVE_AFTER = 24, 2, 4, 2


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(group, blocks: int = 3):
    torch.manual_seed(0)
    module = nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(32, 1))
    model = minishard.ZeRO(module, stage=3, units={Block}, process_group=group, prefetch=True,
                           mixed_precision=minishard.MixedPrecision(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def batch(step: int):
    """The same global batch for a step, whatever the world size: (inputs, targets)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model, opt, step: int, rank: int, world: int) -> float:
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    micro = per // MICRO_BATCHES
    total = 0.0
    for i in range(MICRO_BATCHES):
        xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
        # all but the last micro-batch: no reduce-scatter, accumulate the full gradients
        # locally (the choice is measured in accumulation_costs above)
        accumulate = model.no_sync() if i < MICRO_BATCHES - 1 else contextlib.nullcontext()
        with accumulate:
            loss = (model(xs).float() - ys).square().mean() / MICRO_BATCHES
            loss.backward()
        total += loss.item()
    norm = model.clip_grad_norm_(1.0)  # the global norm, before clipping
    opt.step()
    opt.zero_grad()
    mean_loss = torch.tensor([total])
    minishard.comm.all_reduce(mean_loss, "avg", model.group)
    return mean_loss.item(), norm.item()


def accumulation_costs(rank: int, world: int, say) -> None:
    """One step of M micro-batches at stage 3, twice: reduce-scattering every micro-batch, and
    under no_sync for all but the last. Bytes from the ledger, memory from memory_report."""
    M, micro, blocks = 4, 2, 8  # micro-batches per step, samples per micro-batch and rank
    x, y = batch(0)  # this rank's M x 2 samples, whatever the world size
    x, y = x.roll(-rank * micro, 0)[:M * micro], y.roll(-rank * micro, 0)[:M * micro]
    costs, grads = {}, {}
    for way in ("reduce every micro-batch", "no_sync until the last"):
        model, _ = build(None, blocks)
        ledgers, peak_full_grads, peak_gathered = [], 0, 0
        for i in range(M):
            skip = way.startswith("no_sync") and i < M - 1
            with (model.no_sync() if skip else contextlib.nullcontext()), \
                    minishard.ledger() as led:
                xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
                ((model(xs).float() - ys).square().mean() / M).backward()
            report = model.memory_report()  # peaks of THIS micro-batch's forward and backward
            peak_full_grads = max(peak_full_grads, report["peak_full_grads"])
            peak_gathered = max(peak_gathered, report["peak_gathered_params"])
            ledgers.append(led)
        costs[way] = {"gather": [led.total_bytes("all_gather") for led in ledgers],
                      "reduce": [led.total_bytes("reduce_scatter") for led in ledgers],
                      "full grads": peak_full_grads, "gathered": peak_gathered}
        grads[way] = [p.grad.to_local().clone() for p in model.parameters()]  # this rank's rows

    # The oracle for the bytes, from the unwrapped model's shapes alone. Each parameter is cut
    # along dim 0 into N chunks of ceil(R/N) rows, so its rows are padded to a multiple of N
    # (P elements in all); per micro-batch, stage 3 all-gathers every unit twice (forward,
    # backward) in bf16 and reduce-scatters it once in fp32 (reduce_dtype), (N-1)/N of each.
    padded = lambda s: math.ceil(s[0] / world) * world * math.prod(s[1:])  # noqa: E731
    block = sum(padded(p.shape) for p in Block().parameters())
    head = sum(padded(p.shape) for p in nn.Linear(32, 1).parameters())  # a (1, 32) weight: N rows
    P = blocks * block + head                                              # the blocks + the head
    real = blocks * sum(p.numel() for p in Block().parameters()) + 33
    gather = Fraction(2 * 2 * P * (world - 1), world)
    reduce = Fraction(4 * P * (world - 1), world)
    every, nosync = costs["reduce every micro-batch"], costs["no_sync until the last"]
    assert every["gather"] == nosync["gather"] == [gather] * M, costs  # no_sync gathers the same
    assert every["reduce"] == [reduce] * M, costs
    assert nosync["reduce"] == [0] * (M - 1) + [reduce], costs          # one reduce-scatter
    # Memory: the same parameters gathered at a time; but under no_sync every unit's full bf16
    # gradient stays alive until the last backward reduces it: 2 bytes x P, the whole model.
    assert every["gathered"] == nosync["gathered"], costs
    assert nosync["full grads"] == 2 * P, costs
    # Reducing as it goes, a rank holds at most three units' full gradients at once: two
    # reduce-scatters in flight and the unit whose backward is finishing.
    assert every["full grads"] <= 3 * 2 * block, costs
    # Both give the same gradient up to bf16 rounding: under no_sync the full gradients are
    # accumulated in the compute dtype (bf16), reduced every micro-batch they are summed in fp32.
    # (Each rank compares its own rows; the head's one-row weight leaves some ranks none.)
    drift = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*grads.values())
                if b.numel())
    assert drift < 2e-2, drift

    say(f"1. Gradient accumulation at stage 3: one step of {M} micro-batches, {world} rank(s), "
        f"{blocks} blocks + a head,\n   P = {P:,} elements moved per pass: {real:,} parameters "
        f"and {P - real:,} of padding (each parameter's rows\n   padded to a multiple of N: the "
        f"head's single-row weight to {world} rows), bf16 compute.")
    say(f"   {'':<26}{'all-gathered':>14}{'reduce-scattered':>18}{'peak full grads':>17}"
        f"{'peak gathered params':>22}")
    for way, c in costs.items():
        say(f"   {way:<26}{fmt_bytes(float(sum(c['gather']))):>14}"
            f"{fmt_bytes(float(sum(c['reduce']))):>18}{fmt_bytes(c['full grads']):>17}"
            f"{fmt_bytes(c['gathered']):>22}")
    saved = (M - 1) * reduce
    say(f"   (asserted) no_sync still all-gathers {fmt_bytes(float(gather))} per micro-batch, "
        f"saves {M - 1} reduce-scatters\n   ({fmt_bytes(float(saved))} per step), and holds "
        f"the whole model's full gradients ({fmt_bytes(2 * P)})\n   instead of three units' at "
        f"most. Same gradients up to bf16 rounding (no_sync accumulates\n   in bf16): max "
        f"relative difference {drift:.1e}, asserted < 2e-2.")
    say("   Rule: at stage 3 accumulate WITHOUT no_sync (reduce-scatter every micro-batch) unless "
        "the\n   full gradients of the whole model fit beside everything else AND the network, "
        "not memory,\n   is what limits you; then no_sync saves (M-1)/M of the reduce-scatter "
        "traffic. (FSDP2's\n   set_requires_gradient_sync(False) is the same trade.) At stages "
        "0-1 full gradients live\n   anyway: there no_sync is free memory-wise. This small model "
        "fits, so the loop below uses it.\n")


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    accumulation_costs(rank, world, say)
    say("2. Training, a checkpoint at half the ranks, and resuming at all of them.")
    half = max(1, world // 2)
    first_half = dist.new_group(list(range(half)))  # every rank must take part in new_group
    root = os.path.join(tempfile.gettempdir(),
                        f"minishard-06-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    path = minishard.checkpoint.state.checkpoint_path(root, SAVE_AFTER)

    # ---- phase 1: the first half of the ranks train, checkpoint, and carry on (the reference)
    reference = None
    if rank < half:
        model, opt = build(first_half)
        for step in range(1, STEPS + 1):
            loss, norm = train_step(model, opt, step, rank, half)
            say(f"[{half} rank(s)] step {step}  loss {loss:.4f}  grad norm {norm:.3f}")
            if step == SAVE_AFTER:
                minishard.save_checkpoint(path, model, opt, overwrite=True)
                say(f"[{half} rank(s)] saved {path}: {sorted(os.listdir(path))}")
        reference = model.full_state_dict()
        assert next(model.parameters()).dtype == torch.float32  # master shards stay fp32
    dist.barrier()

    # ---- phase 2: every rank loads the checkpoint, resharded, and replays the last steps
    model, opt = build(None)
    assert minishard.latest_checkpoint(root) == path
    minishard.load_checkpoint(path, model, opt)
    say(f"[{world} ranks] loaded the checkpoint saved by {half}")
    trace = os.path.join(tempfile.gettempdir(), "minishard-06-trace.json")
    for step in range(SAVE_AFTER + 1, STEPS + 1):
        with model.trace(trace) if step == STEPS else contextlib.nullcontext():
            loss, norm = train_step(model, opt, step, rank, world)
        say(f"[{world} ranks] step {step}  loss {loss:.4f}  grad norm {norm:.3f}")
    resumed = model.full_state_dict()
    if rank == 0:
        # bf16 compute on another number of ranks sums in another order: equal to bf16 accuracy
        worst = max((resumed[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 2e-2, worst
        say(f"\nResumed at {world} ranks vs uninterrupted at {half}: max |param diff| "
            f"{worst:.1e} (bf16 compute). All assertions held.")
        say(f"The last step, every rank, as a Chrome trace (ui.perfetto.dev): {trace}\n"
            "  Look for: two forward/backward passes (micro-batches), 'reduce' spans only in the\n"
            "  second (the first ran under no_sync), bf16 gathers (args: dtype, bytes_sent), then\n"
            "  clip_grad_norm_'s all-reduce in 'collectives', AdamW.step, the loss all-reduce.")
    to_fsdp2(model, opt, os.path.join(root, "dcp"), say)
    dist.barrier()  # every rank has read the checkpoints: now it may go
    if rank == 0:
        shutil.rmtree(root)


def to_fsdp2(model, opt, path: str, say) -> None:
    """Part 3: minishard's model and optimizer, saved in DCP's format and loaded by FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    say("\n3. The same model as a DCP checkpoint, loaded by FSDP2.")
    minishard.save_checkpoint(path, model, opt, format="dcp", overwrite=True)
    say(f"   saved {path}: {sorted(os.listdir(path))}")
    torch.manual_seed(1)  # other initial values: the load must replace every one of them
    module = nn.Sequential(*[Block() for _ in range(3)], nn.Linear(32, 1))
    for block in module[:3]:
        fully_shard(block)
    fully_shard(module)
    fsdp_opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01)
    model_sd, optim_sd = get_state_dict(module, fsdp_opt)  # the keys and shards FSDP2 wants
    content = {"model": model_sd, "optim": optim_sd}
    dcp.load(content, checkpoint_id=path)  # each rank reads only the chunks its shards need
    set_state_dict(module, fsdp_opt, model_state_dict=content["model"],
                   optim_state_dict=content["optim"])
    ours, our_state = model.full_state_dict(), minishard.full_optimizer_state_dict(model, opt)
    for i, (name, p) in enumerate(module.named_parameters()):  # the export's order
        assert torch.equal(p.full_tensor(), ours[name]), name
        theirs, mine = fsdp_opt.state[p], our_state["state"][i]
        assert torch.equal(theirs["step"], mine["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(theirs[key].full_tensor(), mine[key]), (name, key)
    say(f"   FSDP2 loaded it: {len(ours)} parameters under their own names and their AdamW "
        "state\n   (step, exp_avg, exp_avg_sq), equal to minishard's bit for bit.")


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session() as (rank, world):
        main(rank, world)
