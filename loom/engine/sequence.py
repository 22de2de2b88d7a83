"""A sequence: one request's tokens, its block table and its progress through the engine."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from loom.detokenizer import IncrementalDetokenizer
from loom.engine.beam_search import BeamState
from loom.outputs import Logprob
from loom.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)  # second-tier slots while swapped out
    # Tokens whose K/V are in the cache (computed here or found in the prefix cache).
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of those, reused from the prefix cache at admission
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    finish_reason: str | None = None
    was_admitted: bool = False
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    index: int = 0  # which of the request's n outputs (or beams) this is
    generator: torch.Generator | None = None  # its own, when params.seed is given
    # n > 1, before the fork: the generators of all n samples (index 0 is this sequence's)
    sibling_generators: list[torch.Generator | None] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # output text (cut at a stop string)
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    beam_width: int = 0  # > 0: one of a beam search's live beams (preempted with its siblings)
    proposals: list[tuple[int, float]] | None = None  # beam: this step's top next tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_beam(self) -> bool:
        return self.beam_width > 0

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling priority: arrival, then output index (children of one request together)."""
        return (self.arrival, self.index)


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
    num_created: int = 0  # sequences made so far (each gets the next index)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs) and len(self.seqs) == self.params.n
