"""SamplingParams: what a request asks of decoding, in vLLM's names and semantics."""
from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loom.kv.policy import check_kv_policy

MAX_LOGPROBS = 20        # top-N logprobs a request may ask for (per token)
MAX_STOP_STRINGS = 32
MAX_N = 64


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds everything generated so far
    DELTA = "delta"            # every output holds what is new since the last one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


_FIELD_KINDS = {
    "n": "int", "temperature": "real", "top_k": "int", "top_p": "real", "min_p": "real",
    "repetition_penalty": "real", "presence_penalty": "real", "frequency_penalty": "real", "seed": "int?",
    "max_tokens": "int", "min_tokens": "int", "stop": "strs", "stop_token_ids": "ints",
    "include_stop_str_in_output": "bool", "ignore_eos": "bool", "logprobs": "int?", "prompt_logprobs": "int?",
    "skip_special_tokens": "bool", "output_kind": "kind", "logits_processors": "callables?",
}

# (the tokens generated so far, the row's logits [V] after penalties) -> the logits to sample from
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingParams:
    n: int = 1                    # parallel samples, forked from one prefill (sharing its blocks)
    temperature: float = 1.0      # 0 = greedy (deterministic)
    top_k: int = -1               # -1 (or 0) = all tokens
    top_p: float = 1.0            # nucleus mass, in (0, 1]
    min_p: float = 0.0            # drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0   # > 1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0     # subtracted once from tokens present in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    seed: int | None = None       # per-request generator: the same tokens whatever the batch
    max_tokens: int = 16
    min_tokens: int = 0           # EOS and stop ids are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)   # stop strings, matched across token boundaries
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # the same for every prompt token
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what the engine's step outputs carry
    # KV-cache compression (loom/kv/policy.py); None takes the engine's setting
    kv_policy: str | None = None       # "full", "window", "streaming", "h2o", "keyformer", "snapkv"
    kv_budget: int | float | None = None  # tokens kept: a fraction of the prompt (float) or a count (int)
    kv_recent_ratio: float | None = None  # of the budget, the most recent tokens h2o and keyformer always keep
    # Python API only: applied in order to each step's logits before the token is chosen (not to
    # beam search's proposals); logprobs stay the raw model's, so a processor that forces a token
    # gives that token's logprob under the model (teacher forcing)
    logits_processors: list[LogitsProcessor] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        check_kv_policy(self.kv_policy, self.kv_budget, self.kv_recent_ratio)
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        checks = [
            (1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]", self.n),
            (self.temperature >= 0, "temperature", "must be >= 0", self.temperature),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p),
            (self.top_k >= -1, "top_k", "must be -1 (disabled) or >= 0", self.top_k),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty),
            (self.max_tokens is not None and self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens),
            (0 <= self.min_tokens <= (self.max_tokens or 0), "min_tokens", "must be in [0, max_tokens]",
             self.min_tokens),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings", len(self.stop)),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative ints", self.stop_token_ids),
            (self.seed is None or -2**63 <= self.seed < 2**63, "seed", "must fit in 64 bits", self.seed),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_LOGPROBS}]", self.logprobs),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"must be in [0, {MAX_LOGPROBS}]", self.prompt_logprobs),
            (not (self.n > 1 and self.temperature == 0), "n", "n > 1 needs temperature > 0 (greedy samples "
             "would all be identical; use LLM.beam_search for several best sequences)", self.n),
        ]
        for ok, name, rule, value in checks:
            if not ok:
                raise ValueError(f"{name}: {rule}, got {value!r}")

    def _check_types(self) -> None:
        """Every field's type, before any range check compares it: a float top_k or a string
        seed is refused here rather than failing later inside a step."""
        def is_int(v: object) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        kinds = {"int": (is_int, "an int"), "int?": (lambda v: v is None or is_int(v), "an int or None"),
                 "real": (is_real, "a finite number"), "bool": (lambda v: isinstance(v, bool), "a bool"),
                 "strs": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                          "a list of strings"),
                 "ints": (lambda v: isinstance(v, (list, tuple)) and all(is_int(x) for x in v), "a list of ints"),
                 "kind": (lambda v: isinstance(v, RequestOutputKind), "a RequestOutputKind"),
                 "callables?": (lambda v: v is None or isinstance(v, (list, tuple)) and all(callable(f) for f in v),
                                "a list of callables or None")}
        for name, kind in _FIELD_KINDS.items():
            ok, what = kinds[kind]
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"{name}: must be {what}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def takes_argmax(self) -> bool:
        """Whether a token is the argmax of the logits as the model gives them (once min_tokens no
        longer masks stop ids): greedy, with no penalty, processor or logprobs."""
        return self.greedy and not self.has_penalties and not self.logits_processors and self.logprobs is None
