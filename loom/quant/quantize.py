"""Quantizing and dequantizing weight matrices [out_features, in_features].

int8: symmetric absmax per output channel, w ~= q * scale, q in [-127, 127].
int4: asymmetric min-max per group of `group_size` inputs, w ~= (q - 8) * scale + zero with
q in [0, 15] (the convention of torch's int4 CPU kernel); or symmetric, w ~= (q - 8) * scale with
no zero, the group's largest magnitude at q = 0 (llama.cpp's Q4_0: 10% fewer bytes at group 32).
On disk int4 values are two per byte, the even input index in the low nibble. In memory both
formats take the panel layouts of Loom's kernels (loom/kernels/linear.cpp): `pack_int8_for_kernel`,
`pack_int4_for_kernel`.
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


def check_symmetric(method: str | None, symmetric: bool, field: str = "symmetric") -> None:
    """`symmetric` chooses between int4's two forms; asked of anything else, it is an error."""
    if symmetric and method != "int4":
        raise ValueError(f"{field}: chooses int4's format (int8 weights are always symmetric), but quantization "
                         f"is {method!r}")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


def quantize_int4(w: torch.Tensor, group_size: int,
                  symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (q uint8 [N, K] in 0..15, scales [N, K/g], zeros [N, K/g] or None if `symmetric`) in fp32."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        # The value of largest magnitude is -8 steps: exact, and its side of zero gets the 8th level.
        extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scale = extreme / -8
        steps = groups / torch.where(scale == 0, 1, scale)[..., None]  # an all-zero group: every q is 8
        return torch.round(steps + 8).clamp(0, 15).to(torch.uint8).reshape(n, k), scale, None
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape
    w = (q.reshape(n, scale.shape[1], -1).to(dtype) - 8) * scale.to(dtype)[..., None]
    return (w if zero is None else w + zero.to(dtype)[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] bytes."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_int8_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [ceil(N/32), ceil(K/4) * 128] uint8 q + 128 in the layout of
    `loom::int8_linear`: per panel and quad d of inputs 4d .. 4d + 3, two halves of 16 channels;
    byte 4j + t of half h is input 4d + t of channel 16h + j."""
    q = pad_channels(torch.nn.functional.pad(q.to(torch.int32), (0, -q.shape[1] % 4)))
    n, k = q.shape
    u = (q + 128).to(torch.uint8).view(n // PANEL, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4)  # panel, quad, half, j, t
    return u.contiguous().view(n // PANEL, -1)


def unpack_int8_from_kernel(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int8_for_kernel`: -> [N, K] int8."""
    u = packed.view(packed.shape[0], -1, 2, 16, 4).permute(0, 2, 3, 1, 4).reshape(packed.shape[0] * PANEL, -1)
    return (u[:n, :k].to(torch.int32) - 128).to(torch.int8).contiguous()


def pack_int4_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K a multiple of 8) -> [ceil(N/32), K/8 * 128] bytes in the layout of
    `loom::int4_linear`: per panel and octet d of inputs 8d .. 8d + 7, two halves of 16
    channels; byte 4j + t of half h holds input 8d + t of channel 16h + j in its low nibble and
    input 8d + 4 + t in its high nibble."""
    q = pad_channels(q.to(torch.uint8))
    n, k = q.shape
    v = q.view(n // PANEL, 2, 16, k // 8, 2, 4).permute(0, 3, 1, 2, 5, 4)  # panel, octet, half, j, t, nibble
    return (v[..., 0] | (v[..., 1] << 4)).contiguous().view(n // PANEL, -1)


def unpack_int4_from_kernel(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int4_for_kernel`: -> [N, K] values 0..15 (uint8)."""
    b = packed.view(packed.shape[0], k // 8, 2, 16, 4)
    nibbles = torch.stack([b & 0x0F, b >> 4], dim=-1)  # panel, octet, half, j, t, nibble
    return nibbles.permute(0, 2, 3, 1, 5, 4).reshape(-1, k)[:n].contiguous()


def pack_groups_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zeros [N, K/G] -> bf16 [ceil(N/32), K/G, 32], as `loom::int4_linear` reads them."""
    t = pad_channels(t.to(torch.bfloat16))
    return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def unpack_groups_from_kernel(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].float()
