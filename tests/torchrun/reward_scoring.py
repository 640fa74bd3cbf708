"""torchrun worker: rewards scored through the trainer's ModelParallelScoringPool at TP = world
size with a reward that differs per rank and per call; each rank saves what it got ->
--out-dir/rank{RANK}.json."""

import argparse
import json
import os

from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rewards import PythonRewardConfig, RewardInput
from megatron_rl.rewards.pool import ModelParallelScoringPool


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--calls-file", required=True)
    a = p.parse_args()
    ctx = distributed.initialize(
        distributed.ParallelLayout(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))
    )
    fn = PythonRewardConfig(
        path="tests.reward_fns:rank_dependent", kwargs={"calls_file": a.calls_file}
    )
    pool = ModelParallelScoringPool([fn], None)
    batches = [[RewardInput("p", "p", f"r{i}-{j}") for j in range(3)] for i in range(2)]
    handles = [pool.submit(b) for b in batches]  # two in flight, as the rating loop does
    rewards = [r for h in handles for r in pool.result(h).scored.rewards]
    pool.close()
    with open(os.path.join(a.out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(rewards, f)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
