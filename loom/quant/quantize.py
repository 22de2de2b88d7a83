"""Quantizing and dequantizing weight matrices [out_features, in_features].

int8: symmetric absmax per output channel, w ~= q * scale, q in [-127, 127].
int4: asymmetric min-max per group of `group_size` inputs, w ~= (q - 8) * scale + zero with
q in [0, 15] (the convention of torch's int4 CPU kernel).
On disk int4 values are two per byte, the even input index in the low nibble. In memory both
formats take the panel layouts of Loom's kernels (int8: `loom.layers.linear.pack_pairs`;
int4: `pack_int4_for_kernel`).
"""
from __future__ import annotations

import torch

from loom.layers.linear import PANEL, pad_channels

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def check_options(method: str, group_size: int, in_features: int | None = None, name: str = "") -> None:
    if method not in METHODS:
        raise ValueError(f"quantization: unknown method {method!r}, choose from {METHODS}")
    if method == "int4":
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: must be one of {GROUP_SIZES}, got {group_size}")
        if in_features is not None and in_features % group_size:
            raise ValueError(f"group_size: {group_size} does not divide the input dimension {in_features}"
                             f"{f' of {name}' if name else ''}")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q uint8 [N, K] in 0..15, scales [N, K/g], zeros [N, K/g]) in fp32."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape
    groups = q.reshape(n, scale.shape[1], -1).to(dtype)
    return ((groups - 8) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] bytes."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K a multiple of 8) -> [ceil(N/32), K/8 * 128] bytes in the layout of
    `loom::int4_linear`: per panel and quad d of inputs 8d .. 8d + 7, two halves of 16
    channels, each 32 16-bit words; nibble e of word 2j + t is input 8d + 2e + t of channel j."""
    q = pad_channels(q.to(torch.int32))
    n, k = q.shape
    v = q.view(n // PANEL, 2, 16, k // 8, 4, 2).permute(0, 3, 1, 2, 5, 4)  # panel, quad, half, j, t, e
    words = v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)
    return words.to(torch.int16).contiguous().view(torch.uint8).view(n // PANEL, -1)


def unpack_int4_from_kernel(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int4_for_kernel`: -> [N, K] values 0..15 (uint8)."""
    words = packed.contiguous().view(torch.int16).int().view(-1, k // 8, 2, 16, 2, 1) & 0xFFFF
    nibbles = (words >> torch.tensor([0, 4, 8, 12]).view(1, 1, 1, 1, 1, 4)) & 0x0F  # panel, quad, half, j, t, e
    return nibbles.permute(0, 2, 3, 1, 5, 4).reshape(-1, k)[:n].to(torch.uint8).contiguous()


def pack_groups_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zeros [N, K/G] -> bf16 [ceil(N/32), K/G, 32], as `loom::int4_linear` reads them."""
    t = pad_channels(t.to(torch.bfloat16))
    return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def unpack_groups_from_kernel(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].float()
