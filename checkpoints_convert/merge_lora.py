"""Merge a PEFT LoRA adapter into its base Hugging Face checkpoint.

    python -m checkpoints_convert.merge_lora --hf-dir D --lora-dir L --out-dir D2

The adapter is checked against the base before anything is written (see
`checkpoints_convert.lora`). Tensors are merged and written in safetensors shards of at most
--max-shard-mb, one tensor in memory beyond the current shard. `hf_to_megatron --lora-dir`
merges the same way without this intermediate copy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from checkpoints_convert.common import atomic_output_dir, copy_side_files, fail
from checkpoints_convert.lora import LoraMergedReader
from megatron_rl.models.hf_export import ShardWriter
from megatron_rl.models.hf_mapping import HFCheckpointReader
from megatron_rl.procutil import exit_now


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--lora-dir", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--max-shard-mb", type=int, default=4096)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        reader = LoraMergedReader(HFCheckpointReader(a.hf_dir), a.lora_dir)
    except (ValueError, KeyError, FileNotFoundError) as e:
        fail(e)
    with atomic_output_dir(a.out_dir, a.overwrite) as tmp:
        writer = ShardWriter(tmp, "model", a.max_shard_mb * 2**20)
        for name in reader.keys():
            writer.add(name, reader(name))
        writer.flush()
        index = {"metadata": {}, "weight_map": writer.weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        copy_side_files(a.hf_dir, tmp)
    print(f"wrote {a.out_dir} ({len(reader.keys())} tensors, adapter {a.lora_dir} merged)")


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
