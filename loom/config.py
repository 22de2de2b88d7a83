"""Engine settings, as dataclasses validated on construction.

`EngineConfig` is what `LLM(...)` builds from its keyword arguments; the engine, scheduler,
block manager and model runner each read the part they own. Building it reads the model's
`config.json` (once: everyone else uses `EngineConfig.model_config`) and resolves what depends
on the model, such as `max_model_len`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loom.kv.policy import check_kv_policy, check_kv_policy_ranks
from loom.models.config import ModelConfig

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


KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    # bytes (int > 1), or a fraction of the memory available now (float in (0, 1]); None = default
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    swap_space: int = 1 << 30  # bytes of second-tier KV storage, allocated in swap preemption mode
    # KV-cache compression for requests that do not choose theirs (loom/kv/policy.py)
    kv_policy: str = "full"
    kv_budget: int | float | None = None
    kv_recent_ratio: float = 0.3
    # What the pool stores: "auto" (the model's dtype) or "int8" (a scale per token and kv head;
    # loom/kv/cache.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_policy(self.kv_policy, self.kv_budget, self.kv_recent_ratio)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_policy != "full" and self.kv_budget is None:
            raise ValueError(f"kv_budget: the {self.kv_policy} policy needs a budget (a fraction of the prompt "
                             "or a token count)")
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
    max_model_len: int = 0  # 0: the model's max_position_embeddings (resolved by EngineConfig)
    preemption_mode: str = "recompute"  # or "swap": blocks move to the second tier (swap_space)
    # Decode steps run at once, where every row takes its argmax and nothing waits to be admitted:
    # the engine's per-step Python is paid once for them; their tokens arrive together.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps: must be >= 1, got {self.num_scheduler_steps}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")


ATTENTION_BACKENDS = ("cpp", "torch")
ATTENTION_SHARDINGS = ("heads", "batch")
FFN_LAYOUTS = ("1d", "2d")
ALL_REDUCES = ("auto", "shared_memory", "process_group")


@dataclass
class ParallelConfig:
    """How one engine spans ranks of torch.distributed (started by torchrun): rank 0 schedules,
    every rank runs the model on its shard (loom/parallel)."""
    tensor_parallel_size: int = 1
    kv_parallel_size: int = 1         # Helix: each sequence's KV split by position over these ranks
    attention_sharding: str = "heads"  # or "batch": decode attention sharded by sequence
    # How activations are all-reduced: "shared_memory" (every rank on one host, CPU), "process_group"
    # (gloo / NCCL), or "auto": shared memory where it can, else the process group
    all_reduce: str = "auto"
    # The FFN's layout: "1d" weight-stationary (Megatron), or "2d" (PaLM's: weights split along
    # both the model and the FFN dimension over a grid of X x YZ ranks, X the largest divisor
    # of the world size at most its square root)
    ffn_layout: str = "1d"
    # Helix's HOP-B: attention in items (decode halves, prefill chunks), each item's all-to-all
    # overlapped with the next item's attention
    hop_b: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "kv_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce: {self.all_reduce!r}, choose from {ALL_REDUCES}")
        if self.attention_sharding not in ATTENTION_SHARDINGS:
            raise ValueError(f"attention_sharding: {self.attention_sharding!r}, choose from {ATTENTION_SHARDINGS}")
        if self.ffn_layout not in FFN_LAYOUTS:
            raise ValueError(f"ffn_layout: {self.ffn_layout!r}, choose from {FFN_LAYOUTS}")
        if self.ffn_layout == "2d" and (self.ffn_grid[0] < 2 or self.kv_parallel_size > 1
                                        or self.attention_sharding != "heads"):
            raise ValueError(f"ffn_layout: '2d' needs a grid of at least 2 x 2 tensor-parallel ranks (here "
                             f"{self.world_size} ranks), without kv_parallel_size or attention_sharding='batch'")
        if self.hop_b and self.kv_parallel_size == 1:
            raise ValueError("hop_b: overlaps Helix's all-to-all; it needs kv_parallel_size > 1")
        if self.attention_sharding == "batch" and self.kv_parallel_size > 1:
            raise ValueError("attention_sharding: 'batch' shards attention over the tensor-parallel ranks; it does "
                             "not combine with kv_parallel_size > 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.kv_parallel_size

    @property
    def ffn_grid(self) -> tuple[int, int]:
        """(X, YZ) of the FFN's layout: X = 1 for 1D."""
        if self.ffn_layout == "1d":
            return 1, self.world_size
        x = max(d for d in range(1, int(self.world_size ** 0.5) + 1) if self.world_size % d == 0)
        return x, self.world_size // x

    @property
    def shards_kv(self) -> bool:
        """Whether ranks hold different sequences' (or tokens') KV, not only different heads."""
        return self.world_size > 1 and (self.kv_parallel_size > 1 or self.attention_sharding == "batch")

    def check_model(self, m: ModelConfig) -> None:
        """Fails before any weight loads when the model cannot be split this way. Attention heads
        split over tensor_parallel_size ranks (with KV parallelism, Helix's TPA), and again over
        the kv_parallel_size ranks after the attention; the FFN over all of them."""
        tp, world = self.tensor_parallel_size, self.world_size
        ranks = f"tensor_parallel_size {tp} x kv_parallel_size {self.kv_parallel_size}" if world > tp else \
            f"tensor_parallel_size: {tp}"
        if m.num_heads % world:
            raise ValueError(f"{ranks} must divide the model's {m.num_heads} attention heads")
        if m.num_kv_heads % tp and tp % m.num_kv_heads:
            raise ValueError(f"tensor_parallel_size: {tp} must divide the model's {m.num_kv_heads} KV heads or be a "
                             "multiple of them (then each rank keeps the KV heads its query heads read)")
        if m.intermediate_size % world:
            raise ValueError(f"{ranks} must divide the model's intermediate_size {m.intermediate_size}")
        if self.ffn_layout == "2d" and m.architecture == "GPTNeoXForCausalLM":
            raise ValueError(f"ffn_layout: '2d' runs the Llama family's FFN; not {m.architecture} yet")
        if self.ffn_layout == "2d" and m.hidden_size % world:
            raise ValueError(f"ffn_layout: '2d' splits the model's hidden_size {m.hidden_size} over all {world} ranks, "
                             "which must divide it")


def default_enforce_eager() -> bool:
    """LOOM_ENFORCE_EAGER=1 in the environment runs every step eagerly."""
    return os.environ.get("LOOM_ENFORCE_EAGER", "0") == "1"


@dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Each linear layer runs the kernel its dispatch plan names for the step's tokens (loom/layers/dispatch.py);
    # False: torch's F.linear always.
    linear_dispatch: bool = True
    quantization: str | None = None  # "int8" | "int4": quantize weights at load time
    group_size: int = 32             # int4 group size
    # int4 with a scale per group and no zero point (w = (q - 8) * scale, llama.cpp's Q4_0): 10%
    # fewer bytes than scales and zeros at group 32, for a coarser fit of each group.
    symmetric: bool = False
    # "cpp" (Loom's kernel over the paged pool, CPU) or "torch" (plain PyTorch, any device: the
    # reference); None picks cpp on CPU, torch elsewhere.
    attention_backend: str | None = None
    # Run every step eagerly. Otherwise decode-only steps (CPU, C++ attention) go through a
    # torch.compile'd forward: small ops fused, little Python per step. None: the value of the
    # environment variable LOOM_ENFORCE_EAGER ("1" = eager), else False.
    enforce_eager: bool | None = None
    model_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        if self.enforce_eager is None:
            self.enforce_eager = default_enforce_eager()
        if self.attention_backend is None:
            self.attention_backend = "cpp" if torch.device(self.device).type == "cpu" else "torch"
        from loom.quant.quantize import check_symmetric  # here: the quantizer's modules import this one

        check_symmetric(self.quantization, self.symmetric)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {self.attention_backend!r}, choose from {ATTENTION_BACKENDS}")
        self.model_config = ModelConfig.from_dir(self.model)
        self.parallel.check_model(self.model_config)
        if self.parallel.kv_parallel_size > 1 and self.attention_backend != "cpp":
            raise ValueError("kv_parallel_size: KV parallelism needs attention_backend 'cpp' (its partial "
                             "attention's log-sum-exp)")
        if self.parallel.shards_kv and self.scheduler.preemption_mode == "swap":
            raise ValueError("preemption_mode: swap does not run with the KV cache split over ranks "
                             "(kv_parallel_size > 1 or attention_sharding='batch') yet; use 'recompute'")
        check_kv_policy_ranks(self.cache.kv_policy, self.parallel.world_size, self.parallel.shards_kv)
        if self.parallel.hop_b:
            from loom.parallel.helix import max_item_rows  # (it imports this module)

            m, tpa = self.model_config, self.parallel.tensor_parallel_size
            rows = max_item_rows(m.num_heads // tpa, m.head_dim, self.dtype.itemsize)
            if self.scheduler.max_num_seqs - self.scheduler.max_num_seqs // 2 > rows:
                raise ValueError(f"max_num_seqs: hop_b exchanges half of a step's decodes at once, and one exchange "
                                 f"carries at most {rows} rows of this model's heads; use max_num_seqs <= {2 * rows}")
        if self.quantization is not None and self.model_config.quantization is not None:
            raise ValueError(f"quantization: {self.model} is already quantized "
                             f"({self.model_config.quantization['method']}); load it without quantization=")
        sched, max_positions = self.scheduler, self.model_config.max_position_embeddings
        if sched.max_model_len <= 0:
            sched.max_model_len = max_positions
        elif sched.max_model_len > max_positions:
            raise ValueError(f"max_model_len: {sched.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_positions}")
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < sched.max_model_len:
            raise ValueError(f"max_num_batched_tokens: {sched.max_num_batched_tokens} < max_model_len "
                             f"{sched.max_model_len}; without chunked prefill a whole prompt must fit one step")

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len
