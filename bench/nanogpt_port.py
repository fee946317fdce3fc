"""nanoGPT's own train.py, ported to FSDP2 and to minishard stages 1-3, each run beside DDP.

    python bench/nanogpt_port.py PATH/TO/nanoGPT [--world 2] [--fused] [--compile] [--systems ...]

Needs a checkout of github.com/karpathy/nanoGPT (its train.py, model.py and configurator.py;
not copied into this repository). Writes each port into a temporary directory and prints its
diff from train.py under DDP on CPU (the baseline: train.py with the two lines of its ``ddp``
branch that name a CUDA device made CPU, which every CPU run needs; DDP's own run also drops
``device_ids``). Then runs each at a tiny config (a synthetic 64-symbol dataset, 2 blocks, 2
micro-batches a rank an iteration, a clip of 0.05 that every iteration's norm exceeds): 9
iterations from scratch, and a run stopped after the save at iteration 4 then resumed to 8.
Prints each port's largest loss difference from DDP's, iteration by iteration.

The count: every line a unified diff marks (each ``+`` and each ``-``: a changed line is two),
of ports written as tightly as each allows under one rule: PEP 8's layout (one statement a
line, a compound statement's body on its own lines), and the port right wherever train.py runs:
one process without torchrun too (so a collective, or an API that needs a process group, only
``if ddp``), and every config nanoGPT ships (``always_save_checkpoint = False`` lets ranks
disagree on saving: rank 0's loss is broadcast). Both ports reproduce DDP's losses, which
takes, in both, the other ranks' RNG left to their training batches (``fork_rng`` around the
evaluation every rank now runs) and, in FSDP2's, rank 0's initial weights broadcast (nanoGPT
seeds each rank differently; DDP broadcasts rank 0's, FSDP2 shards each rank's own). FSDP2
also needs its wrap before the optimizer (one built before it trains nothing) and the
optimizer's state loaded through ``set_optimizer_state_dict``. ``--fused`` gives every
system's AdamW ``fused=True`` (nanoGPT's choice on CUDA). ``--compile`` runs train.py with its
default ``compile = True`` (``torch.compile(model)`` with inductor, then the wrap; the ports'
lines are the same); ``--systems`` picks some of ddp, fsdp2, minishard_1, minishard_2, minishard_3.
"""
import argparse
import difflib
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np


def sub(text, old, new):
    assert text.count(old) == 1, f"train.py has {text.count(old)} of {old!r}: another version?"
    return text.replace(old, new)


def cpu_baseline(upstream):
    """train.py as every CPU run needs it (no CUDA device to set)."""
    text = sub(upstream, "    device = f'cuda:{ddp_local_rank}'\n", "    device = 'cpu'\n")
    return sub(text, "    torch.cuda.set_device(device)\n", "")


DDP_WRAP = "if ddp:\n    model = DDP(model, device_ids=[ddp_local_rank])\n"
SAVED_MODEL = "                    'model': raw_model.state_dict(),\n"
SAVED_OPTIMIZER = "                    'optimizer': optimizer.state_dict(),\n"


def evaluate_on_every_rank(text):
    """The edits both ports need: every rank evaluates (a forward gathers), keeping the other
    ranks' RNG for training; rank 0's loss decides the save; wandb and the file on rank 0."""
    text = sub(text, "    if iter_num % eval_interval == 0 and master_process:\n"
                     "        losses = estimate_loss()\n",
               "    if iter_num % eval_interval == 0:\n"
               "        with torch.random.fork_rng(enabled=not master_process):\n"
               "            losses = estimate_loss()\n"
               "        if ddp:\n"
               "            torch.distributed.broadcast(losses['val'], 0)\n")
    text = sub(text, "        if wandb_log:\n", "        if wandb_log and master_process:\n")
    return sub(text, "                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))\n",
               "                if master_process:\n"
               "                    torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))\n")


def minishard_port(base, stage):
    text = sub(base, "from model import GPTConfig, GPT\n",
               "from model import GPTConfig, GPT\nimport minishard\n")
    text = sub(text, DDP_WRAP, "if ddp:\n    model = minishard.ZeRO(model, stage="
               f"{stage}, units={{type(model.transformer.h[0])}})\n")
    text = sub(text, SAVED_MODEL, "                    'model': model.full_state_dict("
               "rank0_only=True) if ddp else raw_model.state_dict(),\n")
    text = sub(text, SAVED_OPTIMIZER, "                    'optimizer': minishard."
               "full_optimizer_state_dict(model, optimizer) if ddp else optimizer.state_dict(),\n")
    return evaluate_on_every_rank(text)


def fsdp2_port(base):
    full = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    text = sub(base, "from model import GPTConfig, GPT\n",
               "from model import GPTConfig, GPT\nfrom torch.distributed.fsdp import fully_shard\n"
               "from torch.distributed.checkpoint.state_dict import get_model_state_dict, "
               "get_optimizer_state_dict, set_optimizer_state_dict, StateDictOptions\n")
    text = sub(text, DDP_WRAP, "")  # the wrap moves before the optimizer
    text = sub(text, "model.to(device)\n", "model.to(device)\nif ddp:\n"
               "    for p in model.parameters():\n        torch.distributed.broadcast(p.data, 0)\n"
               "    for block in model.transformer.h:\n        fully_shard(block)\n"
               "    fully_shard(model)\n")
    text = sub(text, "    optimizer.load_state_dict(checkpoint['optimizer'])\n",
               "    set_optimizer_state_dict(model, optimizer, checkpoint['optimizer'], "
               "options=StateDictOptions(full_state_dict=True))\n")
    text = sub(text, "raw_model = model.module if ddp else model # unwrap DDP container if needed\n",
               "raw_model = model\n")
    text = sub(text, SAVED_MODEL, f"                    'model': get_model_state_dict(model, "
               f"options={full}),\n")
    text = sub(text, SAVED_OPTIMIZER, "                    'optimizer': get_optimizer_state_dict("
               f"model, optimizer, options={full}),\n")
    return evaluate_on_every_rank(text)


def measured(text):
    """The same two edits in every system, DDP included: the loss to 9 digits, the clip's norm."""
    text = sub(text, "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
               "        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n")
    return sub(text, 'print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")',
               'print(f"iter {iter_num}: loss {lossf:.9f} norm {float(gnorm):.6f}")')


CONFIG = """eval_interval = 4; eval_iters = 2; always_save_checkpoint = True; wandb_log = False
dataset = 'tiny'; batch_size = 4; block_size = 16; n_layer = 2; n_head = 2; n_embd = 32
dropout = 0.0; bias = True; learning_rate = 1e-2; max_iters = 8; grad_clip = 0.05
warmup_iters = 2; lr_decay_iters = 8; min_lr = 1e-3; backend = 'gloo'; device = 'cpu'
dtype = 'float32'
"""


def prepare(work, nanogpt, world, fused, compiled):
    for name in ("model.py", "configurator.py"):
        shutil.copy(os.path.join(nanogpt, name), work)
    if fused:
        model = os.path.join(work, "model.py")
        text = sub(open(model).read(), "use_fused = fused_available and device_type == 'cuda'",
                   "use_fused = True")
        open(model, "w").write(text)
    with open(os.path.join(work, "cfg.py"), "w") as f:  # 2 micro-batches a rank an iteration
        f.write(CONFIG + f"gradient_accumulation_steps = {2 * world}\ncompile = {compiled}\n")
    os.makedirs(os.path.join(work, "data", "tiny"))
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 4000)):  # a noisy cycle: learnable, not trivial
        tokens = (np.arange(n) * 7 + rng.integers(0, 3, n)) % 64
        tokens.astype(np.uint16).tofile(os.path.join(work, "data", "tiny", f"{split}.bin"))
    with open(os.path.join(work, "data", "tiny", "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 64}, f)


def run(work, script, world, *args):
    """The iterations a run printed (``world`` 0: one process, no torchrun)."""
    launch = [sys.executable] if world == 0 else ["torchrun", "--standalone",
                                                  f"--nproc_per_node={world}"]
    out = subprocess.run([*launch, script, "cfg.py", *args], cwd=work, capture_output=True,
                         text=True)
    found = re.findall(r"iter (\d+): loss ([\d.]+) norm ([\d.]+)", out.stdout)
    return [(int(i), float(loss), float(norm)) for i, loss, norm in found]


def changed(base, port):
    """Every line of the unified diff that is added or removed (its ``+``/``-`` lines, not the
    file headers): a line changed counts twice, as a reviewer reads it."""
    diff = list(difflib.unified_diff(base.splitlines(), port.splitlines(), lineterm="", n=0))
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nanogpt")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--systems", default="ddp,fsdp2,minishard_1,minishard_2,minishard_3")
    args = parser.parse_args()
    base = cpu_baseline(open(os.path.join(args.nanogpt, "train.py")).read())
    ports = {"ddp": sub(base, DDP_WRAP, "if ddp:\n    model = DDP(model)\n"),
             "fsdp2": fsdp2_port(base)}
    ports.update({f"minishard stage {s}": minishard_port(base, s) for s in (1, 2, 3)})
    systems = args.systems.split(",")
    ports = {name: text for name, text in ports.items()
             if name.replace(" stage ", "_") in systems or name == "ddp"}  # DDP: the baseline
    work = tempfile.mkdtemp(prefix="nanogpt_port_")
    prepare(work, args.nanogpt, args.world, args.fused, args.compile)
    runs = {}
    for name, text in ports.items():
        lines = changed(base, text)
        if name != "ddp":
            print(f"{name}: {len(lines)} lines of diff from train.py under DDP (+ and -)")
            print("\n".join("    " + line for line in lines))
        script = name.replace(" ", "_") + ".py"
        with open(os.path.join(work, script), "w") as f:
            f.write(measured(text))
        out_dir = f"--out_dir=out_{script[:-3]}"
        full = run(work, script, args.world, out_dir)
        run(work, script, args.world, out_dir, "--max_iters=4")
        runs[name] = (full, run(work, script, args.world, out_dir, "--init_from=resume"))
        alone = run(work, script, 0, f"--out_dir=alone_{script[:-3]}", "--max_iters=4")
        print(f"  {name}: one process, no torchrun, iterations 0-4 with a save at 4: "
              f"{'ran' if [i for i, *_ in alone] == list(range(5)) else 'FAILED'}")
    print(f"\n{args.world} ranks, AdamW{' fused' if args.fused else ''}"
          f"{', compile = True' if args.compile else ''}: largest |loss - DDP's|")
    for i, kind in enumerate(("from scratch", "resumed at 4")):
        ddp = runs["ddp"][i]
        assert ddp, f"DDP's run ({kind}) printed no loss: see {work}"
        print(f"  {kind}: DDP's clip norms {min(n for *_, n in ddp):.3f}-{max(n for *_, n in ddp):.3f}"
              f" (clip {0.05}), {len(ddp)} iterations")
        for name in ports:
            got = runs[name][i]
            same = [g[0] for g in got] == [d[0] for d in ddp]
            worst = max(abs(g[1] - d[1]) for g, d in zip(got, ddp)) if same else float("nan")
            print(f"    {name:20s} {'' if same else 'ITERATIONS DIFFER '}{worst:.1e}")
    shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
