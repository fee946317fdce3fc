"""Mutation check: swap known-wrong variants into a copy of the engine and show the suite fails.

    python tests/mutants.py                 # every mutant, every test listed for it
    python tests/mutants.py sum_not_avg     # one mutant
    python tests/mutants.py --first         # stop each mutant at its first killing test

Each mutant is a textual patch of minishard's source (the exact text must occur once: the test
``test_mutation_script.py`` checks that, so a refactor cannot make a mutant silently inapplicable).
The patched package is copied, with the tests, into a temporary directory and the tests listed
for the mutant run there (the ci profile's examples, not shrunk) in a fresh pytest, so the warm ranks import the mutant too.
A mutant must be KILLED: at least one of its tests fails. Exit status 1 if any mutant survives.
Run it under the shared lock (it starts ranks): flock /tmp/minishard.lock python tests/mutants.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (what is wrong, [(file, exact source text, replacement)], [pytest selections])
MUTANTS = {
    "sum_not_avg": (
        "gradients SUMMED over ranks instead of averaged",
        [("minishard/zero/flat.py", 'comm.all_reduce(out, "avg",', 'comm.all_reduce(out, "sum",'),
         ("minishard/zero/flat.py", 'comm.reduce_scatter(out, send.reshape(-1), "avg",',
          'comm.reduce_scatter(out, send.reshape(-1), "sum",')],
        ["tests/test_training.py::test_bf16_matches_fsdp1_and_fsdp2_and_tracks_fp32",
         "tests/test_differential.py"]),
    "clip_without_min": (
        "clip_grad_norm_ scales by max_norm/norm even when the norm is below max_norm",
        [("minishard/zero/schedule.py", "clip = (max_norm / (total + 1e-6)).clamp(max=1.0)",
          "clip = max_norm / (total + 1e-6)")],
        ["tests/test_training.py::test_clip_grad_norm_matches_torch_on_the_unsharded_model"]),
    "zero_grads_for_unused": (
        "a flat buffer no rank used gets a zero gradient (Adam, momentum, decay then move it)",
        [("minishard/zero/schedule.py", "if flat.requires_grad and flat.full.grad is not None:",
          "if flat.requires_grad:")],
        ["tests/test_differential.py"]),
    "ledger_without_(N-1)/N": (
        "the ledger's ring cost model forgets the (N-1)/N factor",
        [("minishard/costs.py",
          "return Fraction(_RING_FACTOR[op] * (group_size - 1) * full_bytes, group_size)",
          "return Fraction(_RING_FACTOR[op] * full_bytes, 1)")],
        ["tests/test_training.py::"
         "test_bf16_ledger_gathers_half_the_bytes_and_reduces_in_reduce_dtype",
         "tests/test_zero.py::test_ledger_one_step_is_the_stage_formula"]),
    "master_rounded_to_bf16": (
        "the fp32 master shard is rounded to the compute dtype at every gather",
        [("minishard/zero/flat.py", "[f.shard] if f.shard is not None else",
          "[f.shard.copy_(f.shard.to(f.param_dtype))] if f.shard is not None else")],
        ["tests/test_training.py::test_bf16_matches_fsdp1_and_fsdp2_and_tracks_fp32"]),
    "syncbn_second_pass_only_when_all_cancel": (
        "SyncBatchNorm's centred second pass taken when ALL channels cancel instead of ANY",
        [("minishard/syncbn.py", "if bool((bound * Q > M2).any()):",
          "if bool((bound * Q > M2).all()):")],
        ["tests/test_syncbn.py::test_one_cancelling_channel_takes_the_second_pass"]),
    "strided_tensor_sent_in_storage_order": (
        "a strided tensor handed to the backend as it is (a transposed buffer arrives scrambled)",
        [("minishard/comm.py", '    dense = tensor.contiguous()\n    room = SUM_STAMP_NUMEL',
          '    dense = tensor\n    room = SUM_STAMP_NUMEL'),
         ("minishard/comm.py", "    out, shard = output.contiguous(), shard.contiguous()",
          "    out = output"),
         ("minishard/comm.py", "    mine, full = shard.contiguous(), full.contiguous()",
          "    mine = shard"),
         ("minishard/comm.py", '    dense = tensor.contiguous()\n    flown = _before("broadcast"',
          '    dense = tensor\n    flown = _before("broadcast"'),
         ("minishard/comm.py",
          '    assert tensor.is_contiguous(), f"comm.{op}: a strided tensor reached the backend"\n',
          "")],
        ["tests/test_contiguous.py"]),
    "freeze_prefix_siblings": (
        "unit 'b' also owns module 'b2' (a name prefix, not a path prefix)",
        [("minishard/zero/unit.py", 'name == scope or name.startswith(scope + ".")',
          "name == scope or name.startswith(scope)")],
        ["tests/test_freeze_siblings.py::test_a_unit_does_not_own_its_prefix_siblings"]),
    "from_rank0_skips_buffers": (
        "load_full_state_dict(from_rank0=True) loads parameters but never broadcasts buffers",
        [("minishard/checkpoint/full_state.py",
          'comm.broadcast(value, 0, every, tag=f"{name} (from rank 0)")', "pass")],
        ["tests/test_contiguous.py::test_load_full_state_dict_from_rank0_with_a_transposed_tensor",
         "tests/test_rank0.py"]),
    "find_unused_zero_grads_for_unused_by_all": (
        "find_unused_parameters: a unit NO rank used keeps the zeros reduced into it as its grad",
        [("minishard/zero/schedule.py", "                    p.grad = grad", "                    pass")],
        ["tests/test_unused_by_all.py"]),
    "checkpoint_keeps_current_hyperparameters": (
        "load_checkpoint keeps the optimizer's current hyperparameters instead of the saved groups'",
        [("minishard/checkpoint/state.py", '            ({k: v for k, v in saved.items() if k != "names"},',
          '            ({k: v for k, v in group.items() if k != "params"},')],
        ["tests/test_state.py::test_param_groups_by_dim_survive_a_checkpoint_and_the_export"]),
    "deferred_init_on_global_rank_0": (
        "deferred init runs the initialiser on global rank 0, not the group's rank 0 (a group "
        "without global rank 0 then broadcasts uninitialised memory)",
        [("minishard/zero/deferred_init.py", "        if comm.group_rank(group) == 0:",
          "        if torch.distributed.get_rank() == 0:")],
        ["tests/test_deferred_init.py::test_deferred_init_on_a_group_without_global_rank_0"]),
    "deferred_init_allocations_not_nan": (
        "storage an initialiser allocates holds whatever memory held (an allocate-only "
        "param_init_fn trains on garbage)",
        [("minishard/zero/deferred_init.py", '            out.fill_(float("nan"))', "            pass")],
        ["tests/test_deferred_init.py::test_unwritten_meta_tensor_is_an_error_on_every_rank"]),
    "find_unused_launches_during_backward": (
        "find_unused_parameters: reductions launched as they become ready (ranks that ran "
        "different branches then deadlock against SyncBatchNorm's backward all-reduce)",
        [("minishard/zero/schedule.py",
          "                self._used.add(id(flat))",
          "                self._used.add(id(flat))\n            self._schedule(flat)")],
        ["tests/test_unused_branch_syncbn.py"]),
    "export_copies_on_every_rank": (
        "full_state_dict(rank0_only=True) copies every full tensor out on the other ranks too",
        [("minishard/checkpoint/full_state.py", "    if not keep:\n        return None\n    return [_unpad(",
          "    return [_unpad(")],
        ["tests/test_memory_wall.py::test_rank0_only_export_holds_two_units_on_the_other_ranks"]),
    "staging_per_unit": (
        "every gather of an export or a load allocates its own staging rows, not a view of one",
        [("minishard/checkpoint/full_state.py", "        return self._bytes[:nbytes].view(dtype).view(shape)",
          "        return self._bytes.new_empty(nbytes).view(dtype).view(shape)")],
        ["tests/test_memory_wall.py::test_rank0_only_export_holds_two_units_on_the_other_ranks",
         "tests/test_memory_wall.py::test_load_from_rank0_holds_one_staging_buffer_and_the_regathers"]),
    "reduction_launched_before_the_oldest_is_waited": (
        "stages 2-3 launch a reduction before waiting for the oldest: three in flight, not two",
        [("minishard/zero/schedule.py",
          "        while self.free_grads_early and len(self._in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:",
          "        while self.free_grads_early and len(self._in_flight) > MAX_REDUCTIONS_IN_FLIGHT:")],
        ["tests/test_memory_wall.py::test_at_most_two_reductions_hold_their_buffers",
         "tests/test_memory_wall.py::test_a_training_step_allocates_no_more_than_the_formula"]),
    "param_groups_compared_as_sets": (
        "a checkpoint's param groups compared as sets: [no_decay, decay] loads [decay, no_decay]'s"
        " settings into the wrong groups",
        [("minishard/checkpoint/state.py", "    if groups != saved_groups:",
          "    if sorted(map(sorted, groups)) != sorted(map(sorted, saved_groups)):")],
        ["tests/test_state.py::test_groups_in_another_order_are_refused_not_swapped"]),
    "backward_bucket_in_forward_order": (
        "a stage-3 backward bucket built in forward order: units gathered long before they run",
        [("minishard/zero/schedule.py", "else self.order[:i][::-1]", "else self.order[:i]")],
        ["tests/test_bucket_order.py"]),
    "fp32_statistics_only_for_batchnorm2d": (
        "buffer_dtype keeps only BatchNorm2d's running statistics in fp32, not BatchNorm1d/3d's",
        [("minishard/zero/config.py", "        if isinstance(m, nn.modules.batchnorm._BatchNorm):",
          "        if isinstance(m, nn.BatchNorm2d):")],
        ["tests/test_mixed_batchnorm.py"]),
    "batchnorm_weights_cast_to_param_dtype": (
        "mixed precision casts a BatchNorm's weight and bias to param_dtype like any layer's",
        [("minishard/zero/build.py", "        compute = None if batch_norm or not p.dtype.is_floating_point",
          "        compute = None if not p.dtype.is_floating_point")],
        ["tests/test_mixed_batchnorm.py"]),
    "unknown_op_summed": (
        "comm.all_reduce sums for an op it does not know (a typo, \"mean\")",
        [("minishard/comm.py", "    if op not in OPS or (op == \"avg\"", "    if (op == \"avg\""),
         ("minishard/comm.py", "    return OPS[op]\n", "    return OPS.get(op, OPS[\"sum\"])\n")],
        ["tests/test_comm_ops.py"]),
    "marked_wrapped_before_materialising": (
        "modules marked wrapped before their deferred init ran: a failed init cannot be retried",
        [("minishard/zero/build.py", "        built.append(unit)",
          "        unit.module._minishard_unit = unit.name\n        built.append(unit)")],
        ["tests/test_wrap_retry_and_events.py::test_a_failed_deferred_init_can_be_wrapped_again"]),
    "backward_logged_per_output": (
        "a unit returning several tensors logs \"backward\" once per tensor",
        [("minishard/zero/meters.py",
          'elif event == "backward" and unit.name not in self._backward_logged:',
          'elif event == "backward":')],
        ["tests/test_wrap_retry_and_events.py::test_a_unit_with_two_outputs_logs_one_backward"]),
    "trace_clock_shift_in_ms": (
        "trace.py shifts each rank's clock by wall nanoseconds / 1e6 instead of / 1000 (us)",
        [("minishard/observe/trace.py", "_shifted(e, (wall - origin) / 1000)",
          "_shifted(e, (wall - origin) / 1e6)")],
        ["tests/test_trace.py::test_one_collective_ends_at_the_same_time_on_every_rank"]),
    "dcp_digests_not_checked": (
        "a DCP load skips the sha256 digests minishard saved beside it: corrupted bytes load",
        [("minishard/checkpoint/dcp.py",
          "        check_dcp_digests(path, metadata, (comm.group_rank(group), comm.group_size(group)))",
          "        pass")],
        ["tests/test_dcp.py::test_a_byte_changed_in_a_dcp_data_file_is_caught"]),
    "dcp_keeps_current_hyperparameters": (
        "a DCP checkpoint's param groups are read but the optimizer keeps its own lr, betas, ...",
        [("minishard/checkpoint/dcp.py",
          "        loaded.append((saved, states))",
          "        loaded.append((hyperparameters(group), states))")],
        ["tests/test_dcp.py::test_fsdp2_checkpoint_loads_into_minishard_at_another_world_size"]),
    "replicated_scalar_gradient_on_rank0_only": (
        "a 0-dim parameter's gradient column is not copied to every rank before the "
        "reduce-scatter: only rank 0 receives its average, the others step it with zero",
        [("minishard/zero/flat.py",
          "            send[1:, start + flat.offsets[j]] = send[0, start + flat.offsets[j]]",
          "            pass")],
        ["tests/test_your_parameters.py::test_the_parameters_stay_the_users",
         "tests/test_torch_tools.py::test_torch_clip_on_model_parameters_equals_one_process"]),
    "torch_clip_unseen_by_the_ledger": (
        "the collectives DTensor runs for torch's clip_grad_norm_ are not recorded (ledger, "
        "flight record): the watcher passes them through unseen",
        [("minishard/zero/params.py", """            comm.record(op, tensor.numel() * (n if gathered else 1), tensor.dtype, n,
                        f"torch {op}", group=group)""", "            pass")],
        ["tests/test_torch_tools.py::test_torch_clip_on_model_parameters_equals_one_process",
         "tests/test_hangs.py::test_dtensor_collectives_for_torch_tools_are_recorded"]),
    "replicated_gradient_averaged_over_the_shard_group": (
        "on a 2-D mesh a replicated parameter's gradient is averaged inside its shard group "
        "only: each replica steps it with its own mean",
        [("minishard/zero/build.py", "flat = FlatBuffer(layout, groups.every if replicated else "
          "groups.shard,", "flat = FlatBuffer(layout, groups.shard,")],
        ["tests/test_replicated.py::"
         "test_training_with_replicated_parameters_equals_one_process"]),
    "replicated_gradient_counted_by_every_rank_in_model_clip": (
        "model.clip_grad_norm_ adds a replicated gradient's |g|^p on every rank of the group",
        [("minishard/zero/unit.py", "if p.grad is not None and (lead or not owned or not "
          "flat.is_replicated(j))]", "if p.grad is not None]")],
        ["tests/test_replicated.py::test_model_clip_counts_a_replicated_gradient_once"]),
    "joined_rank_skips_its_step": (
        "under Join a joined rank shadows the collectives but never steps its shard",
        [("minishard/join.py", "                state.optimizer.step()",
          "                pass")],
        ["tests/test_join.py::test_join_equals_ddp_under_join"]),
    "joined_rank_replays_its_last_batch": (
        "under Join a joined rank shadows with its last real batch instead of an empty one: its "
        "gradient and statistics count again",
        [("minishard/join.py", "    return t.new_empty((0, *t.shape[1:])) if isinstance(t, "
          "torch.Tensor) and t.dim() else t", "    return t")],
        # its backward sends zeros either way: the batch counts again in SyncBatchNorm's statistics
        ["tests/test_join.py::test_syncbatchnorm_under_join_equals_one_process",
         "tests/test_join.py::test_join_equals_ddp_under_join"]),
    "joined_rank_reports_usage": (
        "find_unused_parameters under Join: a joined rank's empty batch marks what it ran as "
        "used, so a branch no active rank took gets zero gradients and Adam moves it",
        [("minishard/zero/schedule.py", "            if not self.shadowing:  # a joined rank's",
          "            if True:  # a joined rank's")],
        ["tests/test_join.py::test_a_branch_only_the_joined_rank_takes_stays_unused"]),
    "joined_owner_steps_without_the_averaged_gradient": (
        "ShardedOptimizer beside DDP under Join: a joined rank steps what it owns with its own "
        "stale gradient, as torch's ZeroRedundancyOptimizer does",
        [("minishard/join.py", "    if all(training):", "    if True:")],
        ["tests/test_join.py::test_sharded_optimizer_under_join_equals_ddp_with_a_plain_optimizer"]),
    "joined_rank_steps_with_its_stale_lr": (
        "under Join a joined rank steps with its own options, frozen when its loop (and its "
        "scheduler) stopped, instead of the active ranks'",
        [("minishard/join.py", "        group.update(theirs)", "        pass")],
        ["tests/test_join.py::test_join_equals_ddp_under_join",
         "tests/test_join.py::test_sharded_optimizer_under_join_equals_ddp_with_a_plain_optimizer"]),
    "full_kept_current_between_steps": (
        "stages 1-2 keep the full parameters marked current when the shards go back to the "
        "user: a foreach step or an edit through .data is never gathered",
        [("minishard/zero/unit.py", "            if not keep_current:\n                flat.current = False",
          "            if not keep_current:\n                pass")],
        ["tests/test_writes.py::test_foreach_and_fused_optimizers_train_as_one_process"]),
    "optimizer_state_of_the_whole_kept": (
        "an optimizer whose state was loaded before wrapping keeps it for the WHOLE parameter "
        "(nanoGPT's resume): its step mixes full-shaped moments with this rank's rows",
        [("minishard/zero/guards.py",
          "            problem = _keep_state_rows(optimizer.state.get(p), p,\n"
          "                                       f\"group {len(groups_seen)} parameter {i}\", held) or problem",
          "            pass")],
        ["tests/test_your_parameters.py::test_nanogpt_resume_loads_the_optimizer_before_wrapping"]),
    "reductions_combined_by_size_alone": (
        "the messages of gloo's reduce-scatter carry no stamp: ranks reducing different units "
        "of one size average them",
        [("minishard/comm.py", "    said = _EXCHANGE_TAG << 24 | zlib.crc32(tag.encode()) & 0xFFFFFF  # checks.py: stamps",
          "    said = _EXCHANGE_TAG << 24")],
        ["tests/test_stamps.py::test_reductions_of_different_units_are_never_combined"]),
    "all_reduced_sums_unchecked": (
        "stage 0's all-reduce carries its stamp but no rank checks it: ranks averaging "
        "different units of one size deliver the mix",
        [("minishard/checks.py", "    if not torch.equal(tail, sum_stamp(",
          "    if False and torch.equal(tail, sum_stamp(")],
        ["tests/test_stamps.py::test_all_reduces_of_different_units_raise_on_every_rank"]),
    "allocations_count_a_dtensor_whole": (
        "Allocations counts a DTensor by its own storage, which claims the global size",
        [("minishard/observe/allocations.py", "        if is_traceable_wrapper_subclass(t):",
          "        if False:")],
        ["tests/test_memory_wall.py::test_a_dtensor_counts_the_rows_this_rank_holds"]),
    "plan_held_at_rest_as_if_gathered": (
        "the planner counts stage 3's full buffers as held at rest (the engine frees them)",
        [("minishard/observe/predict.py", "        return shard + (0 if reshard and self.mode is "
          "FlatMode.OWN else self.full_bytes)", "        return shard + self.full_bytes")],
        ["tests/test_predict.py::test_the_plan_is_the_engine_buffer_by_buffer"]),
    "dry_run_skips_the_gloo_paths": (
        "a dry run takes the flat collectives' paths (not gloo's, whose buffers it must count)",
        [("minishard/observe/dry_run.py", "    worlds[mirror] = (Mirror.stands_for, worlds[mirror][1])",
          "    pass  # ")],
        ["tests/test_predict.py::test_a_dry_run_predicts_every_ranks_peak_within_5_percent"]),
    "dry_run_gathers_garbage": (
        "a dry run's all-gather by broadcasts leaves the other ranks' rows as they were",
        [("minishard/observe/dry_run.py", "                t.copy_(mine)", "                pass")],
        ["tests/test_predict.py::test_a_dry_run_predicts_every_ranks_peak_within_5_percent"]),
    "dry_runs_apart": (
        "every rank's dry run timed at once, but each at its own pace (predictions' time)",
        [("minishard/observe/dry_run.py", "        if self.together is not None:  # every rank's",
          "        if False:  # every rank's")],
        ["tests/test_predict.py::test_dry_runs_together_step_together"]),
    "on_its_own_wire_nothing_waits": (
        "a link of its own: the computation never waits for a collective",
        [("minishard/observe/predict.py", "        if landed > now:  # blocked until then",
          "        if False:  # blocked until then")],
        ["tests/test_predict.py::test_a_timeline_by_hand"]),
    "dtensor_shards_of_another_cut_loaded": (
        "a state dict of one rank's DTensor shards loaded at another world size or stage: "
        "torch's raw mesh error, not the way forward",
        [("minishard/zero/guards.py", "            if isinstance(value, DTensor) and _cut(value) != _cut(p):",
          "            if False:")],
        ["tests/test_errors.py::test_dtensor_shards_load_only_as_they_were_cut"]),
    "optimizer_built_before_steps_the_originals": (
        "an optimizer built before wrapping keeps stepping the parameters wrapping replaced: "
        "the model trains nothing (FSDP2's behaviour)",
        [("minishard/zero/guards.py", "                group[\"params\"][i] = successor()",
          "                continue")],
        ["tests/test_zero.py::test_optimizer_built_before_wrapping_trains"]),
    "flight_not_dumped_on_failure": (
        "a failed collective raises without writing the flight record: the doctor has nothing",
        [("minishard/checks.py", '    note = FLIGHT.on_failure(str(error)) if FLIGHT.on_failure '
          'is not None else ""', '    note = ""')],
        ["tests/test_tutorials.py::test_tutorial_at_every_world_size[15_when_it_hangs.py-2]"]),
    "doctor_blind_to_the_backward_pass": (
        "the doctor never sees ranks a backward pass apart: no_sync on a rank that then left "
        "the loop reads as uneven inputs",
        [("minishard/observe/records.py", "        if len(set(at.values())) > 1:",
          "        if False:")],
        ["tests/test_tutorials.py::test_tutorial_at_every_world_size[15_when_it_hangs.py-2]"]),
    "dtensor_collectives_counted_apart": (
        "the flight record counts the collectives DTensor runs apart from comm's on the same "
        "group (comm passes None, DTensor the group): the doctor lines up a norm on rank 0 "
        "against the other rank's first collective",
        [("minishard/checks.py", "        stream = self.streams.setdefault(identity, [0, identity])",
          "        stream = [0, identity]")],
        ["tests/test_hangs.py::test_dtensor_collectives_for_torch_tools_are_recorded",
         "tests/test_tutorials.py::test_tutorial_at_every_world_size[15_when_it_hangs.py-2]"]),
    "doctor_reads_the_oldest_job": (
        "of the jobs a directory holds the doctor reads the one written first",
        [("minishard/observe/records.py", 'newest = max(everyone, key=lambda r: r["written"])',
          'newest = min(everyone, key=lambda r: r["written"])')],
        ["tests/test_hangs.py::test_two_launches_into_one_directory"]),
    "dry_run_in_the_flight_record": (
        "a dry run's collectives and world join the process's flight record, and arm it",
        [("minishard/observe/dry_run.py", "    with comm.FLIGHT.kept_apart():",
          "    with contextlib.nullcontext():")],
        ["tests/test_hangs.py::test_two_launches_into_one_directory"]),
    "ring_anchored_at_the_oldest_entry": (
        "the doctor lines rings up from the oldest entry any rank holds: a rank whose ring "
        "dropped it looks like one whose stream ended",
        [("minishard/observe/records.py", "    begin = max(min(rows) if rows else issued + 1",
          "    begin = min(min(rows) if rows else issued + 1")],
        ["tests/test_hangs.py::test_a_ring_that_dropped_its_oldest_entries"]),
    "failure_record_overwritten_at_exit": (
        "a rank that a failed collective ended writes its record again at exit, over the one "
        "its failure wrote",
        [("minishard/observe/flight.py", '    if "failed" in _armed:  # the failure',
          "    if False:  # the failure")],
        ["tests/test_tutorials.py::test_tutorial_at_every_world_size[15_when_it_hangs.py-2]"]),
    "failed_rank_waits_for_gloo_at_exit": (
        "a rank that a failed collective ended finalizes as usual: gloo's destructor waits for "
        "its thread, stuck in that collective, and the rank it waited for (in torch's own wait: "
        "a norm on rank 0) never learns it is gone",
        [("minishard/observe/flight.py", '    if "failed" in _armed and error is not None:',
          "    if False:")],
        ["tests/test_tutorials.py::test_tutorial_at_every_world_size[15_when_it_hangs.py-2]"]),
    "signals_wait_for_the_main_thread": (
        "a signal's record is written by the main thread's handler: a rank waiting inside a "
        "collective writes nothing until the timeout",
        [("minishard/observe/flight.py", "    if before == -1 and ours:", "    if False:")],
        ["tests/test_hangs.py::test_a_job_stopped_while_its_ranks_wait"]),
    "stamps_not_checked": (
        "the ranks' stamps are not compared: rank 0's evaluation at stage 3 computes with the "
        "parameters of the unit the other ranks gather in backward, then hangs",
        [("minishard/checks.py", "    if not bool(got.eq(got[:1]).all()):",
          "    if False:")],
        ["tests/test_stamps.py::test_rank0_only_evaluation_raises_on_every_rank_before_a_loss_is_reported"]),
    "joined_rank_backward_from_the_sum": (
        "under Join a joined rank backpropagates the sum of its outputs: an output that does "
        "not depend on the batch (CLIP's logit scale) sends its own gradient",
        [("minishard/join.py", "torch.autograd.backward(leaves, [torch.zeros_like(t) for t in "
          "leaves])", "torch.autograd.backward([t.sum() for t in leaves])")],
        ["tests/test_join.py::"
         "test_an_output_the_batch_does_not_touch_gets_no_gradient_from_a_joined_rank"]),
    "dcp_extra_not_digested": (
        "a DCP checkpoint's extra.pt has no checksum: a flipped byte loads silently",
        [("minishard/checkpoint/dcp.py", "        digests[EXTRA] = extra_file", "        pass")],
        ["tests/test_extra_state.py::test_a_damaged_extra_file_is_refused"]),
    "check_checkpoint_skips_extra": (
        "check_checkpoint (and so latest_checkpoint) does not look at extra.pt: a resume loop "
        "picks a checkpoint whose extra.pt is damaged",
        [("minishard/checkpoint/files.py", 'for info in meta["files"] + [e for e in '
          '[meta.get("extra_file")] if e]:', 'for info in meta["files"]:')],
        ["tests/test_extra_state.py::test_a_resume_loop_falls_back_past_a_damaged_extra_file"]),
    "full_tensor_ledgered_as_one_chunk": (
        "the ledger records a user's full_tensor() at one rank's chunk (1/N of its bytes)",
        [("minishard/zero/params.py", "tensor.numel() * (n if gathered else 1)", "tensor.numel()")],
        ["tests/test_torch_tools.py::test_a_full_tensor_is_in_the_ledger_at_its_full_size"]),
    "persist_below_inclusive": (
        "persist_below=n keeps a parameter of exactly n elements whole",
        [("minishard/zero/build.py", "if p.numel() < persist_below:", "if p.numel() <= persist_below:")],
        ["tests/test_replicated.py::"
         "test_persist_below_n_keeps_exactly_the_parameters_of_fewer_than_n_elements"]),
    "step_formula_keeps_every_full_gradient": (
        "the step formula counts every full gradient at stages 2-3 (an overstatement the "
        "measured bound cannot see)",
        [("minishard/zero/meters.py", "keeps_full_grads = not policy.free_grads_early or "
          "find_unused", "keeps_full_grads = True")],
        ["tests/test_memory_wall.py::"
         "test_the_step_formula_counts_the_full_gradients_each_stage_keeps"]),
    "step_formula_forgets_find_unused": (
        "the step formula forgets that find_unused_parameters keeps every full gradient at "
        "stage 2 until the end of backward",
        [("minishard/zero/meters.py", "keeps_full_grads = not policy.free_grads_early or "
          "find_unused", "keeps_full_grads = not policy.free_grads_early")],
        ["tests/test_memory_wall.py::"
         "test_the_step_formula_counts_the_full_gradients_each_stage_keeps"]),
    "open_forward_never_ended": (
        "a forward whose backward never ran (grad enabled, or one unit called alone) keeps its "
        "gathered parameters marked current: the step after it is never gathered",
        [("minishard/zero/engine.py", "        if self.phase is Phase.FORWARD:  # the last forward's "
          "backward never came", "        if False:"),
         ("minishard/zero/engine.py", "        if self.phase is Phase.FORWARD:  # a forward never "
          "backpropagated is over", "        if False:")],
        ["tests/test_writes.py::test_a_forward_never_backpropagated_leaves_no_stale_parameters"]),
    "joined_rank_keeps_its_no_sync_gradient": (
        "a rank that joins after an unpaired no_sync micro-batch sends that gradient with the "
        "next reduction instead of zeros",
        [("minishard/join.py", "            self._zero_grad()  # drops what no_sync",
          "            pass  # drops what no_sync")],
        ["tests/test_join.py::"
         "test_a_rank_joining_mid_accumulation_contributes_zeros_as_under_ddp"]),
    "second_gradient_part_dropped": (
        "a buffer's gradient arriving in two parts in one backward (reentrant checkpointing) "
        "keeps only the first part",
        [("minishard/zero/schedule.py", "if id(flat) in self._reduced and (",
          "if id(flat) in self._reduced or 0 and (")],
        ["tests/test_training.py::test_a_gradient_arriving_in_two_parts_is_reduced_whole"]),
    # ---- issue 63: the newest promises kept
    "optimizer_adopted_at_its_first_step_only": (
        "an optimizer built before wrapping holds the emptied originals until its first step "
        "(clip over param_groups sees no gradient, GradScaler and Join refuse)",
        [("minishard/zero/engine.py",
          "        guards.adopt_live_optimizers()  # an optimizer built before wrapping: ours from now on\n",
          "")],
        ["tests/test_optimizer_before_wrap.py::test_an_optimizer_built_before_wrapping_is_the_models_at_once"]),
    "full_optimizer_state_in_module_order": (
        "full_optimizer_state_dict numbers parameters in module order, not the optimizer's",
        [("minishard/checkpoint/full_state.py", "    if param_names is None:\n        by_user",
          "    param_names = param_names or list(model.param_names)\n    if False:\n        by_user")],
        ["tests/test_optimizer_before_wrap.py::test_the_full_optimizer_state_is_numbered_as_torch_numbers_it"]),
    "stepped_optimizer_not_adopted_after_a_load": (
        "an optimizer that already stepped is not checked again after load_state_dict: its full "
        "state meets DTensor parameters (torch's 'mixed torch.Tensor and DTensor')",
        [("minishard/zero/guards.py",
          "        optimizer.register_load_state_dict_post_hook(CHECKED.discard)\n", "")],
        ["tests/test_optimizer_before_wrap.py::test_a_stepped_optimizer_is_adopted_again_after_it_loads"]),
    "shards_load_on_any_rank": (
        "a state dict of one rank's DTensor shards (model's or optimizer's) loads silently on "
        "another rank: every rank trains with rank 0's rows",
        [("minishard/zero/guards.py",
          "    if rows is None or tuple(rows) == tuple(flat.row_ranges[j]):", "    if True:")],
        ["tests/test_foreign_shards.py"]),
    "overwrite_deletes_the_users_files": (
        "save_checkpoint(overwrite=True) deletes every file in the directory it did not write",
        [("minishard/checkpoint/files.py",
          "    if not os.path.isdir(source) or not os.path.isdir(path):", "    if True:")],
        ["tests/test_state.py::test_an_overwrite_crashed_anywhere_leaves_one_whole_checkpoint"]),
    "latest_checkpoint_takes_the_previous": (
        "latest_checkpoint ranks an overwrite's ckpt.previous above ckpt (the resume goes back "
        "one save)",
        [("minishard/checkpoint/files.py",
          "    names = {_without_suffix(d) for d in os.listdir(root)",
          "    names = {d for d in os.listdir(root)")],
        ["tests/test_state.py::test_an_overwrite_crashed_anywhere_leaves_one_whole_checkpoint"]),
    "stamps_without_the_model": (
        "a gather's stamp names its buffers but not the model: rank 0 running model A while rank "
        "1 runs model B (one architecture) computes with B's parameters",
        [("minishard/zero/flat.py", '(model {flats[0].model})"', '(model 0)"')],
        ["tests/test_stamps.py::test_two_models_of_one_architecture_are_told_apart"]),
    "replicas_average_unchecked": (
        "hybrid sharding: the replicas' all-reduce carries its stamp but no rank checks it (a "
        "block frozen on one replica: gradients averaged across different blocks)",
        [("minishard/zero/flat.py", '    comm.all_reduce(send, "avg", group, tag=tag, stamped=True)',
          '    comm.all_reduce(send, "avg", group, tag=tag)')],
        ["tests/test_stamps.py::test_the_replicas_average_is_stamped"]),
    "discarded_no_sync_gradient_comes_back": (
        "a gradient accumulated under no_sync and cleared by zero_grad is still reduced into "
        "the next step (DDP drops it)",
        [("minishard/zero/unit.py", "            if grad is not None and (p.grad is not shown or zeroed):",
          "            if False:")],
        ["tests/test_sequences.py"]),
    "no_grad_forward_leaves_views": (
        "after a torch.no_grad() forward at stages 0-2 the module keeps plain full tensors "
        "(the no-grad case dropped from the reshard: a later optimizer steps them)",
        [("minishard/zero/engine.py", "        if unit.module is self.module:  # every unit at rest",
          "        if unit.module is self.module and torch.is_grad_enabled():  #")],
        ["tests/test_sequences.py"]),
    "grad_forward_without_backward_leaves_views": (
        "a grad-enabled forward never backpropagated leaves plain tensors in the module at "
        "stages 0-2 (requires_grad_ and building an optimizer raise; a load reads stale values)",
        [("minishard/zero/engine.py", "        if unit.module is self.module:  # every unit at rest",
          "        if unit.module is self.module and (unit.reshard_after_forward\n"
          "                                           or not torch.is_grad_enabled()):  #")],
        ["tests/test_sequences.py"]),
    "planner_all_reduce_at_half_price": (
        "the planner prices a ring all-reduce at an all-gather's bytes, (N-1)/N S, not 2(N-1)/N S",
        [("minishard/observe/predict.py", '"allreduce": (2 * (n - 1), 2 * (n - 1) * nbytes / n)',
          '"allreduce": (2 * (n - 1), (n - 1) * nbytes / n)')],
        ["tests/test_prices.py"]),
    "full_state_loads_any_shape_of_its_size": (
        "load_full_state_dict loads a tensor of another shape with the parameter's element "
        "count (a (4, 6) weight into Linear(4, 6)); plain torch refuses it",
        [("minishard/checkpoint/full_state.py", "            if t.shape != param.shape:",
          "            if t.numel() != param.shape.numel():")],
        ["tests/test_errors.py::test_a_full_tensor_of_another_shape_is_refused_like_torch_refuses_it"]),
    "shard_copies_load_on_any_rank": (
        "a copy of a shard state dict (.detach(), .clone()) has lost its mark, and its bytes "
        "are not compared: every rank loads rank 0's rows",
        [("minishard/zero/guards.py", "        if len(alike) > 1:", "        if False:")],
        ["tests/test_foreign_shards.py::test_rank0s_file_loaded_on_every_rank_raises_on_every_rank"]),
    "a_submodules_load_unchecked": (
        "load_state_dict called on one submodule (a Linear) skips the ranks' verdict: another "
        "rank's rows are silently not loaded",
        [("minishard/zero/guards.py", "        if module is not self.outermost:\n            return",
          "        if module is not self.outermost or not list(module.children()):\n            return")],
        ["tests/test_foreign_shards.py::test_rank0s_file_loaded_on_every_rank_raises_on_every_rank"]),
    "overwrite_error_on_rank0_alone": (
        "rank 0's failed rename in an overwrite raises on rank 0 only: the others wait in the "
        "swap's collective until the timeout",
        [("minishard/checkpoint/directory.py", "        except OSError as exc:  # still join the verdict",
          "        except ValueError as exc:  # still join the verdict")],
        ["tests/test_state.py::test_an_overwrite_failing_on_rank0_raises_on_every_rank"]),
    "local_gradient_shown_as_a_copy": (
        "between no_sync micro-batches .grad shows a copy of the local gradient: scaling it in "
        "place (a user's gradient transform) changes nothing",
        [("minishard/zero/unit.py", "                    whole = flat.param_in(grad, param.index)\n",
          "                    whole = flat.param_in(grad, param.index).clone()\n")],
        ["tests/test_sequences.py"]),
    "hooks_traced_by_dynamo": (
        "the engine's hooks traced into compiled code: dynamo refuses the collectives, or a "
        "stage-3 unit's stand-ins are read before its gather",
        [("minishard/zero/engine.py", "    @torch.compiler.disable  # the engine runs eagerly",
          "    # the engine runs eagerly")],
        ["tests/test_compile.py::test_compiled_training_equals_one_process"]),
}


_NO_SHRINK = """
from hypothesis import Phase
settings.register_profile("mutant", max_examples=25, derandomize=True, print_blob=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.load_profile("mutant")
"""


def patched_sources(name: str) -> dict[str, str]:
    """{file: patched text} for a mutant; raises if a patch does not apply exactly once."""
    out: dict[str, str] = {}
    for path, old, new in MUTANTS[name][1]:
        text = out.get(path) or (ROOT / path).read_text()
        count = text.count(old)
        if count != 1:
            raise LookupError(f"mutant {name}: {path} contains the text to patch {count} times "
                              f"(expected once): {old!r}. Update tests/mutants.py.")
        out[path] = text.replace(old, new)
    return out


def run_mutant(name: str, first: bool) -> list[tuple[str, bool, float]]:
    """[(selection, killed, seconds)] for one mutant."""
    results = []
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name.replace('/', '_')}-") as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT / "minishard", tmp / "minishard")
        shutil.copytree(ROOT / "tests", tmp / "tests",
                        ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
        shutil.copytree(ROOT / "tutorials", tmp / "tutorials")  # lessons assert claims too
        shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
        for path, text in patched_sources(name).items():
            (tmp / path).write_text(text)
        with open(tmp / "tests" / "conftest.py", "a") as f:  # the ci draw, without shrinking:
            f.write(_NO_SHRINK)                              # a kill needs one failing example
        env = dict(os.environ, PYTHONPATH=str(tmp))
        for selection in MUTANTS[name][2]:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", selection, "-x", "-q",
                                   "-p", "no:cacheprovider"], cwd=tmp, env=env,
                                  capture_output=True, text=True, timeout=1800)
            # Killed means "tests failed" (1); a usage error or no test collected is no kill.
            results.append((selection, proc.returncode == 1, time.perf_counter() - t0))
            if proc.returncode not in (0, 1):
                print(proc.stdout[-3000:], proc.stderr[-3000:])
            if first and proc.returncode != 0:
                break
    return results


def main(argv: list[str]) -> int:
    first = "--first" in argv
    names = [a for a in argv if not a.startswith("--")] or list(MUTANTS)
    survivors = []
    for name in names:
        print(f"mutant {name}: {MUTANTS[name][0]}", flush=True)
        results = run_mutant(name, first)
        for selection, killed, seconds in results:
            print(f"    {'KILLED by' if killed else 'survived '} {selection}  ({seconds:.0f} s)",
                  flush=True)
        if not any(killed for _, killed, _ in results):
            survivors.append(name)
    print("survivors:", survivors or "none")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
