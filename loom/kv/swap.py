"""The second memory tier for preempted sequences' KV blocks.

A GPU pool swaps to host memory (pinned, for fast copies); a CPU pool swaps to a memory-mapped
file, so swapped blocks leave RAM for the page cache and the disk. Blocks are copied whole, in
the pool's own layout, and come back bit for bit.
"""
from __future__ import annotations

import tempfile

import torch

from loom.kv.cache import KVCache, copy_blocks


class SwapSpace:
    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        k_shape = (num_blocks, *cache.keys[0].shape[1:])
        v_shape = (num_blocks, *cache.values[0].shape[1:])
        dtype, device = cache.keys[0].dtype, cache.keys[0].device
        layers = len(cache.keys)
        if device.type == "cpu":
            k_numel = num_blocks * k_shape[1] * k_shape[2] * k_shape[3]
            v_numel = num_blocks * v_shape[1] * v_shape[2] * v_shape[3]
            self._file = tempfile.NamedTemporaryFile(prefix="loom-swap-", suffix=".kv")  # removed when closed
            flat = torch.from_file(self._file.name, shared=True, size=layers * (k_numel + v_numel), dtype=dtype)
            flat = flat.view(layers, k_numel + v_numel)
            self.keys = [flat[i, :k_numel].view(k_shape) for i in range(layers)]
            self.values = [flat[i, k_numel:].view(v_shape) for i in range(layers)]
        else:
            self.keys = [torch.empty(k_shape, dtype=dtype, pin_memory=True) for _ in range(layers)]
            self.values = [torch.empty(v_shape, dtype=dtype, pin_memory=True) for _ in range(layers)]
        self.cache = cache

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies pool block -> swap block for each (pool, swap) pair."""
        copy_blocks(pairs, self.cache.keys, self.keys, self.cache.values, self.values)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies swap block -> pool block for each (swap, pool) pair."""
        copy_blocks(pairs, self.keys, self.cache.keys, self.values, self.cache.values)
