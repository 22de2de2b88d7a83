"""A request and its sequences: the tokens, the text and the progress of each output."""
from __future__ import annotations

import copy
import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from loom.detokenizer import IncrementalDetokenizer
from loom.engine.beam_search import BeamState
from loom.kv.block_manager import SlotMap
from loom.kv.policy import KVPolicy
from loom.kv.scores import HeadScores
from loom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loom.sampling_params import RequestOutputKind, SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    kv: SlotMap  # where its cached tokens are (the block manager's to change)
    # the request's, read at every step
    params: SamplingParams = field(init=False)
    prompt_token_ids: list[int] = field(init=False)
    index: int = 0  # which of the request's n outputs (or beams) this is
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V have been computed (here or found in the prefix cache): the position of
    # the next token to compute.
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of those, reused from the prefix cache at admission
    was_admitted: bool = False
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    # Its own generator per sample when the request has a seed. Before an n > 1 request forks
    # at the end of its prompt, one per sample (index 0 is this sequence's); one after.
    generators: list[torch.Generator | None] = field(default_factory=lambda: [None])
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # output text (cut at a stop string)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    proposals: list[tuple[int, float]] | None = None  # beam: this step's top next tokens
    kv_scores: HeadScores | None = None  # a scored KV policy's per-head state (the scheduler's)
    # what the last delta output covered
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def __post_init__(self) -> None:
        self.params, self.prompt_token_ids = self.request.params, self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def generator(self) -> torch.Generator | None:
        return self.generators[0]

    @property
    def num_samples(self) -> int:
        """Tokens to draw when this sequence's prompt completes: n before an n > 1 fork, else 1."""
        return len(self.generators)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_beam(self) -> bool:
        return self.request.beam is not None

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling priority: arrival, then output index (children of one request together)."""
        return (self.arrival, self.index)

    def append_token(self, token: int, logprobs: dict[int, Logprob] | None) -> int:
        """Adds a generated token; returns how many characters of text it completed."""
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token].logprob
        if self.detokenizer is None:
            return 0
        delta = self.detokenizer.append(token)
        self.text += delta
        return len(delta)

    def finish(self, reason: str) -> None:
        if reason != "stop" and self.detokenizer is not None:  # a stop string already cut the text
            self.text += self.detokenizer.finish()
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason
        self.request.num_finished += 1

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        """Its output so far, whole or (DELTA) what is new since the last call."""
        tokens, text, logprobs = self.output_token_ids, self.text, self.logprobs
        if kind is RequestOutputKind.DELTA:
            # Text that may still turn out to start a stop string is held back until it cannot.
            p = self.params
            hold = 0 if self.is_finished or not p.stop or p.include_stop_str_in_output else max(map(len, p.stop)) - 1
            end = max(self.num_sent_chars, len(text) - hold)
            tokens, text = tokens[self.num_sent_tokens:], text[self.num_sent_chars:end]
            logprobs = None if logprobs is None else logprobs[self.num_sent_tokens:]
            self.num_sent_tokens, self.num_sent_chars = len(self.output_token_ids), end
        else:
            tokens, logprobs = list(tokens), None if logprobs is None else list(logprobs)
        return CompletionOutput(index=self.index, text=text, token_ids=tokens, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason, logprobs=logprobs,
                                cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)


@dataclass(eq=False)
class Request:
    """One call's prompt and its n output sequences (or beams)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    beam: BeamState | None = None  # set for a beam search request; seqs are then its live beams
    kv_policy: KVPolicy | None = None  # KV compression of its sequences; None keeps every token
    num_created: int = 0  # sequences made so far (each gets the next index)
    num_finished: int = 0  # of its n samples
    aborted: bool = False
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once, in the first
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def finished(self) -> bool:
        if self.aborted:
            return True
        if self.beam is not None:
            return self.beam.done
        return self.num_finished == self.params.n

    def new_sequence(self, kv: SlotMap, detokenizer: IncrementalDetokenizer | None,
                     generators: list[torch.Generator | None]) -> Sequence:
        seq = Sequence(self, kv, index=self.num_created, generators=generators, detokenizer=detokenizer,
                       logprobs=[] if self.params.logprobs is not None else None)
        self.num_created += 1
        self.seqs.append(seq)
        return seq

    def fork(self, parent: Sequence, kv: SlotMap) -> Sequence:
        """A new sequence continuing `parent`: its tokens, text and KV (`kv`, shared blocks) so
        far. Forked from an n > 1 prompt it takes the next sample's generator."""
        child = copy.copy(parent)
        child.kv, child.index = kv, self.num_created
        child.output_token_ids = list(parent.output_token_ids)
        child.logprobs = None if parent.logprobs is None else list(parent.logprobs)
        child.detokenizer = None if parent.detokenizer is None else parent.detokenizer.fork()
        child.kv_scores = None if parent.kv_scores is None else parent.kv_scores.clone()
        child.generators = [parent.generators[child.index] if child.index < len(parent.generators) else None]
        self.num_created += 1
        self.seqs.append(child)
        return child

    def abort(self, reason: str = "abort") -> None:
        """Ends every unfinished sequence with `reason`: "abort" (the caller's), or "error" (a
        step that raised)."""
        self.aborted = True
        for seq in self.seqs:
            if not seq.is_finished:
                seq.finish(reason)

    def output(self) -> RequestOutput | None:
        """What the caller sees now, by the request's output kind; None when nothing is due."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.beam is not None and not self.aborted:
            if not finished:
                return None
            outputs = self.beam.completions()
        else:
            outputs = [s.completion(kind) for s in self.seqs]
        prompt_logprobs = None if kind is RequestOutputKind.DELTA and self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, finished=finished,
            num_cached_tokens=self.seqs[0].num_cached_prompt_tokens if self.seqs else 0,
            prompt_logprobs=prompt_logprobs)
