"""Linear layers for inference, and the panel layouts Loom's CPU kernels read.

Models are built and loaded with plain `nn.Linear` (so checkpoints, quantization and
tensor-parallel slicing all see ordinary weights); `use_dense_linears` then swaps each fp32 or
bf16 one for a `DenseLinear`, which runs, by tokens per step, the kernel its dispatch plan names
(loom/layers/dispatch.py): `loom::dense_linear` over weights reordered once into panels of 32
output channels (loom/kernels/linear.cpp; CPUs with AVX-512 BF16 or AVX2, where it streams weights
near the machine's read bandwidth at batch 1), `loom::amx_linear` over the same bf16 panels (AMX
tiles, for many tokens), or torch's GEMM in the weights' dtype or in fp32. The
weight-only quantized layers (loom/quant/linear.py) use the same panels and the same dispatch.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loom.kernels import load_kernels
from loom.layers.dispatch import Plan, load_plan, planned_forward

PANEL = 32  # output channels per panel


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
    """pack_pairs' inverse, for 2-byte elements (bf16 weights): each pair moves as one 4-byte
    word, so the copy is a transpose of words (2.5x as fast as one of 2-byte elements)."""
    pairs = packed.shape[1] // (2 * PANEL)
    words = packed.view(torch.int32).view(-1, pairs, PANEL).transpose(1, 2).contiguous().view(-1, pairs)
    return words.view(packed.dtype)[:n, :k].contiguous()


def pack_columns(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K * 32]: per panel and input, 32 values. The layout of fp32 weights."""
    w = pad_channels(w)
    return w.view(-1, PANEL, w.shape[1]).transpose(1, 2).contiguous().view(w.shape[0] // PANEL, -1)


def unpack_columns(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return packed.view(-1, k, PANEL).transpose(1, 2).reshape(-1, k)[:n].contiguous()


class DenseLinear(nn.Module):
    """An fp32 or bf16 linear layer that picks its kernel by tokens per step (`plan`,
    loom/layers/dispatch.py). Its weight is kept in the panel layout when the plan runs the panel
    kernel at all, else as nn.Linear holds it; a GEMM over panels unpacks them at each call."""

    def __init__(self, linear: nn.Linear, plan: Plan | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"DenseLinear: weights must be float32 or bfloat16, got {w.dtype}")
        self.plan = plan or load_plan("fp32" if w.dtype == torch.float32 else "bf16")
        self.packed = any(kernel in ("panel", "amx") for _, kernel in self.plan)
        if not self.packed:
            self.weight = w.contiguous()
        else:
            load_kernels()
            self.weight = pack_columns(w) if w.dtype == torch.float32 else pack_pairs(w)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def unpacked_weight(self) -> torch.Tensor:
        """The weight [N, K] as nn.Linear holds it."""
        if not self.packed:
            return self.weight
        unpack = unpack_columns if self.weight.dtype == torch.float32 else unpack_pairs
        return unpack(self.weight, self.out_features, self.in_features)

    def panel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.loom.dense_linear(x, self.weight, self.out_features)

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.loom.amx_linear(x, self.weight, self.out_features)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.unpacked_weight())

    def gemm_fp32(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.unpacked_weight().float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_forward(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"plan={self.plan}")


def use_dense_linears(module: nn.Module) -> None:
    """Replaces every fp32/bf16 nn.Linear below `module` by a DenseLinear (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype in (torch.float32, torch.bfloat16):
            setattr(module, name, DenseLinear(child))
        else:
            use_dense_linears(child)
