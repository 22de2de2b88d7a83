"""The second memory tier for preempted sequences' KV blocks.

A GPU pool swaps to host memory (pinned, for fast copies); a CPU pool swaps to a memory-mapped
file, so swapped blocks leave RAM for the page cache and the disk. Blocks are copied whole, in
the pool's own layout (an int8 pool's scales with them), and come back bit for bit.
"""
from __future__ import annotations

import tempfile
from typing import IO

import torch

from loom.kv.cache import KVCache, copy_blocks


class SwapSpace:
    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = cache
        self._files: list[IO[bytes]] = []  # each removed when closed
        self.pools = [self._tier(keys, values) for keys, values in cache.pools()]

    def _tier(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Swap blocks for one (keys, values) pair of the cache's per-layer pools."""
        k_shape = (self.num_blocks, *keys[0].shape[1:])
        v_shape = (self.num_blocks, *values[0].shape[1:])
        dtype, device, layers = keys[0].dtype, keys[0].device, len(keys)
        if device.type != "cpu":
            return ([torch.empty(k_shape, dtype=dtype, pin_memory=True) for _ in range(layers)],
                    [torch.empty(v_shape, dtype=dtype, pin_memory=True) for _ in range(layers)])
        k_numel, v_numel = torch.Size(k_shape).numel(), torch.Size(v_shape).numel()
        file = tempfile.NamedTemporaryFile(prefix="loom-swap-", suffix=".kv")
        self._files.append(file)
        flat = torch.from_file(file.name, shared=True, size=layers * (k_numel + v_numel), dtype=dtype)
        flat = flat.view(layers, k_numel + v_numel)
        return ([flat[i, :k_numel].view(k_shape) for i in range(layers)],
                [flat[i, k_numel:].view(v_shape) for i in range(layers)])

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies pool block -> swap block for each (pool, swap) pair."""
        for (keys, values), (swap_keys, swap_values) in zip(self.cache.pools(), self.pools):
            copy_blocks(pairs, keys, swap_keys, values, swap_values)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies swap block -> pool block for each (swap, pool) pair."""
        for (keys, values), (swap_keys, swap_values) in zip(self.cache.pools(), self.pools):
            copy_blocks(pairs, swap_keys, keys, swap_values, values)
