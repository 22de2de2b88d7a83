"""KV-cache compression: which stored tokens a sequence keeps once its cache passes its budget.

A policy is chosen per engine (`LLM(kv_policy=..., kv_budget=...)`) and per request (the same
fields of SamplingParams, which win). The budget is a fraction of the prompt's tokens (a float in
(0, 1]) or a count of tokens (an int). A sequence's prompt is stored whole, then compressed once
it is all computed; from then on, after every step, the sequence keeps at most `budget` stored
tokens, so it never holds more than one block beyond its budget (the block of the next token).
The dropped tokens' memory is freed for real (`BlockManager.drop`); kept keys keep the rotary
positions they were computed at.

  full       keeps everything (the default)
  window     the `budget` most recent tokens
  streaming  the first NUM_SINKS tokens (the "attention sinks" of StreamingLLM) and the most
             recent budget - NUM_SINKS
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

KV_POLICIES = ("full", "window", "streaming")
NUM_SINKS = 4


def check_kv_policy(policy: object, budget: object) -> None:
    """Type and range of the two fields (None means "not set"); raises ValueError naming the field."""
    if policy is not None and policy not in KV_POLICIES:
        raise ValueError(f"kv_policy: must be one of {KV_POLICIES}, got {policy!r}")
    if budget is None:
        return
    is_count = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    is_fraction = isinstance(budget, float) and 0 < budget <= 1
    if not (is_count or is_fraction):
        raise ValueError(f"kv_budget: a fraction of the prompt (float in (0, 1]) or a token count (int >= 1), "
                         f"got {budget!r}")


@dataclass(frozen=True)
class KVPolicy:
    name: str
    budget: int  # stored tokens a sequence keeps after each step

    @classmethod
    def resolve(cls, name: str, budget: int | float | None, num_prompt_tokens: int) -> KVPolicy | None:
        """The policy of a request with this prompt length; None for `full`. Raises ValueError
        when the budget is missing or leaves the policy nothing to keep."""
        check_kv_policy(name, budget)
        if name == "full":
            return None
        if budget is None:
            raise ValueError(f"kv_budget: the {name} policy needs a budget (a fraction of the prompt or a token count)")
        tokens = budget if isinstance(budget, int) else max(1, round(budget * num_prompt_tokens))
        if name == "streaming" and tokens <= NUM_SINKS:
            raise ValueError(f"kv_budget: streaming keeps {NUM_SINKS} sink tokens and a recent window; a budget of "
                             f"{tokens} tokens ({budget!r} of a {num_prompt_tokens}-token prompt) leaves no window")
        return cls(name, tokens)

    def tokens_to_drop(self, positions: Sequence[int]) -> list[int]:
        """Stored indices to drop, given each stored token's position (stored order need not be
        position order: the block manager fills holes from the tail)."""
        excess = len(positions) - self.budget
        if excess <= 0:
            return []
        # Both policies drop the oldest tokens; streaming never drops a sink.
        first = NUM_SINKS if self.name == "streaming" else 0
        return heapq.nsmallest(excess, (i for i, p in enumerate(positions) if p >= first), key=positions.__getitem__)
