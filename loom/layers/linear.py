"""Linear layers for inference.

Models are built and loaded with plain `nn.Linear` (so checkpoints, later quantization and
tensor-parallel slicing all see ordinary weights); `pack_linears` then swaps each one for a
`PackedLinear` whose weight is reordered once into oneDNN's blocked layout. On CPU that path is
2-4x faster than `F.linear` in fp32 (whose BLAS takes a generic code path on some x86 chips)
and up to 2x faster in bf16 at small batch; the arithmetic is the same fp32/bf16 GEMM.
"""
from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # the same oneDNN call, as an op the compiler can place (loom/kernels.py)
            out = torch.ops.loom.packed_linear(x2, self.weight, self.bias, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear below `module` by a PackedLinear (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
