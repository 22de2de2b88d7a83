"""What a request returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                      # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (its step raised) | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine's queues and KV pool."""
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swapped: int            # sequences whose blocks are in the second tier now
    num_swap_outs: int          # preemptions that swapped (the rest recomputed)
    num_free_swap_blocks: int   # second-tier slots free (all of them when nothing is swapped)
    prefix_cache_queries: int   # prompt tokens looked up
    prefix_cache_hits: int      # of those, found in the cache
    kv_slots_allocated: int     # token slots in blocks held by running sequences (0: not counted)
    kv_slots_used: int          # of those, holding a computed token
    # With several ranks: collectives issued so far, by kind (calls; bytes each rank put in)
    collective_calls: dict[str, int] = field(default_factory=dict)
    collective_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_waste(self) -> float:
        return 1 - self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 0.0


@dataclass
class RequestMetrics:
    """When a request reached each stage (time.monotonic() seconds), kept by the engine."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0  # over all its sequences


@dataclass
class FinishedRequestStats:
    finish_reason: str  # of its first sequence: "stop", "length", "abort" or "error"
    e2e_latency: float  # arrival to finish, seconds
    queue_time: float   # arrival to first scheduled (to finish, if it never was)
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step did, for metrics: the tokens it produced and the latencies it ended."""
    num_prompt_tokens: int = 0      # prompts of the requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)  # one per request that got a further token
    finished: list[FinishedRequestStats] = field(default_factory=list)
