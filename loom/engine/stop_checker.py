"""When a sequence may stop and when it must: the one place that knows the EOS set, masks
EOS and stop ids until `min_tokens`, and checks stop ids, stop strings and length limits."""
from __future__ import annotations

from loom.detokenizer import find_stop
from loom.engine.sequence import Sequence
from loom.models.config import ModelConfig
from loom.tokenizer import Tokenizer


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The model's end-of-sequence ids: config.json's and generation_config.json's, plus the
    tokenizer's EOS token."""
    ids = set(model_config.eos_token_ids) | set(model_config.generation_eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class StopChecker:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def banned_token_ids(self, seq: Sequence) -> list[int]:
        """Ids the sampler must not draw this step: every stopping id until min_tokens exist."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def finish_reason(self, seq: Sequence, num_new_chars: int) -> str | None:
        """After a token was appended: "stop", "length" or None. A stop string found in the
        text cuts it there (keeping the string if asked) and becomes the stop reason."""
        p, token = seq.params, seq.output_token_ids[-1]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token if token in p.stop_token_ids else None
            return "stop"
        if p.stop and num_new_chars and len(seq.output_token_ids) >= p.min_tokens:
            hit = find_stop(seq.text, num_new_chars, p.stop)
            if hit is not None:
                at, stop = hit
                seq.text = seq.text[: at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
                seq.stop_reason = stop
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
