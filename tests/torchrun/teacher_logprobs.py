"""torchrun worker (2 ranks): a distillation teacher (a larger model than the student, the
student's tokenizer) gives the log-probs of the student's batch at TP2 and at PP2, through
the role the trainer builds for it (`ReferencePolicy` of the teacher's checkpoint and
architecture). Each rank writes {layout}_{rank}.pt with the log-probs [B, S] on every rank.
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.source import ModelSource
from megatron_rl.parallel import distributed
from megatron_rl.workers.policy import ReferencePolicy
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch

LAYOUTS = {
    "tp2": distributed.ParallelLayout(tensor_model_parallel_size=2),
    "pp2": distributed.ParallelLayout(pipeline_model_parallel_size=2),
}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher-dir", required=True)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    arch = ModelSource(a.teacher_dir).architecture()
    for name, layout in LAYOUTS.items():
        ctx = distributed.initialize(layout, arch=arch)
        teacher = ReferencePolicy(RoleModel(arch, layout, model_path=a.teacher_dir))
        batch = global_batch(arch.vocab_size).to(ctx.device)
        logprobs = teacher.compute_logprobs(batch, num_microbatches=2)
        torch.save(logprobs.cpu(), Path(a.out_dir) / f"{name}_{ctx.rank}.pt")
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    distributed.destroy()


if __name__ == "__main__":
    main()
