"""Weights moved onto huge pages keep their values, their sharing and their holders."""
import mmap

import torch
from torch import nn

from loom.models.huge_pages import MIN_BYTES, move_to_huge_pages

ROWS = MIN_BYTES // (4 * 256)  # a [ROWS, 256] fp32 tensor is MIN_BYTES


class _Holder(nn.Module):
    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.shared = shared  # a parameter another module holds too (tied weights)
        self.register_buffer("table", torch.randn(ROWS, 256))
        self.packed = torch.randn(2 * ROWS, 256).to(torch.bfloat16)  # a plain attribute, as packed weights are
        self.small = torch.randn(16, 16)
        base = torch.randn(4 * ROWS, 256)
        self.base, self.view = base, base[ROWS:3 * ROWS]  # a view into another tensor stays one


def test_large_tensors_move_with_their_values_and_sharing() -> None:
    shared = nn.Parameter(torch.randn(ROWS, 256), requires_grad=False)
    model = nn.ModuleDict({"a": _Holder(shared), "b": nn.Linear(256, ROWS, bias=False)})
    model["b"].weight = shared  # tied: the same Parameter in two modules
    a = model["a"]
    before = {name: getattr(a, name).clone() for name in ("shared", "table", "packed", "small", "base", "view")}
    addresses = {name: getattr(a, name).data_ptr() for name in before}
    x = torch.randn(3, 256)
    y = model["b"](x)

    moved = move_to_huge_pages(model)

    for name, value in before.items():
        assert torch.equal(getattr(a, name), value), name
    assert moved == sum(before[name].numel() * before[name].element_size() for name in ("shared", "table", "packed"))
    for name in ("shared", "table", "packed"):  # each at least MIN_BYTES, the whole of its storage
        assert getattr(a, name).data_ptr() != addresses[name], name
    assert a.small.data_ptr() == addresses["small"]  # below MIN_BYTES
    assert a.view.data_ptr() == addresses["view"] and a.base.data_ptr() == addresses["base"]  # a view pins its base
    assert model["b"].weight is shared and a.shared is shared  # still one Parameter in both modules
    assert isinstance(a.shared, nn.Parameter) and "table" in a._buffers and "packed" not in a._buffers
    assert torch.equal(model["b"](x), y)


def test_nothing_to_move() -> None:
    assert move_to_huge_pages(nn.Linear(4, 4)) == 0


def test_moves_where_the_platform_has_no_huge_pages(monkeypatch) -> None:
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)  # as on a platform without the advice
    linear = nn.Linear(256, ROWS, bias=False)
    weight, address = linear.weight.detach().clone(), linear.weight.data_ptr()
    assert move_to_huge_pages(linear) == weight.numel() * 4
    assert linear.weight.data_ptr() != address and torch.equal(linear.weight, weight)
