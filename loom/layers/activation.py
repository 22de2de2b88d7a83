"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.layers.elementwise import with_kernel


@with_kernel("silu_and_mul")
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's inner product: silu(gate) * up, of [..., 2 * I] holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
