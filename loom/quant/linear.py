"""Weight-only quantized linear layers, swapped in for nn.Linear.

The kernel is chosen per call by the number of tokens (the layer's plan, loom/layers/dispatch.py):
Loom's weight-only kernels (`torch.ops.loom.int8_linear` / `int4_linear`, loom/kernels/linear.cpp)
read the compressed weights and multiply them as integers with an int8 copy of the activations (a
scale per 32 inputs); the others dequantize and run an ordinary GEMM. The layer keeps only the
kernel's form of the weights; `portable()` gives back the checkpoint form.
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels import load_kernels
from loom.layers.dispatch import Plan, load_plan, native_bf16, planned_forward
from loom.quant.quantize import (dequantize_int4, dequantize_int8, pack_groups_for_kernel, pack_int4_for_kernel,
                                 pack_int8_for_kernel, quantize_int4, quantize_int8, unpack_groups_from_kernel,
                                 unpack_int4_from_kernel, unpack_int8_from_kernel)


class WeightOnlyLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, method: str, group_size: int,
                 bias: torch.Tensor | None, plan: Plan | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = method, group_size
        self.plan = plan or load_plan(method)
        self.bias = bias
        # Set by `load_quantized`, in the kernels' panel layouts (loom/kernels/linear.cpp). int8: q + 128
        # as uint8, scales [N] fp32. int4: scales and zeros bf16 [ceil(N/32), K/G, 32]; no zeros
        # for a symmetric matrix.
        self.q: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        # The dequantized GEMM's dtype: bf16 where the CPU multiplies it natively (AVX-512 BF16),
        # else the activations' own (None): elsewhere torch's bf16 GEMM converts to fp32 inside
        # and ran 3-7x slower than fp32 from 16 tokens on (AVX2), and rounding an fp32 model's
        # activations and outputs to bf16 would only lose precision.
        self.gemm_dtype: torch.dtype | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int, plan: Plan | None = None,
                    symmetric: bool = False) -> "WeightOnlyLinear":
        """`symmetric`: int4 scales only (int8 always is)."""
        layer = cls(linear.in_features, linear.out_features, method, group_size,
                    None if linear.bias is None else linear.bias.detach(), plan)
        w = linear.weight.detach()
        if method == "int8":
            layer.load_quantized(*quantize_int8(w))
        else:
            layer.load_quantized(*quantize_int4(w, group_size, symmetric))
        return layer

    @property
    def symmetric(self) -> bool:
        """Weights are scale times code, with no zero point."""
        return self.zeros is None

    def load_quantized(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> None:
        """The portable form: int8 q [N, K] with fp32 scales [N]; or int4 values 0..15 as
        uint8 [N, K] with scales and zeros [N, K/G] (no zeros: symmetric)."""
        load_kernels()
        self.gemm_dtype = torch.bfloat16 if native_bf16() else None
        # The packers write fresh, aligned tensors: a checkpoint's can sit at any offset of its buffer.
        if self.method == "int8":
            self.q = pack_int8_for_kernel(q)
            self.scales = scales.float().contiguous()
        else:
            self.q = pack_int4_for_kernel(q)
            # bf16, as the kernel reads them (torch's int4 kernel makes the same choice).
            self.scales = pack_groups_for_kernel(scales)
            self.zeros = None if zeros is None else pack_groups_for_kernel(zeros)

    def portable(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, scales, zeros) as `load_quantized` takes them: what a checkpoint stores."""
        n, k = self.out_features, self.in_features
        if self.method == "int8":
            return unpack_int8_from_kernel(self.q, n, k), self.scales, None
        return (unpack_int4_from_kernel(self.q, n, k), unpack_groups_from_kernel(self.scales, n),
                None if self.zeros is None else unpack_groups_from_kernel(self.zeros, n))

    def reference_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight matrix [N, K] as the kernels see it (plain PyTorch: the reference)."""
        q, scales, zeros = self.portable()
        if self.method == "int8":
            return dequantize_int8(q, scales, dtype)
        return dequantize_int4(q, scales, zeros, dtype)

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        """The compressed-weight kernel; x [M, K] -> [M, N] in x's dtype."""
        if self.method == "int8":
            return torch.ops.loom.int8_linear(x, self.q, self.scales)
        return torch.ops.loom.int4_linear(x, self.q, self.scales, self.zeros, self.group_size, self.out_features)

    def _dequantized_weight(self) -> torch.Tensor:
        """Dequantized straight to bf16 (C++, no fp32 copy of the matrix)."""
        if self.method == "int8":
            return torch.ops.loom.int8_dequantize(self.q, self.scales, self.in_features)
        return torch.ops.loom.int4_dequantize(self.q, self.scales, self.zeros, self.group_size, self.in_features,
                                              self.out_features)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then a GEMM in `gemm_dtype`."""
        dtype = self.gemm_dtype or x.dtype
        return torch.nn.functional.linear(x.to(dtype), self._dequantized_weight().to(dtype)).to(x.dtype)

    def dequantized_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then a GEMM in fp32."""
        return torch.nn.functional.linear(x.float(), self._dequantized_weight().float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_forward(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, plan={self.plan}")
