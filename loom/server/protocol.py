"""The request bodies of the OpenAI-compatible API, with vLLM's extra sampling fields, and how
each becomes Loom's SamplingParams.

Every field may be sent as null, meaning its default. Fields this server does not know are
ignored, as OpenAI's clients send some (`user`, `logit_bias`) that change nothing here.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loom.sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    # Loom's: KV-cache compression (loom/kv/policy.py)
    kv_policy: str | None = None
    kv_budget: int | float | None = None
    kv_recent_ratio: float | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """Loom's parameters; a value out of range raises ValueError naming the field."""
        given = {name: getattr(self, name) for name in (
            "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
            "stop_token_ids", "kv_policy", "kv_budget", "kv_recent_ratio")}
        return SamplingParams(
            **{name: value for name, value in given.items() if value is not None},
            stop=self.stop or [], max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    return_token_ids: bool | None = False  # vLLM's: each choice (and chunk) also carries its token ids


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names: passed to the template as sent

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: content parts joined into one text."""
    out = []
    for message in messages:
        m = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            m["content"] = "\n".join(part.text for part in message.content)
        out.append(m)
    return out


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
