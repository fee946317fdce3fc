"""Uneven inputs under torch's Join (join.py): ranks with different numbers of batches.

The oracles, unmodified:
  * torch DDP inside ``Join([ddp])`` with a plain optimizer, on the same batches per rank: DDP
    averages each step's gradient over the initial world size with zeros from joined ranks, and
    its post-hook hands every rank the last joiner's weights. The wrapped model, at stages 0-3,
    2-4 ranks, drawn batch counts per rank (a rank with none among them), SGD with momentum or
    Adam, with prefetch, buckets, no_sync accumulation, replicated parameters, mixed precision
    (against DDP computing in the same dtype is not possible: mixed precision is checked against
    the same engine without Join on even batches instead), torch's clip and a scheduler that
    decays the lr after every step (a joined rank's stops with its loop), ends with DDP's
    parameters, on every rank (the joined ones stepped their shards too). The same oracle for
    ShardedOptimizer, beside DDP (``Join([ddp, opt], model=ddp)``) and over a stage-0 model.
  * One process for SyncBatchNorm: each step's batch is the active ranks' samples together (a
    joined rank contributes a count of 0), and the loss the sum of the active ranks' means over
    the initial world size (what the averaged gradient is the gradient of).
  * A forward-only evaluation at stage 3 under ``torch.no_grad()`` gives the plain model's
    outputs on every batch a rank has, and finishes.
No test may hang: every pool has a deadline (conftest's RankPool timeout), and the refusals are
raised on every rank.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import minishard
from minishard import ZeRO

TIGHT = dict(rtol=1e-9, atol=1e-11)
D = 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, batch_norm=False):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.bn = minishard.SyncBatchNorm(D) if batch_norm else nn.Identity()
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        return self.out(self.blocks(self.bn(self.inp(x))))


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def batches(rank: int, count: int, rows: int = 4):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(rows, D, generator=gen, dtype=torch.float64),
             torch.randn(rows, 3, generator=gen, dtype=torch.float64)) for _ in range(count)]


def clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def loop(model, opt, data, micro=False, clipped=False, scheduled=False, joinables=None,
         join_kw=None):
    """The user's loop, the same for DDP and minishard: under Join, with no_sync accumulation
    (two micro-batches, the first without communication), torch's clip and a scheduler that
    steps the lr down after every step (a joined rank's stops with its loop) if asked."""
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7) if scheduled else None
    join_kw = join_kw or dict(optimizer=opt, before_step=clip if clipped else None)
    with Join(joinables or [model], **join_kw):
        for x, y in data:
            opt.zero_grad()
            if micro:
                with model.no_sync():
                    (((model(x[:2]) - y[:2]) ** 2).sum() / y.numel()).backward()
                (((model(x[2:]) - y[2:]) ** 2).sum() / y.numel()).backward()
            else:
                ((model(x) - y) ** 2).mean().backward()
            if clipped:
                clip(model)
            opt.step()
            if sched is not None:
                sched.step()


def both(counts, stage, opt_name, micro=False, clipped=False, scheduled=False, hybrid=False,
         **kw):
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net().double()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=kw.get("find_unused_parameters", False))
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    loop(ddp, OPTIMIZERS[opt_name](ddp.parameters()), batches(rank, counts[rank]), micro,
         clipped, scheduled)
    model = ZeRO(copy.deepcopy(base), stage=stage, units=Block, **kw)
    loop(model, OPTIMIZERS[opt_name](model.parameters()), batches(rank, counts[rank]), micro,
         clipped, scheduled)
    return model.full_state_dict(), ddp.module.state_dict()


def assert_same(a, b, **tol):
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TIGHT), msg=lambda m: f"{k}: {m}")


@settings(max_examples=10)
@given(world=st.integers(2, 4), stage=st.integers(0, 3), data=st.data(),
       opt_name=st.sampled_from(sorted(OPTIMIZERS)), prefetch=st.booleans(),
       bucket_bytes=st.sampled_from([0, 4096]), micro=st.booleans(), clipped=st.booleans(),
       scheduled=st.booleans(), persist=st.sampled_from([0, 7]), find_unused=st.booleans(),
       hybrid=st.booleans())
@example(world=3, stage=3, data=None, opt_name="adam", prefetch=True, bucket_bytes=4096,
         micro=False, clipped=True, scheduled=True, persist=0, find_unused=False, hybrid=False)
@example(world=2, stage=1, data=None, opt_name="sgd", prefetch=False, bucket_bytes=0,
         micro=True, clipped=False, scheduled=True, persist=7, find_unused=True, hybrid=False)
@example(world=4, stage=2, data=None, opt_name="sgd", prefetch=False, bucket_bytes=4096,
         micro=False, clipped=True, scheduled=False, persist=0, find_unused=False, hybrid=True)
@example(world=3, stage=0, data=None, opt_name="adam", prefetch=False, bucket_bytes=0,
         micro=True, clipped=False, scheduled=True, persist=0, find_unused=True, hybrid=False)
def test_join_equals_ddp_under_join(pools, world, stage, data, opt_name, prefetch, bucket_bytes,
                                    micro, clipped, scheduled, persist, find_unused, hybrid):
    if data is None:  # the explicit examples: a rank with none, the others uneven
        counts = [3, 0, 5, 1][:world]
    else:
        counts = data.draw(st.lists(st.integers(0, 4), min_size=world, max_size=world)
                           .filter(any))
    kw = dict(prefetch=prefetch, bucket_bytes=bucket_bytes if stage >= 2 else 0,
              persist_below=persist, find_unused_parameters=find_unused and stage < 3)
    hybrid = hybrid and world == 4 and stage > 0
    for ours, ddp in pools(world).run(both, counts, stage, opt_name, micro, clipped,
                                      scheduled, hybrid, **kw):
        assert_same(ours, ddp)


# ---------------------------------------------------------------------------- SyncBatchNorm
def syncbn_joined(counts, stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ZeRO(Net(batch_norm=True).double(), stage=stage, units=Block)
    loop(model, OPTIMIZERS["sgd"](model.parameters()), batches(rank, counts[rank]))
    return model.full_state_dict()


def syncbn_one_process(counts):
    """Step i: the active ranks' batches together; loss = sum of their means / world size."""
    torch.manual_seed(0)
    net = Net(batch_norm=True).double()
    net.bn = nn.BatchNorm1d(D).double()  # one process: torch's own, on the whole batch
    opt = OPTIMIZERS["sgd"](net.parameters())
    data = [batches(r, c) for r, c in enumerate(counts)]
    for i in range(max(counts)):
        active = [d[i] for d in data if i < len(d)]
        x = torch.cat([x for x, _ in active])
        out, start, loss = net(x), 0, 0
        for _, y in active:
            loss = loss + ((out[start:start + len(y)] - y) ** 2).mean()
            start += len(y)
        opt.zero_grad()
        (loss / len(counts)).backward()
        opt.step()
    return net.state_dict()


@pytest.mark.parametrize("world, stage, counts", [(2, 3, [1, 3]), (3, 1, [2, 0, 3]),
                                                  (4, 2, [3, 1, 2, 0])])
def test_syncbatchnorm_under_join_equals_one_process(pools, world, stage, counts):
    want = syncbn_one_process(counts)
    for got in pools(world).run(syncbn_joined, counts, stage):
        assert_same(got, want)


# ------------------------------------------------------------------------------ evaluation
def evaluate(counts, stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = Net().double()
    model = ZeRO(copy.deepcopy(plain), stage=stage, units=Block)
    outs = []
    with torch.no_grad(), Join([model]):
        for x, _ in batches(rank, counts[rank]):
            outs.append((model(x), plain(x)))
    with minishard.ledger() as led, torch.no_grad():  # after the block: no Join traffic
        model(torch.zeros(1, D, dtype=torch.float64))
    assert not [e.tag for e in led.entries if e.tag.startswith("Join")]
    return [torch.allclose(a, b, **TIGHT) for a, b in outs]


@pytest.mark.parametrize("world, counts", [(2, [0, 3]), (3, [4, 1, 2])])
def test_forward_only_evaluation_at_stage_3_finishes(pools, world, counts):
    for rank, same in enumerate(pools(world).run(evaluate, counts, 3)):
        assert same == [True] * counts[rank]


# ---------------------------------------------------------------- find_unused_parameters
class SmallBatchBranch(Net):
    """A branch only a batch of fewer than 2 rows takes: no active rank here, but a joined
    rank's empty batch would. It must count as unused, as under DDP's Join, or it gets zero
    gradients that Adam turns into steps."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(D, 3)

    def forward(self, x):
        out = super().forward(x)
        return out + self.extra(x) if x.shape[0] < 2 else out


def branch_both(counts, stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = SmallBatchBranch().double()
    decay = lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.5)  # noqa: E731
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    loop(ddp, decay(ddp.parameters()), batches(rank, counts[rank]))
    model = ZeRO(copy.deepcopy(base), stage=stage, units=(Block, nn.Linear),
                 find_unused_parameters=True)
    loop(model, decay(model.parameters()), batches(rank, counts[rank]))
    return model.full_state_dict(), ddp.module.state_dict(), base.state_dict()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_branch_only_the_joined_rank_takes_stays_unused(pools, stage):
    # The branch's oracle is one process: no rank took it, so AdamW never touches it. (DDP
    # agrees in a fresh process, but on a warm rank that ran an earlier DDP under Join on even
    # batches it decays the branch too: measured, a torch quirk, so DDP is the oracle for the
    # rest only.)
    for ours, ddp, initial in pools(3).run(branch_both, [2, 0, 3], stage):
        branch = [k for k in ours if k.startswith("extra.")]
        assert_same({k: ours[k] for k in branch}, {k: initial[k] for k in branch}, rtol=0, atol=0)
        assert_same({k: v for k, v in ours.items() if k not in branch},
                    {k: v for k, v in ddp.items() if k not in branch})


# ---------------------------------------------------- a rank that joins mid-accumulation
def accumulate_in_pairs(model, opt, data, join_kw):
    """Two micro-batches a step, the first without gradient sync (DDP's flag, nanoGPT's
    spelling); a rank with an odd count leaves its loop after an unpaired micro-batch."""
    with Join([model], **join_kw):
        for i, (x, y) in enumerate(data):
            last = i % 2 == 1
            model.require_backward_grad_sync = last
            (((model(x) - y) ** 2).mean() / 2).backward()
            if last:
                opt.step()
                opt.zero_grad()
    model.require_backward_grad_sync = True


def joined_mid_accumulation(counts, stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net().double()
    ddp = DDP(copy.deepcopy(base))
    accumulate_in_pairs(ddp, OPTIMIZERS["sgd"](ddp.parameters()), batches(rank, counts[rank]), {})
    model = ZeRO(copy.deepcopy(base), stage=stage, units=Block)
    opt = OPTIMIZERS["sgd"](model.parameters())
    accumulate_in_pairs(model, opt, batches(rank, counts[rank]), dict(optimizer=opt))
    return model.full_state_dict(), ddp.module.state_dict()


@pytest.mark.parametrize("world, stage", [(3, 0), (3, 1), (2, 2), (3, 3)])
def test_a_rank_joining_mid_accumulation_contributes_zeros_as_under_ddp(pools, world, stage):
    """Its unpaired micro-batch's gradient, accumulated under no_sync, is dropped: DDP's joined
    rank sends zeros for the step it never finished."""
    counts = [4, 3, 6][:world] if world == 3 else [3, 6]
    for ours, ddp in pools(world).run(joined_mid_accumulation, counts, stage):
        assert_same(ours, ddp)


# -------------------------------------------------------- an output the batch does not touch
class Scaled(Net):
    """CLIP's shape: the logits and ``logit_scale.exp()``, returned side by side. A joined rank
    must send a zero gradient for the scale too, as DDP's joined rank does."""

    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        return super().forward(x), self.logit_scale.exp()


def scaled_both(counts, stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Scaled().double()
    results = []
    for model in (DDP(copy.deepcopy(base)), ZeRO(copy.deepcopy(base), stage=stage, units=Block)):
        opt = OPTIMIZERS["sgd"](model.parameters())
        with Join([model], **({} if isinstance(model, DDP) else dict(optimizer=opt))):
            for x, y in batches(rank, counts[rank]):
                out, scale = model(x)
                ((out * scale - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
        results.append(model.module.state_dict() if isinstance(model, DDP)
                       else model.full_state_dict())
    return results


@pytest.mark.parametrize("world, stage", [(2, 0), (3, 1), (4, 2), (3, 3)])
def test_an_output_the_batch_does_not_touch_gets_no_gradient_from_a_joined_rank(pools, world,
                                                                               stage):
    counts = [3, 0, 4, 1][:world]
    for ddp, ours in pools(world).run(scaled_both, counts, stage):
        assert_same(ours, ddp)


# ------------------------------------------------------------------------- mixed precision
def mixed(counts, join):
    """Stage 3 under bf16 compute, fp32 reduction: under Join, or without it with an empty
    batch (zero rows) where a rank has none, which is what a joined rank contributes."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ZeRO(Net().double(), stage=3, units=Block, mixed_precision=minishard.MixedPrecision(
        param_dtype=torch.float32, reduce_dtype=torch.float32))
    opt = OPTIMIZERS["adam"](model.parameters())
    data = batches(rank, counts[rank])
    if join:
        loop(model, opt, data)
    else:
        data += [(x[:0], y[:0]) for x, y in batches(rank, max(counts))[len(data):]]
        for x, y in data:
            opt.zero_grad()
            (((model(x) - y) ** 2).sum() / max(y.numel(), 1)).backward()  # a mean, or 0
            opt.step()
    return model.full_state_dict()


def test_mixed_precision_under_join_equals_empty_batches_without_it(pools):
    counts = [1, 3, 0]
    want = pools(3).run(mixed, counts, False)
    for got, expected in zip(pools(3).run(mixed, counts, True), want):
        assert_same(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------ ShardedOptimizer
def sharded_optimizer_joined(counts, opt_name, micro, clipped, scheduled, find_unused):
    """DDP + a plain optimizer under Join([ddp]) (the oracle); DDP + ShardedOptimizer under
    Join([ddp, opt], model=ddp); ShardedOptimizer stepped by a stage-0 model's own hook."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base, data = Net().double(), batches(rank, counts[rank])
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=find_unused)
    plain = OPTIMIZERS[opt_name](ddp.parameters())
    loop(ddp, plain, data, micro, clipped, scheduled)
    ours = DDP(copy.deepcopy(base), find_unused_parameters=find_unused)
    cls, options = type(plain), plain.defaults
    opt = minishard.ShardedOptimizer(ours.parameters(), cls, **options)
    loop(ours, opt, data, micro, clipped, scheduled, [ours, opt], dict(model=ours))
    model = ZeRO(copy.deepcopy(base), stage=0)
    opt = minishard.ShardedOptimizer(model.parameters(), cls, **options)
    loop(model, opt, data, micro, clipped, scheduled)
    return ours.module.state_dict(), model.full_state_dict(), ddp.module.state_dict()


@settings(max_examples=8)
@given(world=st.integers(2, 4), data=st.data(), opt_name=st.sampled_from(sorted(OPTIMIZERS)),
       micro=st.booleans(), clipped=st.booleans(), scheduled=st.booleans(),
       find_unused=st.booleans())
@example(world=3, data=None, opt_name="adam", micro=True, clipped=True, scheduled=True,
         find_unused=False)
def test_sharded_optimizer_under_join_equals_ddp_with_a_plain_optimizer(
        pools, world, data, opt_name, micro, clipped, scheduled, find_unused):
    counts = ([1, 4, 0] if data is None else
              data.draw(st.lists(st.integers(0, 4), min_size=world, max_size=world)))
    for beside_ddp, through_model, ddp in pools(world).run(
            sharded_optimizer_joined, counts, opt_name, micro, clipped, scheduled, find_unused):
        assert_same(beside_ddp, ddp)
        assert_same(through_model, ddp)


def sharded_refusals():
    """Join([ddp, opt]) without the model or with a minishard model, loops that skip a step,
    the optimizer listed first: refused. Then the same optimizer, rightly used, still works."""
    ddp = DDP(Net().double())
    opt = minishard.ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    said = []
    for joinables, kw in [([ddp, opt], {}), ([ddp, opt], {"model": ZeRO(Net())})]:
        try:
            Join(joinables, **kw)
        except ValueError as exc:
            said.append(str(exc))
    x = torch.ones(4, D, dtype=torch.float64)
    # a step every other backward; no step after the last; the optimizer listed first
    for every, iterations, first in [(2, 4, ddp), (2, 1, ddp), (1, 4, opt)]:
        try:
            with Join([first, opt if first is ddp else ddp], model=ddp):
                for i in range(iterations):
                    ddp(x).sum().backward()
                    if i % every == every - 1:
                        opt.step()
        except RuntimeError as exc:
            said.append(str(exc))
    with Join([ddp, opt], model=ddp):
        ddp(x).sum().backward()
        opt.step()
    return said


def sharded_after_early_termination(counts):
    """Join([ddp, opt], throw_on_early_termination=True) raises on every rank; then training
    goes on without Join, as with DDP + a plain optimizer (torch's documented use)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base, data = Net().double(), batches(rank, counts[rank])
    results = []
    for sharded in (False, True):
        ddp = DDP(copy.deepcopy(base))
        opt = (minishard.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
               if sharded else OPTIMIZERS["adam"](ddp.parameters()))
        said = "finished"
        try:
            loop(ddp, opt, data, joinables=[ddp, opt] if sharded else [ddp],
                 join_kw=dict(model=ddp, throw_on_early_termination=True))
        except RuntimeError as exc:
            said = str(exc)
        for x, y in batches(rank + 10, 2):  # on, without Join
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
        results.append((said, ddp.module.state_dict()))
    return results


def test_sharded_optimizer_trains_on_after_early_termination(pools):
    for (said_plain, want), (said, got) in pools(2).run(sharded_after_early_termination,
                                                        [1, 3]):
        assert "exhausted" in said and "exhausted" in said_plain, (said, said_plain)
        assert_same(got, want)


def test_sharded_optimizer_under_join_is_refused_where_it_cannot_be_right(pools):
    for said in pools(2).run(sharded_refusals):
        assert len(said) == 5, said
        assert all("Join([ddp, opt], model=ddp)" in s for s in said), said
        assert "Join([model], optimizer=opt)" in said[1], said
        assert all("steps exactly once" in s for s in said[2:4]), said
        assert "after the model" in said[4], said


# -------------------------------------------------------------------------------- refusals
def step_every_other(counts, at_the_top):
    """A loop that steps every other backward, or at the top of the next iteration (so the
    rank that leaves first owes a step)."""
    rank = dist.get_rank()
    model = ZeRO(Net().double(), stage=3, units=Block)
    opt = OPTIMIZERS["sgd"](model.parameters())
    i = -1
    try:
        with Join([model], optimizer=opt):
            for i, (x, y) in enumerate(batches(rank, counts[rank])):
                if at_the_top and i:
                    opt.step()
                    opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()  # reduces every time...
                if i % 2 and not at_the_top:
                    opt.step()  # ... but steps every other time
                    opt.zero_grad()
    except RuntimeError as exc:
        return str(exc), i
    return "finished", i


@pytest.mark.parametrize("at_the_top", [False, True])
def test_a_loop_that_does_not_step_after_each_reduction_is_refused_on_every_rank(pools,
                                                                                  at_the_top):
    said = pools(2).run(step_every_other, [2, 5], at_the_top)
    for message, _ in said:
        assert "exactly one step of the optimizer given to Join" in message, message
    # refused at rank 1's first forward after the rule broke, not at the end of its 5 batches:
    # the second (every other), the third (rank 0 left owing a step after its 2 batches)
    assert said[1][1] == (2 if at_the_top else 1), said


def scheduler_between_forward_and_step(counts, tensor_lr):
    """The lr changed after the forward that sent it to the joined rank: refused (a tensor lr
    changes in place)."""
    rank = dist.get_rank()
    model = ZeRO(Net().double(), stage=2, units=Block)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01) if tensor_lr else 0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    try:
        with Join([model], optimizer=opt):
            for x, y in batches(rank, counts[rank]):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                sched.step()  # before the step: torch warns; a joined rank cannot follow it
                opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "finished"


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_options_changed_between_forward_and_step_are_refused_on_every_rank(pools, tensor_lr):
    for message in pools(3).run(scheduler_between_forward_and_step, [1, 3, 0], tensor_lr):
        assert "changed between the forward and the step" in message, message
    assert pools(2).run(scheduler_between_forward_and_step, [2, 2], tensor_lr) == \
        ["finished"] * 2


def forwards_out_of_pattern(pattern):
    """Loops that work without Join, but not one forward, its backward and a step: refused on
    every rank before a collective (a joined rank shadows a forward with a backward); and two
    optimizers, of which Join knows one, refused at Join(...)."""
    model = ZeRO(Net().double(), stage=3, units=Block)
    opt = OPTIMIZERS["sgd"](model.parameters())
    x, y = batches(dist.get_rank(), 1)[0]
    try:
        if pattern == "two optimizers":
            out = dict(model.named_parameters())
            Join([model], optimizer=OPTIMIZERS["sgd"]([out["module.out.weight"],
                                                       out["module.out.bias"]]))
        with Join([model], optimizer=opt):
            for _ in range(2):
                loss = ((model(x) - y) ** 2).mean()
                if pattern == "evaluation inside the step":
                    with torch.no_grad():
                        model(x)
                elif pattern == "two forwards, one backward":
                    loss = loss + ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return "finished"


@pytest.mark.parametrize("pattern", ["evaluation inside the step", "two forwards, one backward",
                                     "two optimizers"])
def test_forwards_out_of_pattern_are_refused_on_every_rank(pools, pattern):
    for message in pools(2).run(forwards_out_of_pattern, pattern):
        assert ("was not followed by its backward" in message if pattern != "two optimizers"
                else "['module.inp.weight', 'module.inp.bias'," in message), message


def early_termination(counts, stage):
    """Join(throw_on_early_termination=True) raises; a second Join with the same model and
    optimizer then finishes (the first left no step hooks behind to count steps twice)."""
    rank = dist.get_rank()
    model = ZeRO(Net().double(), stage=stage, units=Block)
    opt = OPTIMIZERS["sgd"](model.parameters())
    said = "finished"
    try:
        with Join([model], optimizer=opt, throw_on_early_termination=True):
            for x, y in batches(rank, counts[rank]):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
    except RuntimeError as exc:
        said = str(exc)
    loop(model, opt, batches(rank, counts[rank]))
    return said


@pytest.mark.parametrize("stage", [0, 3])
def test_throw_on_early_termination_raises_on_every_rank(pools, stage):
    messages = pools(3).run(early_termination, [2, 4, 4], stage)
    assert "exhausted all inputs" in messages[0]
    assert all("exhausted" in m for m in messages[1:]), messages
