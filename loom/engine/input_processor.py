"""What a caller submits, turned into a validated Request: the prompt tokenized (or its token
ids checked), the sampling parameters checked against the model, and the request's first
sequence with its detokenizer and, for a seeded request, a generator per sample.

Nothing here touches the engine's state, so it runs on the caller's thread."""
from __future__ import annotations

import torch

from loom.config import EngineConfig
from loom.detokenizer import IncrementalDetokenizer
from loom.engine.beam_search import BeamState
from loom.engine.sequence import Request
from loom.engine.stop_checker import eos_token_ids
from loom.kv.block_manager import SlotMap
from loom.kv.policy import KVPolicy, check_kv_policy_ranks
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer

Prompt = str | dict


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.eos_token_ids = eos_token_ids(config.model_config, self.tokenizer)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # token ids, and optionally the text they came from
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt: the text of a dict prompt must be a string, got {type(text).__name__}")
            return text, list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"prompt: {self.config.model} has no tokenizer.json; pass {{'prompt_token_ids': [...]}}")
        if not prompt:
            raise ValueError("prompt: empty prompt")
        try:
            return prompt, self.tokenizer.encode(prompt)
        except Exception as error:  # the tokenizers library raises TypeError for a lone surrogate, say
            raise ValueError(f"prompt: cannot be tokenized ({type(error).__name__}: {error})") from error

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len, vocab = self.config.max_model_len, self.config.model_config.vocab_size
        if not token_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                             f"max_model_len {max_len}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: ids {bad_stop} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: stop strings need a tokenizer; {self.config.model} has none (use stop_token_ids)")

    def kv_policy(self, params: SamplingParams, num_prompt_tokens: int) -> KVPolicy | None:
        """The request's KV compression: its own fields, else the engine's."""
        cache = self.config.cache
        policy = KVPolicy.resolve(params.kv_policy or cache.kv_policy,
                                  cache.kv_budget if params.kv_budget is None else params.kv_budget, num_prompt_tokens,
                                  cache.kv_recent_ratio if params.kv_recent_ratio is None else params.kv_recent_ratio,
                                  params.max_tokens)
        if policy is not None:
            check_kv_policy_ranks(policy.name, self.config.parallel.world_size, self.config.parallel.shards_kv)
        return policy

    def request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """A validated request with its first sequence; a bad one raises ValueError."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        request = Request(request_id, text, token_ids, params, kv_policy=self.kv_policy(params, len(token_ids)))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, token_ids, params.skip_special_tokens)
        # One generator per output sequence, so each sample's tokens depend only on the seed
        # and its index, never on batch mates or preemptions; sample 0 equals the n = 1 sample.
        generators = [None if params.seed is None else
                      torch.Generator(device=self.config.device).manual_seed(params.seed + 7919 * k)
                      for k in range(params.n)]
        request.new_sequence(SlotMap(self.config.cache.block_size), detokenizer, generators)
        return request

    def beam_request(self, request_id: str, prompt: Prompt, beam_width: int, max_tokens: int,
                     length_penalty: float, ignore_eos: bool) -> Request:
        """A beam search (loom/engine/beam_search.py); its output lists the best `beam_width`
        hypotheses, best first."""
        if beam_width < 1:
            raise ValueError(f"beam_width: must be >= 1, got {beam_width}")
        if 2 * beam_width > self.config.model_config.vocab_size:
            raise ValueError(f"beam_width: {beam_width} needs 2 x {beam_width} candidate tokens, "
                             "more than the vocabulary")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        request = Request(request_id, text, token_ids, params, kv_policy=self.kv_policy(params, len(token_ids)))
        request.beam = BeamState(beam_width, max_tokens, length_penalty,
                                 set() if ignore_eos else set(self.eos_token_ids),
                                 self.tokenizer.decode if self.tokenizer is not None else None)
        request.new_sequence(SlotMap(self.config.cache.block_size), None, [None])
        return request
