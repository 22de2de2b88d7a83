"""Rotary position embedding (rotate-half form, as Hugging Face Llama), with llama3 scaling, on
all of each head's dims or (GPT-NeoX) on the first `rotary_dim` of them."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from loom.layers.elementwise import with_kernel


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # fp32 throughout, as the reference implementation computes it, so positions match bit for bit
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_len / low, inv_freq / factor, torch.where(wavelen < old_len / high, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to packed q/k of shape [tokens, heads, head_dim] at given positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device | str = "cpu", rotary_dim: int = 0) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim if 0 < rotary_dim < head_dim else 0  # 0: every dim
        inv_freq = rope_inv_freq(self.rotary_dim or head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq).to(device)
        # [max_positions, head_dim // 2] each; plain attributes (not buffers) so that casting the
        # model to bf16 leaves them in fp32.
        self.cos, self.sin = angles.cos(), angles.sin()
        self.kernel = False  # eager calls run Loom's operator (loom/layers/elementwise.py)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(positions, q, k, self.cos, self.sin, self.rotary_dim, kernel=self.kernel)


@with_kernel("rotary")
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1)  # [T, 1, D/2]
    sin = sin_table[positions].unsqueeze(1)
    if not rotary_dim:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return tuple(torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1) for x in (q, k))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
