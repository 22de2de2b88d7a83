"""The paged KV pool: preallocated per-layer key and value blocks.

Layouts (per layer), chosen so the decode kernel reads one kv head's slice of a block as one
contiguous run:
  keys   [num_blocks, num_kv_heads, head_dim, block_size]   (transposed within a block)
  values [num_blocks, num_kv_heads, block_size, head_dim]
A token's slot is block_id * block_size + offset.

The pool holds the model's dtype, or int8 (`kv_cache_dtype="int8"`): each token's kv head then
is an int8 row times one float32 scale (absmax: scale = max|x| / 127), the scales in pools of
their own in the same layouts with a head_dim of 1: each element within half a step (max|x| / 254)
of what was written, in about half the bytes of bf16 (a quarter of fp32) for decode attention to
read, which at large batch is bound by those reads.
"""
from __future__ import annotations

import torch

from loom.config import EngineConfig, check_kv_cache_dtype


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """A block's bytes over every layer, for a model of `dtype` (an int8 row's scale included)."""
    per_row = head_dim + 4 if kv_cache_dtype == "int8" else head_dim * dtype.itemsize
    return 2 * num_layers * num_kv_heads * block_size * per_row


_INV_127 = torch.tensor(1 / 127, dtype=torch.float32)


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> (int8 [T, KVH, D], float32 scales [T, KVH, 1]), as Loom's `quantize_kv`
    computes them: scale = max|x| * fl(1 / 127), q = round(x * (127 / max|x|)) (0 where max|x|
    is 0)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    # A tensor over a tensor: a number over a tensor is its reciprocal times the number, one rounding more.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv).clamp(-127, 127).to(torch.int8), amax * _INV_127


def kv_cache_blocks(config: EngineConfig, num_kv_heads: int | None = None, kv_shards: int = 1) -> tuple[int, int]:
    """(pool blocks, swap-tier blocks) for the engine's memory budgets, for a process storing
    `num_kv_heads` of every layer's KV heads (default: all) and every `kv_shards`-th block of
    each sequence. The pool never holds more than max_num_seqs full-length sequences could use,
    and at least one of them."""
    m, bs, max_len = config.model_config, config.cache.block_size, config.max_model_len
    per_block = kv_bytes_per_block(m.num_layers, num_kv_heads or m.num_kv_heads, m.head_dim, bs, config.dtype,
                                   config.cache.kv_cache_dtype)
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


def _pool(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    # torch.empty: pages are touched only as blocks fill; no slot is read before it is written.
    # A tensor per layer (not views of one): compiled steps write them as separate inputs.
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: bool = False,
                 kv_cache_dtype: str = "auto") -> None:
        check_kv_cache_dtype(kv_cache_dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype  # the model's: what attention reads the pool as
        self.kernels = kernels  # eager writes and per-head moves by Loom's C++ ops (else plain PyTorch)
        quantized = kv_cache_dtype == "int8"
        stored = torch.int8 if quantized else dtype
        self.keys = _pool(num_layers, (num_blocks, num_kv_heads, head_dim, block_size), stored, device)
        self.values = _pool(num_layers, (num_blocks, num_kv_heads, block_size, head_dim), stored, device)
        self.key_scales = _pool(num_layers, (num_blocks, num_kv_heads, 1, block_size), torch.float32, device) \
            if quantized else None
        self.value_scales = _pool(num_layers, (num_blocks, num_kv_heads, block_size, 1), torch.float32, device) \
            if quantized else None

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def pools(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Every (keys, values) pair of per-layer pools a slot has an entry in: the K/V rows, and
        an int8 pool's scales. Copies and moves of slots and blocks go over all of them."""
        pools = [(self.keys, self.values)]
        if self.quantized:
            pools.append((self.key_scales, self.value_scales))
        return pools

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's key and value scales (None, None for a pool of the model's dtype)."""
        if not self.quantized:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at their slots (quantized first for an int8
        pool): eager steps (prefill) by Loom's op, which writes each token's heads in place (half
        the time of the advanced indexing below); a compiled step by that indexing, which its
        compiler fuses."""
        rows = [(k, v)]
        if self.quantized:
            quantize = torch.ops.loom.quantize_kv if self.kernels else quantize_kv_reference
            (k, k_scales), (v, v_scales) = quantize(k), quantize(v)
            rows = [(k, v), (k_scales, v_scales)]
        for (keys, values), (k, v) in zip(self.pools(), rows):
            if self.kernels and not torch.compiler.is_compiling():
                torch.ops.loom.write_kv(keys[layer], values[layer], k, v, slot_mapping)
            else:
                blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
                keys[layer][blocks, :, :, offsets] = k
                values[layer][blocks, :, offsets, :] = v

    def gather(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` cached tokens of one sequence as [kv_heads, length, head_dim], in
        the model's dtype."""
        def rows(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k = keys[block_ids].permute(1, 0, 3, 2).flatten(1, 2)[:, :length]
            v = values[block_ids].transpose(0, 1).flatten(1, 2)[:, :length]
            return k, v

        k, v = rows(self.keys[layer], self.values[layer])
        if not self.quantized:
            return k, v
        k_scales, v_scales = rows(self.key_scales[layer], self.value_scales[layer])
        return (k.float() * k_scales).to(self.dtype), (v.float() * v_scales).to(self.dtype)

    def move_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy single token slots src -> dst in every layer (all reads before any write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.keys[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.keys[0].device)
        bs = self.block_size
        for pool_keys, pool_values in self.pools():
            for keys, values in zip(pool_keys, pool_values):
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
            moves = torch.cat([*expanded, head_moves])
            for keys, values in self.pools():
                torch.ops.loom.move_head_slots(keys, values, moves)
        else:
            bs = self.block_size
            staged = []
            for layer, moves in enumerate(_by_layer(head_moves.to(self.keys[0].device), len(self.keys))):
                _, head, src, dst = moves.unbind(1)
                staged += [(keys[layer], values[layer], head, dst, keys[layer][src // bs, head, :, src % bs],
                            values[layer][src // bs, head, src % bs]) for keys, values in self.pools()]
            self.move_slots(pairs)
            for keys, values, head, dst, k, v in staged:
                keys[dst // bs, head, :, dst % bs] = k
                values[dst // bs, head, dst % bs] = v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        for keys, values in self.pools():
            copy_blocks(pairs, keys, keys, values, values)


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
