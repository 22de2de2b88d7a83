"""KV-cache compression: which stored tokens a sequence keeps once its cache passes its budget.

A policy is chosen per engine (`LLM(kv_policy=..., kv_budget=...)`) and per request (the same
fields of SamplingParams, which win). The budget is a fraction of the prompt's tokens (a float in
(0, 1]) or a count of tokens (an int). A sequence's prompt is stored whole, then compressed once
it is all computed; from then on, after every step, the sequence keeps at most `budget` stored
tokens, so it never holds more than one block beyond its budget (the block of the next token).
The dropped tokens' memory is freed for real (`BlockManager.drop`, `BlockManager.drop_per_head`);
kept keys keep the rotary positions they were computed at, and dropped tokens never return.

  full       keeps everything (the default)
  window     the `budget` most recent tokens
  streaming  the first NUM_SINKS tokens (the "attention sinks" of StreamingLLM) and the most
             recent budget - NUM_SINKS
  h2o        per layer and kv head, the `recent` most recent tokens and the rest of the budget
             by attention accumulated over every prompt and decode query (Heavy-Hitter Oracle)
  keyformer  as h2o, but each query's contribution is softmax((x + g) / tau) of its logits x
             with fresh Gumbel noise g, tau rising from 1 to 2 over the request's max_tokens
  snapkv     the prompt, once, by the attention of its last SNAPKV_WINDOW queries pooled over
             neighbouring tokens, keeping that window; generated tokens are all kept, so its
             bound is the budget plus the tokens generated

The scored policies (h2o, keyformer, snapkv) keep a different set in each layer and kv head:
their per-head state is `HeadScores` (loom/kv/scores.py). `recent` is kv_recent_ratio x budget.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.kv.scores import lowest_unprotected

KV_POLICIES = ("full", "window", "streaming", "h2o", "keyformer", "snapkv")
SCORED_POLICIES = ("h2o", "keyformer", "snapkv")
# Those whose decode steps score too (snapkv scores its prompt's last queries only).
DECODE_SCORED_POLICIES = ("h2o", "keyformer")
NUM_SINKS = 4
SNAPKV_WINDOW = 32   # prompt queries whose attention chooses what SnapKV keeps
SNAPKV_POOL = 7      # tokens over which SnapKV averages scores, so neighbours of a hit stay too
TAU_INIT, TAU_END = 1.0, 2.0  # Keyformer's temperature schedule


def check_kv_policy(policy: object, budget: object, recent_ratio: object = None) -> None:
    """Type and range of the fields (None means "not set"); raises ValueError naming the field."""
    if policy is not None and policy not in KV_POLICIES:
        raise ValueError(f"kv_policy: must be one of {KV_POLICIES}, got {policy!r}")
    if recent_ratio is not None and not (isinstance(recent_ratio, (int, float)) and not isinstance(recent_ratio, bool)
                                         and 0 <= recent_ratio <= 1):
        raise ValueError(f"kv_recent_ratio: a fraction of the budget in [0, 1], got {recent_ratio!r}")
    if budget is None:
        return
    is_count = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    is_fraction = isinstance(budget, float) and 0 < budget <= 1
    if not (is_count or is_fraction):
        raise ValueError(f"kv_budget: a fraction of the prompt (float in (0, 1]) or a token count (int >= 1), "
                         f"got {budget!r}")


def check_kv_policy_ranks(policy: str, world_size: int, shards_kv: bool = False) -> None:
    """Scored policies keep per-head scores in one process: not yet with several ranks. Any
    drop moves tokens between blocks, which are on different ranks when the KV cache is split
    by sequence or by position (`shards_kv`)."""
    if world_size > 1 and policy in SCORED_POLICIES:
        raise ValueError(f"kv_policy: {policy} needs every KV head's scores in one process; it does not run "
                         "with tensor_parallel_size > 1 yet")
    if shards_kv and policy != "full":
        raise ValueError(f"kv_policy: {policy} drops tokens, which does not run with the KV cache split over "
                         "ranks (kv_parallel_size > 1 or attention_sharding='batch') yet; use 'full'")


@dataclass(frozen=True)
class KVPolicy:
    name: str
    budget: int  # stored tokens a sequence keeps after each step (snapkv: plus those it generated)
    recent: int = 0  # most recent tokens always kept (scored policies)
    max_tokens: int = 1  # the request's, for Keyformer's temperature schedule

    @classmethod
    def resolve(cls, name: str, budget: int | float | None, num_prompt_tokens: int, recent_ratio: float = 0.3,
                max_tokens: int = 1) -> KVPolicy | None:
        """The policy of a request with this prompt length; None for `full`. Raises ValueError
        when the budget is missing or leaves the policy nothing to keep."""
        check_kv_policy(name, budget, recent_ratio)
        if name == "full":
            return None
        if budget is None:
            raise ValueError(f"kv_budget: the {name} policy needs a budget (a fraction of the prompt or a token count)")
        tokens = budget if isinstance(budget, int) else max(1, round(budget * num_prompt_tokens))
        if name == "streaming" and tokens <= NUM_SINKS:
            raise ValueError(f"kv_budget: streaming keeps {NUM_SINKS} sink tokens and a recent window; a budget of "
                             f"{tokens} tokens ({budget!r} of a {num_prompt_tokens}-token prompt) leaves no window")
        recent = {"snapkv": min(SNAPKV_WINDOW, tokens), "h2o": round(recent_ratio * tokens),
                  "keyformer": round(recent_ratio * tokens)}.get(name, 0)
        return cls(name, tokens, recent, max(1, max_tokens))

    @property
    def scored(self) -> bool:
        return self.name in SCORED_POLICIES

    @property
    def noisy(self) -> bool:
        return self.name == "keyformer"

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt query's attention counts (so no prompt token may come from the
        prefix cache, where its query was never computed)."""
        return self.name in DECODE_SCORED_POLICIES

    def score_temperature(self, position: int, num_prompt_tokens: int) -> float:
        """The softmax temperature of the query at `position` for this policy's scores; 0 when
        that query does not score."""
        if self.name == "snapkv":
            return 1.0 if num_prompt_tokens - self.recent <= position < num_prompt_tokens else 0.0
        if self.name == "keyformer":  # the decode step t = position - num_prompt_tokens, from 0
            t = max(0, position - num_prompt_tokens)
            return TAU_INIT + t * (TAU_END - TAU_INIT) / self.max_tokens
        return 1.0

    def tokens_to_drop(self, positions: Sequence[int]) -> list[int]:
        """window / streaming: stored indices to drop, given each stored token's position (stored
        order need not be position order: the block manager fills holes from the tail)."""
        excess = len(positions) - self.budget
        if excess <= 0:
            return []
        # Both policies drop the oldest tokens; streaming never drops a sink.
        first = NUM_SINKS if self.name == "streaming" else 0
        return heapq.nsmallest(excess, (i for i, p in enumerate(positions) if p >= first), key=positions.__getitem__)

    def single_drop_newest(self, num_stored: int, last_position: int) -> int | None:
        """When the stored tokens exceed an h2o / keyformer budget by one (a decode step's drop,
        the common case), the newest position the dropped token may have (older tokens than the
        recent window); None for any other drop or none."""
        if self.name in DECODE_SCORED_POLICIES and num_stored - self.budget == 1:
            return last_position - self.recent
        return None

    def heads_to_drop(self, positions: torch.Tensor, scores: torch.Tensor, last_position: int,
                      num_prompt_tokens: int, found: tuple[int, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Scored policies: [L, KVH, k] stored indices each layer and kv head drops (the same
        count k in all), given each stored token's position and accumulated score [L, KVH, n];
        None when nothing is over the budget. `found`: (newest, lowest) of a single drop the
        decode kernel already found with the scores (`HeadScores.found`), used when it is this one."""
        if (newest := self.single_drop_newest(positions.shape[-1], last_position)) is not None:
            if found is not None and found[0] == newest:
                return found[1]
            return lowest_unprotected(scores, positions, newest)
        budget = self.budget
        if self.name == "snapkv":  # the prompt's window and every generated token stay
            budget += max(0, last_position + 1 - num_prompt_tokens)
        excess = positions.shape[-1] - budget
        if excess <= 0:
            return None
        if self.name == "snapkv":
            protected = positions >= num_prompt_tokens - self.recent
            # Pooled along positions: the prompt is compressed once, while stored order is position order.
            scores = F.avg_pool1d(scores, SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2, count_include_pad=False)
        else:
            protected = positions > last_position - self.recent
        return scores.masked_fill(protected, float("inf")).topk(excess, dim=-1, largest=False).indices
