"""torchrun worker (2 ranks): a colocated vLLM engine with TP=2 over the world; once every
job of the test has its engine up (ready files in --sync-dir, one per job), greedy-decode two
fixed prompts; rank 0 writes the responses to --out as JSON. Two of these at once on one host
are two concurrent training jobs' engines."""

import argparse
import json
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine

PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 44, 8, 21, 7, 6]]


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sync-dir", required=True)
    p.add_argument("--jobs", type=int, required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    distributed.initialize(distributed.ParallelLayout(tensor_model_parallel_size=2), arch=arch)
    engine = VLLMEngine(
        a.hf_dir, EngineConfig(max_model_len=256, external_launcher=True, tensor_parallel_size=2)
    )
    sync = Path(a.sync_dir)
    if dist.get_rank() == 0:
        (sync / Path(a.out).name).touch()
        deadline = time.monotonic() + 300
        while len(list(sync.iterdir())) < a.jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other jobs' engines never came up: {list(sync.iterdir())}")
            time.sleep(0.2)
    dist.barrier()
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    samples = engine.generate(PROMPTS, greedy)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps([s.token_ids for s in samples]))
    engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
