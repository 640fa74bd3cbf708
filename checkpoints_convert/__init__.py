"""Checkpoint tools between Hugging Face and megatron-core's distributed checkpoint format.

    python -m checkpoints_convert.hf_to_megatron --hf-dir D --out-dir O --tp N --pp M [--role actor|critic] [--lora-dir L]
    python -m checkpoints_convert.megatron_to_hf --ckpt-dir O --out-dir D2 [--tp N --pp M]
    python -m checkpoints_convert.verify --hf-dir D --ckpt-dir O [--tp N --pp M]
    python -m checkpoints_convert.merge_lora --hf-dir D --lora-dir L --out-dir D2

Run plainly, each command checks its inputs in one process (errors name the file and the
tensor), then starts itself under torchrun with TP*PP processes; run under torchrun, it is
that worker. Outputs appear whole or not at all (temporary directory, then rename).
"""
