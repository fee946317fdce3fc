"""Uneven inputs: torch's ``Join`` for a ZeRO model, when ranks have different numbers of batches.

    from torch.distributed.algorithms.join import Join
    with Join([model], optimizer=opt):       # the optimizer the loop steps
        for x, y in my_batches:              # this rank's: another rank may have more, or none
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

Every rank must issue the same collectives in the same order. A rank that has run out of batches
(it has *joined*) cannot just wait: at stages 1-3 it owns a shard of every parameter, gradient
and optimizer state, and the others' gathers and reductions need it. torch's ``Join`` runs, on a
joined rank, a loop of one all-reduce counting the ranks still training (they join it at the
start of each forward: ``Join.notify_join_context``); while any are, it calls our
``main_hook``, which must issue exactly the collectives one of their iterations issues.

**A shadow step is a real step on an empty batch.** The hook runs the model's forward, and its
backward, on the last batch shape this rank saw cut to zero rows. So it issues what the engine
issues for any batch, in the same order, with no list to keep in step with the engine: gathers,
prefetch, buckets, lazy re-gathers, SyncBatchNorm's all-reduces (an empty rank contributes a
count of 0), the reductions and find_unused's bitmap (where it reports no unit used). An empty batch has zero gradients, and
the reductions average over every rank of the engine, joined ones included: the gradient is the
active ranks' sum over the INITIAL world size, as DDP computes it under ``Join``. Then, as the
others do, the hook steps the optimizer given to ``Join`` (and zeroes its gradients): the
joined rank's shard, momentum and Adam state move with everyone's. DDP has nothing to step
(each rank holds everything; its post-hook broadcasts the final weights); stock
ZeroRedundancyOptimizer steps its shard without the averaged gradient, and ends wrong.

**What the others are about to do** reaches the joined ranks in one more all-reduce (MAX) at
each forward of the active ranks, a ``Plan``: will a backward follow (training, or an evaluation
under ``torch.no_grad()``)? will it reduce (``no_sync()`` accumulates without communication)?
Rules a loop under ``Join`` keeps, checked on every rank (raised together, never a hang):

* after every backward that reduces, the optimizer given to ``Join`` steps exactly once, before
  the next forward (a joined rank steps at that point);
* what the loop runs between backward and step that communicates (clipping by the global norm)
  is passed as ``before_step=fn``, ``fn(model)``, so a joined rank runs it too::

      clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
      with Join([model], optimizer=opt, before_step=clip):
          ... loss.backward(); clip(model); opt.step()

* the module accepts a batch of zero rows (the shadow step's input).

**ZeRO-1 over whole parameters** (``ShardedOptimizer``) goes under Join in either of two ways:
through a ``ZeRO(module, stage=0)`` model, ``Join([model], optimizer=opt)`` (the shadow step's
reduction hands the joined rank the averaged gradient), or as a joinable of its own beside torch
DDP, ``Join([ddp, opt], model=ddp)`` (``ShardedJoinHook`` below). Beside DDP the gradient a
joined rank steps with has to be sent: DDP's shadow all-reduce discards it.

A rank with no batch at all has no shape to cut: its first plan asks, and the active ranks send
theirs (one all-gather of Python objects, once).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.utils._pytree import tree_flatten, tree_map

from minishard import comm

__all__ = ["JoinState", "announce", "ZeROJoinHook", "ShardedJoinHook"]


@dataclasses.dataclass
class JoinState:
    """One engine's bookkeeping under ``Join``."""
    optimizer: torch.optim.Optimizer | None = None
    before_step: object = None      # fn(model), run by a joined rank before its step
    inputs: tuple | None = None     # (args, kwargs) of the last forward, cut to zero rows
    synced: int = 0                 # backwards that reduced, since Join began
    steps: int = 0                  # optimizer steps, since Join began
    hook: object = None             # the optimizer's step hook (removed by the post-hook)


@dataclasses.dataclass
class Plan:
    """What the active ranks' step does, as every rank learns it (MAX over ranks)."""
    backward: bool     # grad is enabled: a backward follows the forward
    sync: bool         # that backward reduces
    broken: bool       # some active rank reduced without stepping once since (the rules)
    needs_inputs: bool  # a joined rank has never seen a batch: send it the shape

    @staticmethod
    def exchange(mine: list[bool], group) -> "Plan":
        flags = torch.tensor(mine, dtype=torch.uint8)
        comm.all_reduce(flags, "max", group, tag="Join: what this step does")
        return Plan(*map(bool, flags.tolist()))


def _zero_rows(t):
    """A batch tensor's shape with zero rows (a new, empty tensor: it keeps no batch alive)."""
    return t.new_empty((0, *t.shape[1:])) if isinstance(t, torch.Tensor) and t.dim() else t


def _inputs_everywhere(engine, mine) -> tuple:
    """The active ranks' inputs cut to zero rows, to a joined rank that never saw a batch."""
    seen = comm.all_gather_object(mine, engine.every_group, tag="Join: the batch's shape")
    return next(inputs for inputs in seen if inputs is not None)


def _refuse_if_broken(plan: Plan) -> None:
    if plan.broken:
        raise RuntimeError(
            "Join with minishard.ZeRO: a backward that reduced gradients was not followed by "
            "exactly one step of the optimizer given to Join before the next forward (or the "
            "end of the loop). A joined rank steps at that point, so its shard would differ: "
            "step once after every backward that reduces; accumulate with model.no_sync() (or "
            "require_backward_grad_sync = False), and pass Join the optimizer the loop steps.")


def announce(engine, args, kwargs) -> None:
    """An active rank's root forward under ``Join``: tell Join this rank has not joined, and
    every rank what this step does (joined ranks shadow it)."""
    work = Join.notify_join_context(engine)
    if work is not None:
        work.wait()
    state = engine._join_state
    state.inputs = tree_map(_zero_rows, (args, kwargs))
    plan = Plan.exchange([torch.is_grad_enabled(), engine.require_backward_grad_sync,
                          state.synced != state.steps, False], engine.every_group)
    if plan.needs_inputs:
        _inputs_everywhere(engine, state.inputs)
    _refuse_if_broken(plan)
    state.synced, state.steps = 0, 0


class ZeROJoinHook(JoinHook):
    """A joined rank's side: one shadow step per iteration of the active ranks."""

    def __init__(self, engine, optimizer=None, before_step=None) -> None:
        self.engine, self.state = engine, engine._join_state
        self.state.optimizer, self.state.before_step = optimizer, before_step
        self.state.synced = self.state.steps = 0
        if optimizer is not None:
            def counted(*_):
                self.state.steps += 1
            self.state.hook = optimizer.register_step_post_hook(counted)
        self.joined = False

    def main_hook(self) -> None:
        engine, state = self.engine, self.state
        if not self.joined:  # its own last gradients were stepped: a new backward starts clean
            self.joined = True
            state.synced = state.steps = 0
            self._zero_grad()
        plan = Plan.exchange([False, False, False, state.inputs is None], engine.every_group)
        if plan.needs_inputs:
            state.inputs = _inputs_everywhere(engine, state.inputs)
        _refuse_if_broken(plan)
        args, kwargs = state.inputs
        sync = engine.require_backward_grad_sync
        engine._reducer.shadowing = True  # the one flag: zero.py reads it too
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
                state.optimizer.step()
            self._zero_grad()
            state.synced = state.steps = 0

    def _zero_grad(self) -> None:
        if self.state.optimizer is not None:
            self.state.optimizer.zero_grad(set_to_none=True)
        else:
            self.engine.zero_grad(set_to_none=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the last iteration's rule, checked on every rank. Forwards
        after the block announce nothing (torch leaves a joinable's config enabled)."""
        engine, state = self.engine, self.state
        plan = Plan.exchange([False, False, state.synced != state.steps, False],
                             engine.every_group)
        if state.hook is not None:
            state.hook.remove()
        state.synced = state.steps = 0
        engine._join_config = _JoinConfig.construct_disabled_join_config()
        _refuse_if_broken(plan)


def _backward_zeros(out) -> None:
    """Backward from an empty batch's outputs: their sum (zero), so every unit's gradient
    hooks fire, as on the active ranks, with zero gradients."""
    leaves = [t for t in tree_flatten(out)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if leaves:
        torch.autograd.backward([t.sum() for t in leaves])


# ------------------------------------------------------------- ShardedOptimizer beside DDP
_SHARDED_RULE = (
    "Join([ddp, opt], model=ddp) with a minishard.ShardedOptimizer: after every forward of "
    "the DDP model that will reduce, the optimizer steps exactly once (without a closure), "
    "before the next forward. A joined rank steps with the others whenever DDP reduces, so "
    "its parameters would differ: step once per reducing backward; accumulate under "
    "ddp.no_sync(); keep the optimizer after the model in the list of joinables.")


class ShardedJoinHook(JoinHook):
    """``Join([ddp, opt], model=ddp)`` for a ``ShardedOptimizer`` ``opt``.

    Under DDP every active rank holds the same averaged gradient after backward, but a joined
    rank's DDP hook shadows that all-reduce and discards the result, and the joined rank still
    owns parameters that must be stepped with it (stock ZeroRedundancyOptimizer steps them
    without it). So each step under Join begins with one all-reduce (MAX) of a byte per rank
    (still training?) and a byte per parameter (has a gradient?); if some rank has joined, the
    first active rank broadcasts the gradients of every joined rank's parameters, bucketed.
    Then each rank steps what it owns and the owners broadcast, as in any step.

    Whether a step follows is DDP's decision (``no_sync()`` accumulates): a joined rank reads
    it after DDP's hook has run, from ``model.require_forward_param_sync``. That is why the
    model is named, and why ``opt`` must come after it among the joinables. The active ranks
    check the rule this relies on (one step per reducing forward) at each forward and step,
    before DDP's collectives, and raise; a joined rank is then ended with them (torchrun
    stops every rank when one fails)."""

    def __init__(self, opt, model) -> None:
        from torch.nn.parallel import DistributedDataParallel
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                "Join with a minishard.ShardedOptimizer needs the DDP model it steps: "
                "Join([ddp, opt], model=ddp). A minishard.ZeRO model steps it from its own "
                f"hook instead: Join([model], optimizer=opt). Got model={type(model).__name__}.")
        self.opt, self.model = opt, model
        self.pending = False  # an active rank: a forward that will reduce, not yet stepped
        self.hook = model.register_forward_pre_hook(self._forward)

    def _check(self, ok: bool = True) -> None:
        """The rules; a refusal ends this Join for the optimizer (the block ends with it)."""
        if not ok or self.opt._join_config.is_first_joinable:
            self._end()
            raise RuntimeError(_SHARDED_RULE)

    def _end(self) -> None:
        self.hook.remove()
        self.opt._join_config = _JoinConfig.construct_disabled_join_config()
        self.pending = False

    def _forward(self, module, args) -> None:
        if self.opt._join_config.enable:
            self._check(not self.pending)
            self.pending = torch.is_grad_enabled() and module.require_backward_grad_sync

    def before_step(self, closure) -> None:
        """An active rank's ``opt.step()`` under Join: hand the joined ranks their gradients."""
        self._check(self.pending and closure is None)
        self.pending = False
        _hand_out_gradients(self.opt, active=True)

    def main_hook(self) -> None:
        self._check()
        if self.model.require_forward_param_sync:  # DDP's hook, before this one: it reduced
            _hand_out_gradients(self.opt, active=False)
            self.opt._step_owned(None)
            self.opt.zero_grad(set_to_none=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """After the loop: the last forward was stepped too. Forwards and steps after the
        block check nothing (torch leaves a joinable's config enabled)."""
        pending = self.pending
        self._end()
        self._check(not pending)


def _hand_out_gradients(opt, active: bool) -> None:
    """The step's exchange under Join (see ShardedJoinHook): joined ranks receive the averaged
    gradients of the parameters joined ranks own, from the first active rank."""
    n = opt.world_size
    if n == 1:
        return
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    flags = torch.zeros(n + len(params), dtype=torch.uint8)
    if active:
        flags[opt.rank] = 1
        flags[n:] = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    comm.all_reduce(flags, "max", opt.process_group, tag="Join: who trains, which gradients")
    training, present = flags[:n].tolist(), flags[n:].tolist()
    if all(training):
        return
    src = training.index(1)
    sent = [p for p, has in zip(params, present) if not training[opt.owner[p]] and has]
    if not active:
        for p, has in zip(params, present):
            if not training[opt.owner[p]]:
                p.grad = torch.empty_like(p) if has else None
    opt._broadcast([(src, bucket) for bucket in opt._split([p.grad for p in sent])],
                   tag=f"Join: rank {src}'s gradients for the joined ranks' parameters")
