"""Engine settings, as dataclasses validated on construction.

`EngineConfig` is what `LLM(...)` builds from its keyword arguments; the engine, scheduler,
block manager and model runner each read the part they own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_MEMORY = 4 << 30  # bytes; capped below by what max_num_seqs x max_model_len can use


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype: {name} is not supported (choose from {sorted(_DTYPES)})")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported (choose from {sorted(_DTYPES)})")
    return _DTYPES[name]


def cache_root() -> Path:
    """Where Loom keeps what it builds or measures once per machine (LOOM_CACHE overrides)."""
    return Path(os.environ.get("LOOM_CACHE", Path.home() / ".cache" / "loom"))


def available_memory_bytes() -> int:
    """Memory the OS could give us now (MemAvailable), falling back to free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class CacheConfig:
    block_size: int = 16
    # bytes (int > 1), or a fraction of the memory available now (float in (0, 1]); None = default
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    swap_space: int = 1 << 30  # bytes of second-tier KV storage, allocated in swap preemption mode

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size: must be 8, 16 or 32, got {self.block_size}")
        m = self.kv_cache_memory
        if m is not None and not (isinstance(m, float) and 0 < m <= 1) and not (isinstance(m, int) and m > 1):
            raise ValueError(f"kv_cache_memory: bytes (int > 1) or a fraction in (0, 1], got {m!r}")

    def budget_bytes(self) -> int:
        if self.kv_cache_memory is None:
            return min(DEFAULT_KV_CACHE_MEMORY, available_memory_bytes() // 2)
        if isinstance(self.kv_cache_memory, float):
            return int(self.kv_cache_memory * available_memory_bytes())
        return self.kv_cache_memory


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 0  # 0: the model's max_position_embeddings (set by the engine)
    preemption_mode: str = "recompute"  # or "swap": blocks move to the second tier (swap_space)

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    pack_linear_weights: bool = True  # panel-layout weights for Loom's CPU kernels (loom/layers/linear.py)
    quantization: str | None = None  # "int8" | "int4": quantize weights at load time
    group_size: int = 32             # int4 group size
    # Run every step eagerly. Otherwise decode-only steps (CPU, C++ attention) go through a
    # torch.compile'd forward: small ops fused, little Python per step. None: the value of the
    # environment variable LOOM_ENFORCE_EAGER ("1" = eager), else False.
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        if self.enforce_eager is None:
            self.enforce_eager = os.environ.get("LOOM_ENFORCE_EAGER", "0") == "1"
