"""Tutorial 06: a complete stage-3 training loop, and a checkpoint that outlives its world size.

    torchrun --standalone --nproc_per_node=4 tutorials/06_training_loop.py    (saves at 2, resumes at 4)
    torchrun --standalone --nproc_per_node=2 tutorials/06_training_loop.py    (saves at 1, resumes at 2)

Everything a real loop needs, each piece with the reason it is there:

  * bf16 mixed precision: compute and all-gathers in bf16 (half the bytes), fp32 master shards
    in the optimizer, gradients reduced in fp32 here (reduce_dtype) for accuracy;
  * gradient accumulation: micro-batches under ``no_sync()`` keep full local gradients and
    communicate nothing; the last micro-batch's backward reduce-scatters the sum;
  * clipping by the GLOBAL gradient norm, over every rank's shard (model.clip_grad_norm_, not
    torch.nn.utils.clip_grad_norm_, which would only see this rank's shard);
  * a checkpoint: one file per rank plus meta.pt written last (atomic), reloadable at another
    world size. The first half of the ranks train, save, and carry on to make a reference; then
    ALL ranks load the checkpoint (resharded to the new world size) and must reach the same
    parameters.
"""
import contextlib
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import minishard

GLOBAL_BATCH, MICRO_BATCHES, STEPS, SAVE_AFTER = 16, 2, 4, 2


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(group):
    torch.manual_seed(0)
    module = nn.Sequential(*[Block() for _ in range(3)], nn.Linear(32, 1))
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
        # all but the last micro-batch: accumulate locally, communicate nothing
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


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % 2 == 0 or world == 1, "run with an even number of ranks"
    say = print if rank == 0 else (lambda *a, **k: None)
    half = max(1, world // 2)
    first_half = dist.new_group(list(range(half)))  # every rank must take part in new_group
    root = os.path.join(tempfile.gettempdir(),
                        f"minishard-06-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    path = minishard.state.checkpoint_path(root, SAVE_AFTER)

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
    for step in range(SAVE_AFTER + 1, STEPS + 1):
        loss, norm = train_step(model, opt, step, rank, world)
        say(f"[{world} ranks] step {step}  loss {loss:.4f}  grad norm {norm:.3f}")
    resumed = model.full_state_dict()
    if rank == 0:
        # bf16 compute on another number of ranks sums in another order: equal to bf16 accuracy
        worst = max((resumed[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 2e-2, worst
        say(f"\nResumed at {world} ranks vs uninterrupted at {half}: max |param diff| "
            f"{worst:.1e} (bf16 compute). All assertions held.")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
