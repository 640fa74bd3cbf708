"""Worker (plain python, a vLLM engine of its own): greedy-decode 80 tokens from two fixed
prompts with megatron_rl's VLLMEngine and write [[prompt, response], ...] as JSON.

    python -m tests.torchrun.vllm_greedy HF_DIR OUT_JSON
"""

import json
import sys

from megatron_rl.rollout.vllm_engine import EngineConfig, SamplingConfig, VLLMEngine

PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 44, 8, 21, 7, 6]]


def main():
    hf_dir, out = sys.argv[1:3]
    engine = VLLMEngine(hf_dir, EngineConfig(seed=0, max_model_len=256))
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=80, ignore_eos=True)
    samples = engine.generate(PROMPTS, greedy)
    with open(out, "w") as f:
        json.dump([[s.prompt_token_ids, s.token_ids] for s in samples], f)
    engine.shutdown()


if __name__ == "__main__":
    main()
