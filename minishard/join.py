"""Uneven inputs: torch's ``Join`` for a ZeRO model, when ranks have different numbers of batches.

    from torch.distributed.algorithms.join import Join
    with Join([model], optimizer=opt):       # the optimizer the loop steps
        for x, y in my_batches:              # this rank's: another rank may have more, or none
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

Every rank must issue the same collectives in the same order. A rank out of batches (it has
*joined*) cannot just wait: at stages 1-3 it owns a shard of everything, and the others' gathers
and reductions need it. torch's ``Join`` runs, on a joined rank, a loop of one all-reduce
counting the ranks still training (they join it at each forward: ``Join.notify_join_context``);
while any are, it calls ``main_hook``, which must issue what one of their iterations issues.

**A shadow step is a real step on an empty batch**: the model's forward and backward on the last
batch shape this rank saw, cut to zero rows. So it issues what the engine issues for any batch,
in the same order, with no list to keep in step with the engine. Its gradients are zeros and
the reductions average over every rank, joined ones included: the active ranks' sum over the
INITIAL world size, as DDP computes it under ``Join``. Then the hook steps the optimizer given
to ``Join``, so the joined rank's shard, momentum and Adam state move with everyone's (stock
ZeroRedundancyOptimizer steps its shard without the averaged gradient, and ends wrong).

**What the others are about to do** reaches the joined ranks in one more all-reduce (MAX) at
each forward of the active ranks, a ``Plan``: will a backward follow? will it reduce? When a
joined rank will step, the active ranks also send the optimizer's options (a joined rank's own
lr stopped with its loop's scheduler); a rank that never saw a batch asks for its shape once.
The rules a loop under ``Join`` keeps are checked on every rank: [Note: Join's rules] below.
This file attaches to the engine from outside: a listener on its event stream while Join runs.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref

import torch
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.utils._pytree import tree_flatten, tree_map

from minishard import comm, verdicts
from minishard.checkpoint.full_state import hyperparameters

__all__ = ["JoinState", "ZeROJoinHook", "ShardedJoinHook"]


@dataclasses.dataclass
class JoinState:
    """One engine's bookkeeping under ``Join``."""
    optimizer: torch.optim.Optimizer | None = None
    before_step: object = None      # fn(model), run by a joined rank before its step
    inputs: tuple | None = None     # (args, kwargs) of the last forward, cut to zero rows
    synced: int = 0                 # backwards that reduced, since the last forward
    steps: int = 0                  # optimizer steps, since the last forward
    options: list | None = None     # the optimizer's options sent at the last forward
    changed: bool = False           # ... and they changed before the step
    unanswered: bool = False        # the last forward had grad enabled; its backward not run
    hooks: tuple = ()               # the optimizer's step hooks (removed by the post-hook)
    listener: object = None         # ours on the engine's event stream (removed with them)

    def broken(self) -> bool:
        """This rank broke the rules since the last forward."""
        return self.synced != self.steps or self.changed

    def reset(self) -> None:
        self.synced = self.steps = 0
        self.options, self.changed, self.unanswered = None, False, False

    def backward_done(self, synced: bool) -> None:
        self.synced += synced
        self.unanswered = False

    def attach(self, engine) -> None:
        """Listen to the engine's events (engine.py): its root forwards announce this rank, its
        backwards are counted. Only while a Join runs: outside one the engine runs no Join code."""
        ref = weakref.ref(engine)

        def heard(event: str, unit=None, *payload) -> None:
            engine = ref()
            if event == "step" and engine._join_config.enable and not engine._reducer.shadowing:
                announce(engine, *payload)  # this rank has not joined; the plan
            elif event == "backward_done":
                self.backward_done(engine.require_backward_grad_sync)
        self.listener = heard
        engine.listeners.append(heard)

    def detach(self, engine) -> None:
        for hook in self.hooks:
            hook.remove()
        if self.listener in engine.listeners:
            engine.listeners.remove(self.listener)
        self.hooks, self.listener = (), None


@dataclasses.dataclass
class Plan:
    """What the active ranks' step does, as every rank learns it (MAX over ranks)."""
    backward: bool     # grad is enabled: a backward follows the forward
    sync: bool         # that backward reduces
    broken: bool       # some active rank broke the rules since its last forward
    needs_inputs: bool  # a joined rank has never seen a batch: send it the shape
    joined: bool       # some rank has joined: if it steps, send it the optimizer's options

    @staticmethod
    def exchange(mine: list[bool], group) -> "Plan":
        flags = torch.tensor(mine, dtype=torch.uint8)
        comm.all_reduce(flags, "max", group, tag="Join: what this step does")
        return Plan(*map(bool, flags.tolist()))

    def steps_joined(self, optimizer) -> bool:
        """A joined rank steps this iteration (and takes the active ranks' options)."""
        return self.joined and self.backward and self.sync and optimizer is not None


def _zero_rows(t):
    """A batch tensor's shape with zero rows (a new, empty tensor: it keeps no batch alive)."""
    return t.new_empty((0, *t.shape[1:])) if isinstance(t, torch.Tensor) and t.dim() else t


def _from_active_ranks(mine, group, what: str):
    """What the active ranks hold (``mine`` there, None on joined ranks), on every rank: one
    all-gather of Python objects."""
    seen = verdicts.all_gather_object(mine, group, tag=f"Join: {what}")
    return next(theirs for theirs in seen if theirs is not None)


def _options(optimizer) -> list[dict]:
    """Each param group's options, all but its parameters: what a scheduler changes."""
    return [hyperparameters(group) for group in optimizer.param_groups]


@contextlib.contextmanager
def _stepping_with(optimizer, options: list[dict]):
    """A joined rank's step takes the active ranks' options (its own scheduler stopped with its
    loop: its lr is stale); its param groups get their own back after it."""
    own = _options(optimizer)
    for group, theirs in zip(optimizer.param_groups, options):
        group.update(theirs)
    try:
        yield
    finally:
        for group, mine in zip(optimizer.param_groups, own):
            group.update(mine)


def _same(a, b) -> bool:
    (xs, spec_a), (ys, spec_b) = tree_flatten(a), tree_flatten(b)
    return spec_a == spec_b and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else bool(x == y) for x, y in zip(xs, ys))


# [Note: Join's rules] Rules a loop under ``Join`` keeps, checked on every rank (raised together, never a hang):
#
# * after every backward that reduces, the optimizer given to ``Join`` steps exactly once, before
#   the next forward or the end of the loop (a joined rank steps at that point);
# * the optimizer's options do not change between the forward and the step (a scheduler steps
#   after the step, or an lr is set before the forward, as nanoGPT does);
# * every trainable parameter is in that one optimizer (param groups for different options);
# * a forward with grad enabled is followed by its backward before the next forward (a joined
#   rank shadows it with both): evaluate under ``torch.no_grad()``, after the step. This one
#   is raised on the active ranks, before the next forward's first collective;
# * what the loop runs between backward and step that communicates (clipping by the global norm)
#   is passed as ``before_step=fn``, ``fn(model)``, so a joined rank runs it too::
#
#       clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
#       with Join([model], optimizer=opt, before_step=clip):
#           ... loss.backward(); clip(model); opt.step()
#
# * the module accepts a batch of zero rows (the shadow step's input).


def _refuse_if_broken(plan: Plan) -> None:
    if plan.broken:
        raise RuntimeError(
            "Join with minishard.ZeRO: a backward that reduced gradients was not followed by "
            "exactly one step of the optimizer given to Join before the next forward (or the "
            "end of the loop), or the optimizer's options (a scheduler's lr) changed between "
            "the forward and the step. A joined rank steps at that point, with the options "
            "of the forward, so its shard would differ: step once after every backward that "
            "reduces; accumulate with model.no_sync() (or require_backward_grad_sync = False); "
            "step the scheduler after the step or before the forward; and pass Join the "
            "optimizer the loop steps.")


def announce(engine, args, kwargs) -> None:
    """An active rank's root forward under ``Join``: tell Join this rank has not joined, and
    every rank what this step does (joined ranks shadow it)."""
    state, group = engine._join_state, engine.every_group
    if state.unanswered:  # a joined rank is in that forward's shadow backward: no collective
        raise RuntimeError(
            "Join with minishard.ZeRO: a forward with grad enabled was not followed by its "
            "backward before the next forward (an evaluation forward inside the training "
            "step, a forward whose output is not backpropagated, or two forwards into one "
            "backward). A joined rank shadows each such forward with a forward and a "
            "backward: run evaluation under torch.no_grad() after the step, and one forward "
            "per backward.")
    work = Join.notify_join_context(engine)
    if work is not None:
        work.wait()
    state.inputs = tree_map(_zero_rows, (args, kwargs))
    plan = Plan.exchange([torch.is_grad_enabled(), engine.require_backward_grad_sync,
                          state.broken(), False, False], group)
    if plan.needs_inputs:
        _from_active_ranks(state.inputs, group, "the batch's shape")
    _refuse_if_broken(plan)
    state.reset()
    state.unanswered = torch.is_grad_enabled()
    if plan.steps_joined(state.optimizer):  # a copy: a tensor lr changes in place
        state.options = copy.deepcopy(_options(state.optimizer))
        _from_active_ranks(state.options, group, "the optimizer's options")


class ZeROJoinHook(JoinHook):
    """A joined rank's side: one shadow step per iteration of the active ranks."""

    def __init__(self, engine, optimizer=None, before_step=None) -> None:
        self.engine = engine
        if getattr(engine, "_join_state", None) is not None:
            engine._join_state.detach(engine)  # a Join that raised never ran its post-hook
        _refuse_uncovered(engine, optimizer)
        self.state = state = engine._join_state = JoinState(optimizer, before_step)
        state.attach(engine)
        if optimizer is not None:
            def unchanged(opt, *_):  # joined ranks step with the options sent at the forward
                state.changed |= state.options is not None and not _same(_options(opt),
                                                                         state.options)

            def counted(*_):
                state.steps += 1
            state.hooks = (optimizer.register_step_pre_hook(unchanged),
                           optimizer.register_step_post_hook(counted))
        self.joined = False

    def main_hook(self) -> None:
        engine, state, group = self.engine, self.state, self.engine.every_group
        broken = False
        if not self.joined:  # its own last gradients were stepped: a new backward starts clean
            self.joined, broken = True, state.broken()  # (or it left its loop owing a step)
            state.reset()
            self._zero_grad()  # drops what no_sync accumulated for a step it never finished
        plan = Plan.exchange([False, False, broken, state.inputs is None, True], group)
        if plan.needs_inputs:
            state.inputs = _from_active_ranks(None, group, "the batch's shape")
        _refuse_if_broken(plan)
        options = (_from_active_ranks(None, group, "the optimizer's options")
                   if plan.steps_joined(state.optimizer) else None)
        args, kwargs = state.inputs
        sync = engine.require_backward_grad_sync
        engine._reducer.shadowing = True  # the one flag: schedule.py reads it too
        engine.require_backward_grad_sync = plan.sync
        try:
            with torch.set_grad_enabled(plan.backward):
                out = engine(*args, **kwargs)
                if plan.backward:
                    _backward_zeros(out)
        finally:
            engine._reducer.shadowing = False
            engine.require_backward_grad_sync = sync
        if plan.backward and plan.sync:
            if state.before_step is not None:
                state.before_step(engine)
            if state.optimizer is not None:
                with _stepping_with(state.optimizer, options):
                    state.optimizer.step()
            self._zero_grad()
            state.reset()

    def _zero_grad(self) -> None:
        if self.state.optimizer is not None:
            self.state.optimizer.zero_grad(set_to_none=True)
        else:
            self.engine.zero_grad(set_to_none=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the last iteration's rule, checked on every rank. Forwards
        after the block announce nothing (torch leaves a joinable's config enabled)."""
        engine, state = self.engine, self.state
        plan = Plan.exchange([False, False, state.broken(), False, False], engine.every_group)
        state.detach(engine)
        state.reset()
        engine._join_config = _JoinConfig.construct_disabled_join_config()
        _refuse_if_broken(plan)


def _refuse_uncovered(engine, optimizer) -> None:
    """Every trainable parameter is in the optimizer given to Join, the one a joined rank
    steps (on every rank, at ``Join(...)``: before any collective)."""
    if optimizer is None:
        return  # a loop that steps is refused at its first forward (no step is counted)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in engine.named_parameters()
            if p.requires_grad and id(p) not in stepped]
    if left:
        raise ValueError(
            f"Join with minishard.ZeRO: parameters {left[:3]}{' ...' if len(left) > 3 else ''}"
            " require grad but are not in the optimizer given to Join, which is the one a "
            "joined rank steps: stepped by another optimizer, its shards of them would stay "
            "behind. Put every trainable parameter in one optimizer (param groups for "
            "different options) and pass it: Join([model], optimizer=opt).")


def _backward_zeros(out) -> None:
    """Backward from an empty batch's outputs with a zero gradient for each, so every unit's
    gradient hooks fire, as on the active ranks, and every gradient is zero: what DDP's joined
    rank contributes. (Not from their sum: an output that does not depend on the batch, CLIP's
    ``logit_scale.exp()``, would send its own gradient.)"""
    leaves = [t for t in tree_flatten(out)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if leaves:
        torch.autograd.backward(leaves, [torch.zeros_like(t) for t in leaves])


# ------------------------------------------------------------- ShardedOptimizer beside DDP
_SHARDED_RULE = (
    "Join([ddp, opt], model=ddp) with a minishard.ShardedOptimizer: after every forward of "
    "the DDP model that will reduce, the optimizer steps exactly once (without a closure), "
    "after the backward and before the next forward or the end of the loop. A joined rank "
    "steps with the others whenever DDP reduces, so its parameters would differ: step once "
    "per reducing backward; accumulate under ddp.no_sync(); keep the optimizer after the "
    "model in the list of joinables.")


# ZeRO-1 over whole parameters (``ShardedOptimizer``) goes under Join in either of two ways:
# through a ``ZeRO(module, stage=0)`` model, ``Join([model], optimizer=opt)`` (the shadow step's
# reduction hands the joined rank the averaged gradient), or as a joinable of its own beside torch
# DDP, ``Join([ddp, opt], model=ddp)`` (``ShardedJoinHook`` below). Beside DDP the gradient a
# joined rank steps with has to be sent: DDP's shadow all-reduce discards it.
class ShardedJoinHook(JoinHook):
    """``Join([ddp, opt], model=ddp)`` for a ``ShardedOptimizer`` ``opt``.

    Under DDP every active rank holds the same averaged gradient after backward, but a joined
    rank's DDP hook shadows that all-reduce and discards the result, and the joined rank still
    owns parameters that must be stepped with it (stock ZeroRedundancyOptimizer steps them
    without it). So each step under Join begins with one all-reduce (MAX) of a byte per rank
    (still training?) and a byte per parameter (has a gradient?); if some rank has joined, the
    active ranks send their optimizer's options (a joined rank's scheduler stopped with its
    loop) and the first of them broadcasts the gradients of every joined rank's parameters,
    bucketed. Then each rank steps what it owns and the owners broadcast, as in any step.

    Whether a step follows is DDP's decision (``no_sync()`` accumulates): a joined rank reads
    it after DDP's hook has run, from ``model.require_forward_param_sync``. That is why the
    model is named, and why ``opt`` must come after it among the joinables. Each rank checks
    the rule this relies on (one step after each forward that reduces, before the next) at
    each forward, step and when it joins, and raises; the other ranks are then ended with it
    (torchrun stops every rank when one fails)."""

    def __init__(self, opt, model) -> None:
        from torch.nn.parallel import DistributedDataParallel
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                "Join with a minishard.ShardedOptimizer needs the DDP model it steps: "
                "Join([ddp, opt], model=ddp). A minishard.ZeRO model steps it from its own "
                f"hook instead: Join([model], optimizer=opt). Got model={type(model).__name__}.")
        self.opt, self.model = opt, model
        self.pending = False  # a forward that will reduce, not yet stepped
        self.hook = model.register_forward_hook(self._forward)  # after DDP's forward ran

    def _check(self, ok: bool = True) -> None:
        """The rules; a refusal ends this Join for the optimizer (the block ends with it)."""
        if not ok or self.opt._join_config.is_first_joinable:
            self._end()
            raise RuntimeError(_SHARDED_RULE)

    def _end(self) -> None:
        self.hook.remove()
        self.opt._join_config = _JoinConfig.construct_disabled_join_config()
        self.pending = False

    def _forward(self, module, args, out) -> None:
        if self.opt._join_config.enable:
            self._check(not self.pending)
            self.pending = torch.is_grad_enabled() and module.require_backward_grad_sync

    def before_step(self, closure) -> None:
        """An active rank's ``opt.step()`` under Join: hand the joined ranks their gradients."""
        self._check(self.pending and closure is None)
        self.pending = False
        _hand_out_gradients(self.opt, active=True)

    def main_hook(self) -> None:
        self._check(not self.pending)  # joined with a step owed: the ranks would be out of step
        if self.model.require_forward_param_sync:  # DDP's hook, before this one: it reduced
            options = _hand_out_gradients(self.opt, active=False)
            with _stepping_with(self.opt, options):
                self.opt._step_owned(None)
            self.opt.zero_grad(set_to_none=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """After the loop: the last forward was stepped too. Forwards and steps after the
        block check nothing (torch leaves a joinable's config enabled)."""
        pending = self.pending
        self._end()
        self._check(not pending)


def _hand_out_gradients(opt, active: bool) -> list[dict] | None:
    """The step's exchange under Join (see ShardedJoinHook): joined ranks receive the averaged
    gradients of the parameters joined ranks own, from the first active rank, and the active
    ranks' options (returned; None while no rank has joined)."""
    n = opt.world_size
    if n == 1:
        return None
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    flags = torch.zeros(n + len(params), dtype=torch.uint8)
    if active:
        flags[opt.rank] = 1
        flags[n:] = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    comm.all_reduce(flags, "max", opt.process_group, tag="Join: who trains, which gradients")
    training, present = flags[:n].tolist(), flags[n:].tolist()
    if all(training):
        return None
    options = _from_active_ranks(_options(opt) if active else None, opt.process_group,
                                 "the optimizer's options")
    src = training.index(1)
    sent = [p for p, has in zip(params, present) if not training[opt.owner[p]] and has]
    if not active:
        for p, has in zip(params, present):
            if not training[opt.owner[p]]:
                p.grad = torch.empty_like(p) if has else None
    opt._broadcast([(src, bucket) for bucket in opt._split([p.grad for p in sent])],
                   tag=f"Join: rank {src}'s gradients for the joined ranks' parameters")
    return options
