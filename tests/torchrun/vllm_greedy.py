"""Worker (plain python, vLLM engines of its own): for each checkpoint, greedy-decode 80
tokens from two fixed prompts with megatron_rl's VLLMEngine; one engine at a time in one
process (importing vLLM once). Writes OUT_DIR/{checkpoint dir name}.json holding
[[prompt, response], ...].

    python -m tests.torchrun.vllm_greedy OUT_DIR HF_DIR [HF_DIR ...]
"""

import json
import sys
from pathlib import Path

from megatron_rl.procutil import exit_now
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine

PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 44, 8, 21, 7, 6]]


def main():
    out_dir, hf_dirs = Path(sys.argv[1]), sys.argv[2:]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=80, ignore_eos=True)
    for hf_dir in hf_dirs:
        engine = VLLMEngine(hf_dir, EngineConfig(seed=0, max_model_len=256))
        samples = engine.generate(PROMPTS, greedy)
        result = [[s.prompt_token_ids, s.token_ids] for s in samples]
        (out_dir / f"{Path(hf_dir).name}.json").write_text(json.dumps(result))
        engine.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
