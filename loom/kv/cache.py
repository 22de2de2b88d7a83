"""The paged KV pool: preallocated per-layer key and value blocks.

Layouts (per layer), chosen so the decode kernel reads one kv head's slice of a block as one
contiguous run:
  keys   [num_blocks, num_kv_heads, head_dim, block_size]   (transposed within a block)
  values [num_blocks, num_kv_heads, block_size, head_dim]
A token's slot is block_id * block_size + offset.
"""
from __future__ import annotations

import torch

from loom.config import EngineConfig


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype.itemsize


def kv_cache_blocks(config: EngineConfig, num_kv_heads: int | None = None, kv_shards: int = 1) -> tuple[int, int]:
    """(pool blocks, swap-tier blocks) for the engine's memory budgets, for a process storing
    `num_kv_heads` of every layer's KV heads (default: all) and every `kv_shards`-th block of
    each sequence. The pool never holds more than max_num_seqs full-length sequences could use,
    and at least one of them."""
    m, bs, max_len = config.model_config, config.cache.block_size, config.max_model_len
    per_block = kv_bytes_per_block(m.num_layers, num_kv_heads or m.num_kv_heads, m.head_dim, bs, config.dtype)
    blocks_per_seq = -(-max_len // (bs * kv_shards))
    budget = config.cache.budget_bytes()
    num_blocks = min(budget // per_block, config.scheduler.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes hold {num_blocks} blocks of {bs} tokens, but one sequence of "
            f"max_model_len {max_len} needs {blocks_per_seq}; raise kv_cache_memory or lower max_model_len")
    if config.scheduler.preemption_mode != "swap":
        return num_blocks, 0
    num_swap_blocks = config.cache.swap_space // per_block
    if num_swap_blocks < 1:
        raise ValueError(f"swap_space: {config.cache.swap_space} bytes hold no block of {per_block} bytes")
    return num_blocks, num_swap_blocks


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kernels = kernels  # eager writes and per-head moves by Loom's C++ ops (else plain PyTorch)
        # torch.empty: pages are touched only as blocks fill; no slot is read before it is written.
        # A tensor per layer (not views of one): compiled steps write them as separate inputs.
        self.keys = [torch.empty(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
                       for _ in range(num_layers)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at their slots: eager steps (prefill) by Loom's
        op, which writes each token's heads in place (half the time of the advanced indexing
        below); a compiled step by that indexing, which its compiler fuses."""
        if self.kernels and not torch.compiler.is_compiling():
            torch.ops.loom.write_kv(self.keys[layer], self.values[layer], k, v, slot_mapping)
            return
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        self.keys[layer][blocks, :, :, offsets] = k
        self.values[layer][blocks, :, offsets, :] = v

    def gather(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` cached tokens of one sequence as [kv_heads, length, head_dim]."""
        k = self.keys[layer][block_ids].permute(1, 0, 3, 2).flatten(1, 2)[:, :length]
        v = self.values[layer][block_ids].transpose(0, 1).flatten(1, 2)[:, :length]
        return k, v

    def move_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy single token slots src -> dst in every layer (all reads before any write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.keys[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.keys[0].device)
        bs = self.block_size
        for keys, values in zip(self.keys, self.values):
            keys[dst // bs, :, :, dst % bs] = keys[src // bs, :, :, src % bs]
            values[dst // bs, :, dst % bs] = values[src // bs, :, src % bs]

    def move(self, pairs: list[tuple[int, int]], head_moves: torch.Tensor | None) -> None:
        """A step's moves from dropped tokens: slots src -> dst in every layer and head (`pairs`),
        then single slots within one layer's kv head (`head_moves` [M, 4] as (layer, kv head,
        src slot, dst slot)); every read happens before any write, and a head move's write lands
        after a pair's into the same slot."""
        if head_moves is None or not head_moves.numel():
            self.move_slots(pairs)
        elif self.kernels:
            num_layers, num_kv_heads = len(self.keys), self.keys[0].shape[1]
            every = torch.cartesian_prod(torch.arange(num_layers), torch.arange(num_kv_heads))
            expanded = [torch.cat([every, torch.tensor([[s, d]]).expand(len(every), 2)], 1) for s, d in pairs]
            torch.ops.loom.move_head_slots(self.keys, self.values, torch.cat([*expanded, head_moves]))
        else:
            bs = self.block_size
            staged = []
            for layer, moves in enumerate(_by_layer(head_moves.to(self.keys[0].device), len(self.keys))):
                _, head, src, dst = moves.unbind(1)
                staged.append((layer, head, dst, self.keys[layer][src // bs, head, :, src % bs],
                               self.values[layer][src // bs, head, src % bs]))
            self.move_slots(pairs)
            for layer, head, dst, k, v in staged:
                self.keys[layer][dst // bs, head, :, dst % bs] = k
                self.values[layer][dst // bs, head, dst % bs] = v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        copy_blocks(pairs, self.keys, self.keys, self.values, self.values)


def _by_layer(moves: torch.Tensor, num_layers: int) -> list[torch.Tensor]:
    """Rows of [M, 4] (layer, ...) moves, grouped by layer (in their order within each)."""
    moves = moves[moves[:, 0].argsort(stable=True)]
    return moves.split(torch.bincount(moves[:, 0].cpu(), minlength=num_layers).tolist())


def copy_blocks(pairs: list[tuple[int, int]], src_keys: list[torch.Tensor], dst_keys: list[torch.Tensor],
                src_values: list[torch.Tensor], dst_values: list[torch.Tensor]) -> None:
    """For each (src, dst) pair, block src of every source layer into block dst of its
    destination layer; the pools may live on different devices (the swap tier)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    for sk, dk, sv, dv in zip(src_keys, dst_keys, src_values, dst_values):
        dk[dst.to(dk.device)] = sk[src.to(sk.device)].to(dk.device)
        dv[dst.to(dv.device)] = sv[src.to(sv.device)].to(dv.device)
