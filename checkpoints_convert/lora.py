"""Merge a PEFT LoRA adapter into base weights while they are read: W' = W + s * B @ A,
s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

Adapters are checked before anything is written: every lora_A/lora_B pair must fit its base
tensor ([r, in] and [out, r] for a base [out, in]) with the rank its config gives (`r`, or
its `rank_pattern` entry: the scale depends on it); an empty tensor (the `torch.Size([0])`
of a ZeRO-3 save, seed 002) or a wrong shape is an error naming the file, the tensor and both
shapes. `modules_to_save` tensors (e.g. a reward model's `score` head) replace the base ones.
DoRA, LoRA biases and fan-in-fan-out (GPT-2 Conv1D) adapters are refused, not approximated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

PREFIX = "base_model.model."


class LoraMergedReader:
    """Wraps an `HFCheckpointReader`; tensors come out with the adapter merged in."""

    def __init__(self, base, lora_dir: str | Path):
        self.base = base
        self.hf_dir = base.hf_dir
        lora_dir = Path(lora_dir)
        config_path = lora_dir / "adapter_config.json"
        weights_path = lora_dir / "adapter_model.safetensors"
        for path in (config_path, weights_path):
            if not path.exists():
                raise ValueError(f"{path} not found: --lora-dir must be a PEFT adapter directory")
        config = json.loads(config_path.read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{config_path}: peft_type {config['peft_type']!r} is not LORA")
        for flag in ("use_dora", "fan_in_fan_out"):
            if config.get(flag):
                raise ValueError(f"{config_path}: {flag}=true adapters are not supported")
        if config.get("lora_bias"):
            raise ValueError(f"{config_path}: lora_bias=true adapters are not supported")
        self._config = config
        try:
            from safetensors.torch import load_file

            tensors = load_file(weights_path)
        except Exception as e:
            raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from None
        self._pairs: dict[str, dict[str, torch.Tensor]] = {}
        self._replacements: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            name = key.removeprefix(PREFIX)
            for part in ("lora_A", "lora_B"):
                marker = f".{part}.weight"
                if name.endswith(marker):
                    target = name[: -len(marker)] + ".weight"
                    self._pairs.setdefault(target, {})[part] = tensor
                    break
            else:
                self._replacements[name.replace(".modules_to_save", "")] = tensor
        self._check(weights_path)

    def _configured(self, target: str, key: str, pattern_key: str, default):
        """`key` of the adapter config for `target`, its `pattern_key` entry where one
        matches the module name (PEFT's rank_pattern / alpha_pattern)."""
        module = target.removesuffix(".weight")
        value = self._config.get(key, default)
        for pattern, v in (self._config.get(pattern_key) or {}).items():
            if module.endswith(pattern):
                value = v
        return value

    def _rank(self, target: str) -> int | None:
        return self._configured(target, "r", "rank_pattern", None)

    def _scale(self, target: str) -> float:
        r = self._rank(target) or self._pairs[target]["lora_A"].shape[0]
        alpha = self._configured(target, "lora_alpha", "alpha_pattern", r)
        return alpha / (math.sqrt(r) if self._config.get("use_rslora") else r)

    def _check(self, weights_path: Path) -> None:
        for target, pair in self._pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"{weights_path}: {target} has only {sorted(pair)}")
            a, b = pair["lora_A"], pair["lora_B"]
            try:
                out_dim, in_dim = self.base.shape(target)
            except KeyError:
                raise ValueError(
                    f"{weights_path}: adapter targets {target!r}, which the base checkpoint "
                    f"{self.hf_dir} does not have"
                ) from None
            r = a.shape[0] if a.dim() == 2 else -1
            if a.shape != (r, in_dim) or b.shape != (out_dim, r) or r < 1:
                raise ValueError(
                    f"{weights_path}: LoRA for {target!r} has lora_A {list(a.shape)} and lora_B "
                    f"{list(b.shape)}; base is {[out_dim, in_dim]}, so expected [r, {in_dim}] "
                    f"and [{out_dim}, r]"
                )
            configured = self._rank(target)
            if configured is not None and r != configured:
                # The scale alpha / r would be computed from a rank the tensors do not have.
                raise ValueError(
                    f"{weights_path}: LoRA for {target!r} has rank {r} (lora_A {list(a.shape)}) "
                    f"but adapter_config.json says r={configured}"
                    + (" (with rank_pattern)" if self._config.get("rank_pattern") else "")
                )
        for name, tensor in self._replacements.items():
            if name in self.base.keys() and tuple(tensor.shape) != self.base.shape(name):
                raise ValueError(
                    f"{weights_path}: {name!r} has shape {list(tensor.shape)}, the base "
                    f"checkpoint's is {list(self.base.shape(name))}"
                )

    def keys(self) -> list[str]:
        return sorted(set(self.base.keys()) | set(self._replacements))

    def shape(self, name: str) -> tuple:
        if name in self._replacements:
            return tuple(self._replacements[name].shape)
        return self.base.shape(name)

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self._replacements[name] if name in self._replacements else self.base(name)
        if name in self._pairs:
            a, b = self._pairs[name]["lora_A"], self._pairs[name]["lora_B"]
            delta = b.double() @ a.double() * self._scale(name)
            tensor = (tensor.double() + delta).to(tensor.dtype)
        return tensor
