"""Elementwise layer math (norms, rotary embedding, gated activations) fused for eager steps.

Prefill and mixed steps run eagerly, their shapes varying from step to step. There each small
op of these functions is a pass over the step's activations, and some run over strided views
(q and k are slices of one projection): for a 2047-token prompt of the 134M reference model in
fp32, about 18 ms a layer eager against 4 fused by inductor, for any number of tokens
(`dynamic=True`). A compiled decode step traces the plain function instead, into its own graph.
Layers take the fused path once their engine allows compiling (`enable_fusion`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

Fn = TypeVar("Fn", bound=Callable)


def fused(fn: Fn) -> Fn:
    """`fn(*args, fuse=False)`: as it is, or with `fuse=True` outside a compiled step, compiled
    on its first such call, for any sizes, rounding where `fn` casts as eager execution does (as
    the decode graphs do). Compiled then, not at import: importing the compiler takes seconds
    that commands without a model never need."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, fuse: bool = False):
        nonlocal compiled
        if not fuse or torch.compiler.is_compiling():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
        return compiled(*args)

    return call  # type: ignore[return-value]


def enable_fusion(model: nn.Module) -> None:
    """Lets every layer of `model` with a fused eager path (a `fuse` attribute) take it: for
    engines that compile (never under enforce_eager, which runs no compiler at all)."""
    for module in model.modules():
        if hasattr(module, "fuse"):
            module.fuse = True
