"""Linear layers for inference, and the panel layouts Loom's CPU kernels read.

Models are built and loaded with plain `nn.Linear` (so checkpoints, quantization and
tensor-parallel slicing all see ordinary weights); `use_panel_linears` then swaps each one for a
`DenseLinear` whose fp32 or bf16 weight is reordered once into panels of 32 output channels for
`loom::dense_linear` (loom/kernels/linear.cpp). On this project's CPU that kernel streams weights at
the machine's read bandwidth at batch 1 and keeps pace with oneDNN's GEMM up to prefill sizes
(docs/benchmarks); torch's fp32 GEMM takes a generic, 2-4x slower code path here. The weight-only
quantized layers (loom/quant/linear.py) use the same panels.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loom.kernels import load_kernels

PANEL = 32  # output channels per panel


def panel_kernels_available(device: torch.device) -> bool:
    """Whether `loom::dense_linear` runs here (CPU with AVX-512 BF16; the kernels build)."""
    if device.type != "cpu":
        return False
    load_kernels()
    return torch.ops.loom.linear_vectorized()


def pad_channels(t: torch.Tensor) -> torch.Tensor:
    """Pads dim 0 (output channels) with zeros to a multiple of PANEL."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % PANEL))


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), ceil(K/2) * 64], any dtype: per panel and pair of inputs
    (2p, 2p + 1), 64 values, channel-major. The layout of bf16 weights and of int8 codes."""
    w = pad_channels(F.pad(w, (0, w.shape[1] % 2)))
    n, k = w.shape
    return w.view(n // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous().view(n // PANEL, -1)


def unpack_pairs(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    pairs = packed.shape[1] // (2 * PANEL)
    return packed.view(-1, pairs, PANEL, 2).transpose(1, 2).reshape(-1, 2 * pairs)[:n, :k].contiguous()


def pack_columns(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K * 32]: per panel and input, 32 values. The layout of fp32 weights."""
    w = pad_channels(w)
    return w.view(-1, PANEL, w.shape[1]).transpose(1, 2).contiguous().view(w.shape[0] // PANEL, -1)


def unpack_columns(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return packed.view(-1, k, PANEL).transpose(1, 2).reshape(-1, k)[:n].contiguous()


class DenseLinear(nn.Module):
    """An fp32 or bf16 linear layer with its weight in the panel layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"DenseLinear: weights must be float32 or bfloat16, got {w.dtype}")
        self.weight = pack_columns(w) if w.dtype == torch.float32 else pack_pairs(w)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def unpacked_weight(self) -> torch.Tensor:
        """The weight [N, K] as nn.Linear holds it."""
        unpack = unpack_columns if self.weight.dtype == torch.float32 else unpack_pairs
        return unpack(self.weight, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.loom.dense_linear(x.reshape(-1, self.in_features), self.weight, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_panel_linears(module: nn.Module) -> None:
    """Replaces every fp32/bf16 nn.Linear below `module` by a DenseLinear (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype in (torch.float32, torch.bfloat16):
            setattr(module, name, DenseLinear(child))
        else:
            use_panel_linears(child)
