"""Incremental detokenization: text grows token by token, never emitting half a character.

Each step decodes only a short window: the tokens since the last emitted text plus a few
before them for context (a tokenizer may render a token differently at the start of a
string). New text is emitted only when it does not end in U+FFFD, the mark of an incomplete
UTF-8 sequence; `finish` flushes whatever is left. The concatenation of everything emitted
equals decoding all the ids at once.
"""
from __future__ import annotations

import copy

from loom.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.num_context = len(context)
        self.prefix_offset = 0              # window start: context kept for consistent rendering
        self.read_offset = len(context)     # ids before this are already emitted as text
        self.text = ""

    def fork(self) -> "IncrementalDetokenizer":
        twin = copy.copy(self)
        twin.ids = list(self.ids)
        return twin

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the newly completed text (maybe empty)."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """Emits any held-back tail (for example an invalid byte sequence the model produced)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(prefix) or (window.endswith("\ufffd") and not final):
            return ""
        delta = window[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    @property
    def output_token_ids(self) -> list[int]:
        return self.ids[self.num_context:]


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last `num_new_chars` characters, as
    (index where it starts, the string); only the tail can hold a match that is new."""
    longest = max(map(len, stops))
    start = max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
