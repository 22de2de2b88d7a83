"""Weight-only quantized linear layers, swapped in for nn.Linear.

The kernel is chosen per call by the number of tokens: torch's weight-only int8/int4 kernels
read the compressed weights and win while the step is small (decode); past the measured
crossover (dispatch.py) the layer dequantizes to bf16 and runs an ordinary GEMM, which wins on
large batches and prefill. Both paths take bf16 activations (the weight-only CPU kernels are
only fast with bf16) and return the caller's dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from loom.quant.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8


class WeightOnlyLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, method: str, group_size: int,
                 bias: torch.Tensor | None, crossover: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size, self.crossover = method, group_size, crossover
        self.bias = bias
        # Portable (checkpoint) form, set by `load_quantized`; the kernel form is derived from it.
        self.qweight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        self._kernel_scales: torch.Tensor | None = None   # int8: bf16 scales
        self._packed: torch.Tensor | None = None          # int4: the CPU kernel's packed weight
        self._scales_zeros: torch.Tensor | None = None    # int4: [K/g, N, 2] bf16

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int, crossover: int) -> "WeightOnlyLinear":
        layer = cls(linear.in_features, linear.out_features, method, group_size,
                    None if linear.bias is None else linear.bias.detach(), crossover)
        w = linear.weight.detach()
        if method == "int8":
            q, scale = quantize_int8(w)
            layer.load_quantized(q, scale)
        else:
            q, scale, zero = quantize_int4(w, group_size)
            layer.load_quantized(q, scale, zero)
        return layer

    def load_quantized(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> None:
        """q: int8 [N, K] (int8) or values 0..15 as uint8 [N, K] (int4)."""
        # A fresh copy: tensors read from a checkpoint can sit at any offset of the file's
        # buffer, and torch's int8 kernel crashes on weights that are not 64-byte aligned.
        self.qweight = q.clone(memory_format=torch.contiguous_format)
        self.scales, self.zeros = scales.float(), None if zeros is None else zeros.float()
        if self.method == "int8":
            self._kernel_scales = self.scales.to(torch.bfloat16)
        else:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self._scales_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous().to(
                torch.bfloat16)  # [K/g, N, 2], the kernel's layout

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.method == "int8":
            return dequantize_int8(self.qweight, self.scales, dtype)
        return dequantize_int4(self.qweight, self.scales, self.zeros, dtype)

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        """The compressed-weight kernel; x [M, K] bf16."""
        if self.method == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self._kernel_scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self.group_size, self._scales_zeros)

    def dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize straight to bf16 (no fp32 copy of the matrix), then a bf16 GEMM."""
        return torch.nn.functional.linear(x, self.dequantized(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self.weight_only(x2) if x2.shape[0] <= self.crossover else self.dequantized_gemm(x2)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"group_size={self.group_size}, crossover={self.crossover}")
