"""torchrun worker: a reward model scored by Megatron (TP over the world) through the same
RewardScorer interface as the HF backend; rank 0 saves the scores -> --out."""

import argparse
import json

from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rewards import RewardInput, RewardModelConfig, RewardScorer


def inputs() -> list[RewardInput]:
    prompts = [
        "What is 2 + 2?",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7 * 6?"}],
    ]
    responses = ["The answer is \\boxed{4}.", "42", "I think it is 5"]
    return [RewardInput(p, "", r) for p in prompts for r in responses]


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rm-dir", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ctx = distributed.initialize(distributed.ParallelLayout(tensor_model_parallel_size=a.tp))
    scorer = RewardScorer([RewardModelConfig(model_dir=a.rm_dir, backend="megatron", batch_size=4)])
    out = scorer(inputs())
    if ctx.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"rewards": out.rewards, "errors": out.errors}, f)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
