"""Elementwise layer math (norms, rotary embedding, gated activations): plain PyTorch, or Loom's
C++ operator of the same math.

Prefill and mixed steps run eagerly, their shapes varying from step to step. There each small op
of the plain functions is a pass over the step's activations, some over strided views (q and k
are slices of one projection): for a 2047-token prompt of the 134M reference model in fp32, about
25 ms a layer. Loom's operators (loom/kernels/elementwise.cpp) do each function in one pass,
rounded as the compiled decode graphs round: about 3.7 ms a layer, where the same functions
compiled by inductor for any number of tokens took 6.4, and their guards and wrappers another
0.2 ms a call besides a compile at first use. A compiled decode step traces the plain function
instead, into its own graph. Layers take the operators where their engine runs Loom's kernels
(`use_kernels`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

Fn = TypeVar("Fn", bound=Callable)


def with_kernel(op: str) -> Callable[[Fn], Fn]:
    """Decorates `fn` into `fn(*args, kernel=False)`: `fn` as it is, or with `kernel=True` outside
    a compiled step, Loom's operator `torch.ops.loom.<op>` on the same arguments."""
    def decorate(fn: Fn) -> Fn:
        @functools.wraps(fn)
        def call(*args, kernel: bool = False):
            if kernel and not torch.compiler.is_compiling():
                return getattr(torch.ops.loom, op)(*args)
            return fn(*args)

        return call  # type: ignore[return-value]

    return decorate


def use_kernels(model: nn.Module) -> None:
    """Lets every layer of `model` with an operator of its math (a `kernel` attribute) run it in
    eager steps: for models whose engine has built Loom's kernels."""
    for module in model.modules():
        if hasattr(module, "kernel"):
            module.kernel = True
