"""torchrun worker (2 ranks): a distillation teacher (a larger model than the student, the
student's tokenizer) gives the log-probs of the student's batch through the role the trainer
builds for it (`ReferencePolicy` of the teacher's checkpoint and architecture):
- on the job's layout, at TP2 and at PP2 (every rank holds the whole batch);
- on a layout of its own (`OnOwnLayout`): the job at DP2 (rank 0 rows 0-4, rank 1 rows 5-7
  cut to 20 columns) with the teacher at TP2 and at PP2, and the job at TP2 with the teacher
  at DP2; the job's groups are back after the teacher's, also when what ran inside raised.
Each rank writes {case}_{rank}.pt: (the global rows it held, its log-probs [B_r, S_r]).
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.source import ModelSource
from megatron_rl.parallel import distributed
from megatron_rl.parallel.layout_groups import LayoutGroups
from megatron_rl.procutil import exit_now
from megatron_rl.workers.own_layout import OnOwnLayout
from megatron_rl.workers.policy import ReferencePolicy
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch

Layout = distributed.ParallelLayout
CASES = {  # case: (the job's layout, the teacher's)
    "tp2": (Layout(tensor_model_parallel_size=2),) * 2,
    "pp2": (Layout(pipeline_model_parallel_size=2),) * 2,
    "dp2_teacher_tp2": (Layout(), Layout(tensor_model_parallel_size=2)),
    "dp2_teacher_pp2": (Layout(), Layout(pipeline_model_parallel_size=2)),
    "tp2_teacher_dp2": (Layout(tensor_model_parallel_size=2), Layout()),
}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher-dir", required=True)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    from megatron.core import parallel_state  # why: after torchrun's start, as the roles do

    arch = ModelSource(a.teacher_dir).architecture()
    for name, (job, own) in CASES.items():
        ctx = distributed.initialize(job, arch=arch)

        def build(layout=own):
            return ReferencePolicy(RoleModel(arch, layout, model_path=a.teacher_dir))

        if own == job:
            teacher = build()
        else:
            teacher = OnOwnLayout(build, LayoutGroups.build(own, ctx.world_size, arch))
            job_groups = parallel_state.get_tensor_model_parallel_group()
            try:  # whatever ran inside, the job's groups are back after it
                with teacher.groups.active():
                    assert parallel_state.get_tensor_model_parallel_group() is not job_groups
                    raise KeyError("inside")
            except KeyError:
                assert parallel_state.get_tensor_model_parallel_group() is job_groups
        batch = global_batch(arch.vocab_size).to(ctx.device)
        rows = range(8)
        if ctx.dp_size == 2:  # uneven rows, and rank 1's batch shorter
            rows = range(5) if ctx.dp_rank == 0 else range(5, 8)
            batch = batch.rows(slice(rows.start, rows.stop))
            if ctx.dp_rank == 1:
                batch = batch.with_length(20)
        logprobs = teacher.compute_logprobs(batch, num_microbatches=2)
        torch.save((list(rows), logprobs.cpu()), Path(a.out_dir) / f"{name}_{ctx.rank}.pt")
        parallel_state.destroy_model_parallel()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
