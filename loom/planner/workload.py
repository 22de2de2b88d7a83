"""What is being served: batch, sequence lengths, dtypes and the latency target."""
from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of each storage dtype the planner knows.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5, "fp4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class Workload:
    batch: int
    input_len: int
    output_len: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"
    latency_target_s: float | None = None  # total (prefill + decode) latency budget
    overlap: bool = False                  # communication hidden behind compute/memory
    memory_fraction: float = 0.9           # share of chip memory usable by weights + KV

    def __post_init__(self) -> None:
        for name in ("weight_dtype", "kv_dtype", "act_dtype"):
            dtype_bytes(getattr(self, name))
        if self.batch < 1 or self.input_len < 0 or self.output_len < 0:
            raise ValueError("batch must be >= 1 and lengths >= 0")

    @property
    def decode_context(self) -> float:
        """Mean number of cached tokens attended during decode."""
        return self.input_len + self.output_len / 2
