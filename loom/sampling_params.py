"""SamplingParams: what a request asks of decoding, in vLLM's names and semantics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy (deterministic)
    top_k: int = -1               # -1 (or 0) = all tokens
    top_p: float = 1.0            # nucleus mass, in (0, 1]
    min_p: float = 0.0            # drop tokens below min_p x the top token's probability
    seed: int | None = None       # per-request generator: the same tokens whatever the batch
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative ints, got {self.stop_token_ids}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
