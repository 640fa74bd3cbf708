"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models", arXiv:2309.00071), as Hugging Face and vLLM compute it for `rope_type: yarn`
(Qwen2.5/Qwen3's long-context setting).

megatron-core 0.16 has a `YarnRotaryEmbedding`, but it moves its frequencies to CUDA
unconditionally; we keep megatron's plain `RotaryEmbedding` (CPU and GPU alike), give it these
frequencies, and apply the attention factor through the softmax scale (`gpt.transformer_config`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """The paper's attention temperature sqrt(1/t) = 0.1 * ln(s) + 1 (Eq. 22), 1 for s <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(
    factor: float,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
) -> float:
    """The factor cos and sin are multiplied by (so attention logits scale by its square):
    the config's `attention_factor`, else the DeepSeek ratio when `mscale` and
    `mscale_all_dim` are both set (and non-zero), else the paper's `yarn_mscale(factor)`."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies, "NTK-by-parts" (the paper's Eq. 18-19).

    Dimensions that turn more than `beta_fast` times over the original context keep their
    frequency (extrapolation), those turning fewer than `beta_slow` times are divided by
    `factor` (interpolation), with a linear ramp between; `truncate` rounds the ramp's ends
    outward to whole dimensions.
    """
    # why: here, so that reading a config needs no torch
    import torch

    def dim_turning(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times in the original context.
        wavelength = original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    # ramp 0 (fast dimensions) keeps the original frequency, ramp 1 interpolates.
    return interpolated * ramp + extrapolated * (1 - ramp)
