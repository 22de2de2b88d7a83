"""Quantizing a loaded model in place: every nn.Linear becomes a WeightOnlyLinear."""
from __future__ import annotations

from torch import nn
from tqdm import tqdm

from loom.quant.linear import WeightOnlyLinear
from loom.quant.quantize import check_options


def quantize_model(model: nn.Module, method: str, group_size: int, progress: bool = True,
                   symmetric: bool = False) -> None:
    """`symmetric`: int4 scales only, no zero points (int8 always is)."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:  # validate everything before changing anything
        check_options(method, group_size, linear.in_features, name)
    for name, linear in tqdm(targets, desc=f"Quantizing ({method})", unit="layer", disable=not progress):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                WeightOnlyLinear.from_linear(linear, method, group_size, symmetric=symmetric))
