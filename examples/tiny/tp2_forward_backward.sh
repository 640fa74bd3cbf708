#!/usr/bin/env bash
# One Megatron forward/backward of the tiny Qwen2 model with TP=2 on two CPU processes
# (gloo), from a Hugging Face checkpoint built locally. Run from the repository root with
# the venv active (make demo creates it). On GPUs the same command runs with NCCL.
set -euo pipefail
MODEL=${MODEL:-runs/tiny-qwen2}
[ -f "$MODEL/config.json" ] || python -m examples.tiny_model --out "$MODEL"
torchrun --nproc-per-node 2 -m examples.demo.tp_step --hf-dir "$MODEL" --tp 2
