"""Tutorial 09: break it on purpose. Four classic data-parallel bugs, and what catches each.

    torchrun --standalone --nproc_per_node=2 tutorials/09_break_it.py                 (all four)
    torchrun --standalone --nproc_per_node=4 tutorials/09_break_it.py --bug split-tied

  syncbn-skip      one rank skips a SyncBatchNorm forward (a guard copied from single-GPU code).
                   Caught by minishard's debug mode: a CollectiveMismatch naming both layers.
  naive-variance   "synchronising" BatchNorm by averaging each rank's mean and variance.
                   Caught by comparing with BatchNorm on the global batch (the oracle).
  sum-not-average  all-reducing gradients with SUM instead of the average.
                   SGD silently trains with lr x N; Adam hides it. Caught by checking the
                   gradient against the one-process gradient: exactly N times too big.
  split-tied       giving each unit its own copy of a tied weight (embedding = output layer).
                   minishard keeps ONE copy, in the unit that contains both users; two copies
                   drift apart after the first step. Caught by counting elements.

None of these bugs crashes with a clear message by itself: they hang, or train a slightly
different model. Every claim printed below is asserted.
"""
import argparse
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

import minishard
from minishard import comm

TOL = dict(rtol=1e-4, atol=1e-5)


def everyone(flag: bool) -> bool:
    """True on every rank iff ``flag`` holds on every rank: all-reduce MAX of "not flag"."""
    t = torch.tensor([0.0 if flag else 1.0])
    comm.all_reduce(t, "max", tag="tutorial: check")
    return t.item() == 0.0


# ==================================================================================== (a)
def syncbn_skip(rank: int, world: int, say) -> None:
    """One rank skips a SyncBatchNorm forward; debug mode names the mismatch instead of hanging.

    The guard ``if x.shape[0] > 1: x = bn(x)`` is common in single-GPU code (BatchNorm cannot
    train on one sample). Here the LAST rank gets the 1-sample tail of the epoch, so it skips bn1
    and goes straight to bn2, while every other rank is in bn1. Without debug mode the ranks'
    all-reduces pair up wrongly: bn1's statistics on the other ranks are summed with bn2's on this
    one (same size: 2C+1 numbers, so no error at all), and every collective after that is paired
    with the wrong partner too: at best an error about mismatched sizes, at worst a hang until the
    process group times out (60 s here, 30 min by default). The guard was never needed:
    SyncBatchNorm normalises with the GLOBAL count, here more than 1.
    """
    say("(a) syncbn-skip: the last rank has 1 sample and skips bn1 (`if x.shape[0] > 1`)")
    model = minishard.convert_sync_batchnorm(nn.Sequential(OrderedDict(
        lin=nn.Linear(4, 4), bn1=nn.BatchNorm1d(4), act=nn.ReLU(), bn2=nn.BatchNorm1d(4))))
    x = torch.randn(1 if rank == world - 1 else 3, 4)
    # Debug mode: before every collective the ranks all-gather a fingerprint of what they are about
    # to call (op, shape, dtype, the layer's tag) and compare. A short timeout for the case where a
    # rank never arrives at all.
    comm.set_debug(True, timeout=3)
    caught = None
    try:
        h = model.lin(x)
        if h.shape[0] > 1:  # THE BUG
            h = model.bn1(h)
        model.bn2(model.act(h))
    except comm.CollectiveMismatch as err:
        caught = err
    finally:
        comm.set_debug(False)
    # Every rank raised at the same fingerprint exchange, so they are still in step: no rank is
    # stuck in a collective, and the process group is usable (the check below is a collective).
    assert everyone(caught is not None), "every rank must see the mismatch"
    assert "bn1" in str(caught) and "bn2" in str(caught), str(caught)
    say("    every rank raised minishard.comm.CollectiveMismatch (asserted), naming both layers:")
    say("    " + str(caught).replace("\n", "\n    "))
    say("    Fix: call every SyncBatchNorm on every rank; it needs only the GLOBAL count > 1.\n")


# ==================================================================================== (b)
def naive_variance(rank: int, world: int, say) -> None:
    """Uneven per-rank batches: averaging per-rank statistics is wrong twice over.

    Per-rank means and variances cannot be averaged: (1) ranks with more samples must weigh more,
    and (2) even weighted, the average of the variances misses the spread BETWEEN the ranks'
    means (the law of total variance):

        var(global) = sum_r n_r var_r / n  +  sum_r n_r (mean_r - mean)^2 / n

    Sums can be added, so SyncBatchNorm all-reduces [sum x, sum x^2, count] and is exact.
    """
    say("(b) naive-variance: uneven batches, each rank's data drawn around a different mean")
    C, eps = 3, 1e-5
    counts = [2 + 3 * r for r in range(world)]                 # 2, 5, 8, ... samples per rank
    gen = torch.Generator().manual_seed(0)
    shards = [torch.randn(n, C, generator=gen) * (1 + r) + 2 * r for r, n in enumerate(counts)]
    x_global = torch.cat(shards)
    start = sum(counts[:rank])
    mine = shards[rank]
    n = float(counts[rank])

    # The oracle: one process, BatchNorm on the global batch (training mode, batch statistics).
    reference = nn.BatchNorm1d(C)(x_global)[start:start + counts[rank]]
    true_mean, true_var = x_global.mean(0), x_global.var(0, unbiased=False)

    # Naive: average the ranks' means and variances.
    naive = torch.stack([mine.mean(0), mine.var(0, unbiased=False)])
    comm.all_reduce(naive, "avg", tag="naive stats")
    # Count-weighted: fixes the weights, still misses the spread between the ranks' means.
    weighted = torch.cat([mine.sum(0), n * mine.var(0, unbiased=False), torch.tensor([n])])
    comm.all_reduce(weighted, "sum", tag="weighted stats")
    w_mean, w_var = weighted[:C] / weighted[-1], weighted[C:2 * C] / weighted[-1]
    # SyncBatchNorm: [sum x, sum x^2, n] summed over ranks, then mean = S/n, var = Q/n - mean^2.
    y_sync = minishard.SyncBatchNorm(C)(mine)

    def normalise(mean, var):
        return (mine - mean) / torch.sqrt(var + eps)

    err = {"naive average": (normalise(naive[0], naive[1]) - reference).abs().max().item(),
           "count-weighted": (normalise(w_mean, w_var) - reference).abs().max().item(),
           "SyncBatchNorm": (y_sync - reference).abs().max().item()}
    # What rank 0's output shows is checked on every rank:
    assert torch.allclose(w_mean, true_mean, **TOL)                    # weights fix the mean...
    assert (w_var < true_var).all()                                    # ...not the variance
    assert (naive[0] - true_mean).abs().max() > 0.1                    # naive: both wrong
    assert err["naive average"] > 0.05 and err["count-weighted"] > 0.05, err
    torch.testing.assert_close(y_sync, reference, **TOL)               # SyncBN: the oracle
    everyone(True)  # (a collective: every rank got here)
    fmt = lambda t: "[" + " ".join(f"{v:6.2f}" for v in t.tolist()) + "]"  # noqa: E731
    say(f"    samples per rank {counts}; per channel:")
    say(f"      global batch (oracle)  mean {fmt(true_mean)}  var {fmt(true_var)}")
    say(f"      naive average          mean {fmt(naive[0])}  var {fmt(naive[1])}")
    say(f"      count-weighted average mean {fmt(w_mean)}  var {fmt(w_var)}   (var too small)")
    for name, e in err.items():
        say(f"    max |{name} output - BatchNorm on the global batch| = {e:.1e}")
    say("    Asserted: only SyncBatchNorm's [sum x, sum x^2, n] equals the global batch.\n")


# ==================================================================================== (c)
PER_RANK = 4


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def train(batches, rank: int, opt_name: str, lr: float, op: str | None, grads_out=None):
    """Three SGD/Adam steps. op=None: ONE process on the global batch (the oracle); op="avg"
    or "sum": this rank's slice, then all_reduce of the gradients with that op."""
    model = make_mlp()
    opt = (torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK) if op else slice(None)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        if op:
            for p in model.parameters():
                comm.all_reduce(p.grad, op, tag=f"grads ({op})")
        if grads_out is not None:
            grads_out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sum_not_average(rank: int, world: int, say) -> None:
    """SUM instead of the average: N times the gradient. SGD then takes N times the step, i.e.
    trains with lr x N; Adam divides by the gradient's own scale and hides the bug almost
    entirely (until you change the world size and the effective hyper-parameters move)."""
    say(f"(c) sum-not-average: all_reduce(SUM) of the gradients on {world} ranks")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(PER_RANK * world, 6, generator=gen),
                torch.randn(PER_RANK * world, 1, generator=gen)) for _ in range(3)]
    lr = 0.1
    oracle_grads, summed_grads = [], []
    sgd_oracle = train(batches, rank, "sgd", lr, None, oracle_grads)
    sgd_summed = train(batches, rank, "sgd", lr, "sum", summed_grads)
    sgd_big_lr = train(batches, rank, "sgd", lr * world, None)
    adam_avg = train(batches, rank, "adam", 1e-2, "avg")
    adam_sum = train(batches, rank, "adam", 1e-2, "sum")

    sgd_gap = (sgd_summed - sgd_oracle).abs().max().item()
    adam_gap = (adam_sum - adam_avg).abs().max().item()
    assert sgd_gap > 1e-3, sgd_gap
    torch.testing.assert_close(sgd_summed, sgd_big_lr, **TOL)
    assert adam_gap < 1e-4 * (adam_avg.abs().max().item() + 1), adam_gap
    # The catch: at the FIRST step both runs start from the same weights, so the gradient must
    # equal the one-process gradient on the global batch. Summed, it is exactly N times it.
    for g_sum, g_one in zip(summed_grads[0], oracle_grads[0]):
        torch.testing.assert_close(g_sum, world * g_one, **TOL)
    same = (sgd_summed - sgd_big_lr).abs().max().item()
    say(f"    SGD : max |summed - oracle| = {sgd_gap:.3f}, but max |summed - oracle with "
        f"lr x {world}| = {same:.1e}: it IS lr x {world} (asserted)")
    say(f"    Adam: max |summed - averaged| = {adam_gap:.1e}: hidden, Adam is scale-invariant "
        "(asserted < 1e-4)")
    say(f"    Caught by the oracle check: step-1 gradient = {world} x the one-process gradient "
        "on the global batch, for every tensor (asserted).\n")


# ==================================================================================== (d)
VOCAB, DIM, SEQ = 12, 8, 5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)

    def forward(self, ids):
        return self.emb(ids)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h):
        return self.proj(self.norm(h))


class TinyLM(nn.Module):
    """Embedding and output layer share ONE matrix (weight tying, as in GPT-2)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mid, self.head = Embed(), nn.Linear(DIM, DIM), Head()
        if tied:
            self.head.proj.weight = self.embed.emb.weight
        else:  # two copies that START equal: what a per-unit copy would be
            self.head.proj.weight = nn.Parameter(self.embed.emb.weight.detach().clone())

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def lm_step(model, ids, targets, lr=0.5) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    opt.step()


def split_tied(rank: int, world: int, say) -> None:
    """Where does a tied weight live when its two users are in different units?

    minishard puts a parameter in the innermost unit that contains EVERY module using it: here
    the root, since embed and head are separate units. One copy, one flat slot: autograd sums
    both users' gradients into it, exactly as in one process. If instead each unit kept its own
    copy, each copy would get only its own user's gradient and the two would differ after the
    first step: the model is silently no longer tied.
    """
    say("(d) split-tied: embed.emb.weight IS head.proj.weight; embed and head are separate units")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(VOCAB, (2 * world, SEQ), generator=gen)
    targets = torch.randint(VOCAB, (2 * world, SEQ), generator=gen)
    mine = slice(2 * rank, 2 * rank + 2)

    tied = minishard.ZeRO(TinyLM(tied=True), stage=3, units={Embed, Head})
    layout = {u.name: sum(f.numel for f in u.flats) for u in tied.units}
    unique = sum(p.numel() for p in TinyLM(tied=True).parameters())        # counts a tie once
    listed = sum(p.numel() for _, p in TinyLM(tied=True).named_parameters(remove_duplicate=False))
    assert listed - unique == VOCAB * DIM                       # the tie, listed twice by name
    assert sum(layout.values()) == unique, layout               # ...but stored ONCE
    assert layout["<root>"] >= VOCAB * DIM and layout["embed"] == 0, layout
    say(f"    elements per unit: {layout}  (total {sum(layout.values())} = the model's "
        f"{unique} unique elements; by name it lists {listed}: asserted)")
    say("    the tied matrix lives in <root>, the innermost unit containing both users; "
        "the embed unit is left empty.")

    reference = TinyLM(tied=True)                 # one process, the global batch
    lm_step(reference, ids, targets)
    lm_step(tied, ids[mine], targets[mine])
    state = tied.full_state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, **TOL, msg=k)
    assert torch.equal(state["embed.emb.weight"], state["head.proj.weight"])
    say("    after a step: equal to one process on the global batch, and still tied (asserted).")

    # The bug: one copy per unit (they start equal). Each copy sees only its own user's gradient.
    split = minishard.ZeRO(TinyLM(tied=False), stage=3, units={Embed, Head})
    split_layout = {u.name: sum(f.numel for f in u.flats) for u in split.units}
    assert sum(split_layout.values()) == unique + VOCAB * DIM   # the matrix stored twice
    lm_step(split, ids[mine], targets[mine])
    s = split.full_state_dict()
    drift = (s["embed.emb.weight"] - s["head.proj.weight"]).abs().max().item()
    wrong = (s["head.proj.weight"] - reference.state_dict()["head.proj.weight"]).abs().max().item()
    assert drift > 1e-3 and wrong > 1e-3, (drift, wrong)
    say(f"    with a copy per unit ({split_layout}): {VOCAB * DIM} extra elements, and after one "
        f"step\n    max |embed copy - head copy| = {drift:.3f}, max |head - tied reference| = "
        f"{wrong:.3f}: no longer tied, no longer the same model (asserted).\n")


BUGS = {"syncbn-skip": syncbn_skip, "naive-variance": naive_variance,
        "sum-not-average": sum_not_average, "split-tied": split_tied}


def main(rank: int, world: int, bug: str | None) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    for name in [bug] if bug else BUGS:
        BUGS[name](rank, world, say)
    say("All assertions held.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", choices=sorted(BUGS), help="run one (default: all four)")
    args = parser.parse_args()
    # Set-up and tear-down, the same for every lesson: see minishard/launch.py.
    with minishard.launch.session(
            world_sizes=minishard.launch.at_least(2),
            why="each of these bugs is a disagreement between ranks") as (rank, world):
        main(rank, world, args.bug)
