"""Token sampling for a batch of rows, each with its own SamplingParams.

Per row, in vLLM's order: penalties on the raw logits (repetition over prompt and output,
presence and frequency over the output), EOS/stop ids masked until min_tokens, the request's
logits processors, then greedy
argmax, or temperature, top-k, top-p and min-p followed by an exponential race, which draws
exactly from the masked softmax: argmax(p / E) with E ~ Exp(1) i.i.d. A row with a seed draws
its noise from its own generator, so its tokens do not depend on its batch mates. Logprobs are
those of the raw model distribution (log_softmax of the logits), as HF and vLLM report them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom.outputs import Logprob
from loom.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generators: list[torch.Generator | None]  # one per draw (n > 1: one per child forked from the row)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]   # masked this step (min_tokens not reached yet)
    num_proposals: int = 0        # beam search: the row's top tokens by logprob instead of a draw

    @property
    def num_samples(self) -> int:
        return len(self.generators)

    @property
    def takes_argmax(self) -> bool:
        """Whether the row's token is its logits' argmax as they came from the model: greedy, with
        nothing that changes its logits and no logprobs or proposals to compute."""
        return self.params.takes_argmax and not self.banned_token_ids and not self.num_proposals


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per sampled token
    proposals: list[tuple[int, float]] | None = None  # beam search: (token, logprob), best first


@dataclass
class SeqStepOutput:
    """What one step produced for one sequence."""
    sample: SampleResult | None = None    # None while the sequence is mid-prompt
    later_samples: Sequence[SampleResult] = ()  # several decode steps at once: the later steps', in order
    # (position, {token: Logprob}) for the prompt tokens this step scored
    prompt_logprobs: list[tuple[int, dict[int, Logprob]]] | None = None


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 argmax: list[int] | None = None) -> list[SampleResult]:
        """logits [R, V] (float32, or the model's dtype, widened here where needed), one row per
        SampleRow -> one result per row. `argmax`: each row's first largest logit, where the
        caller has it (greedy rows whose logits no penalty or processor changes take it)."""
        if argmax is not None and all(r.takes_argmax for r in rows):  # a greedy batch's usual step
            return [SampleResult(token_ids=[token]) for token in argmax]
        logits = logits.float()
        needs_logprobs = any(r.params.logprobs is not None or r.num_proposals for r in rows)
        raw_logprobs = logits.log_softmax(dim=-1) if needs_logprobs else None
        raw = logits
        logits = apply_logits_processors(apply_penalties(logits, rows), rows)
        results = [SampleResult(token_ids=[]) for _ in rows]
        for i, r in enumerate(rows):
            if r.num_proposals:
                values, ids = raw_logprobs[i].topk(r.num_proposals)
                results[i].proposals = list(zip(ids.tolist(), values.tolist()))
        greedy = [i for i, r in enumerate(rows) if r.params.greedy and not r.num_proposals]
        if greedy:
            if argmax is not None and logits is raw:  # the logits as they came: their argmax holds
                chosen = [argmax[i] for i in greedy]
            else:
                chosen = first_argmax(logits if len(greedy) == len(rows) else logits[greedy])
            for i, tok in zip(greedy, chosen):
                results[i].token_ids = [tok]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            expanded = [(i, g) for i in sampled for g in rows[i].generators]
            probs = filtered_probs(logits[[i for i, _ in expanded]], [rows[i].params for i, _ in expanded])
            noise = torch.empty_like(probs)
            for k, (_, g) in enumerate(expanded):
                noise[k].exponential_(generator=g if g is not None else self.generator)
            for (i, _), tok in zip(expanded, first_argmax(probs / noise)):
                results[i].token_ids.append(tok)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is not None:
                    results[i].logprobs = [top_logprobs(raw_logprobs[i], tok, r.params.logprobs)
                                           for tok in results[i].token_ids]
        return results


def first_argmax(x: torch.Tensor) -> list[int]:
    """Per row, the index of the first largest value (argmax's answer). On CPU by numpy's
    single-threaded scan: 2 us over 32000 fp32 logits, where torch's reductions (max with
    indices, argmax) took 18-20, the cost of their parallel launch over so few rows."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.numpy().argmax(axis=-1).tolist()
    return x.max(dim=-1).indices.tolist()


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    if not any(r.params.has_penalties or r.banned_token_ids for r in rows):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        p = r.params
        if p.has_penalties:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            if p.repetition_penalty != 1:
                seen = counts > 0
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
                row = logits[i]
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, penalized, row)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if r.banned_token_ids:
            logits[i, r.banned_token_ids] = float("-inf")
    return logits


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    if not any(r.params.logits_processors for r in rows):
        return logits
    logits = logits.clone()
    for i, r in enumerate(rows):
        for processor in r.params.logits_processors or ():
            logits[i] = processor(r.output_token_ids, logits[i])
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by top-k, top-p
    and min-p (renormalized), as vLLM defines them. Rows must have temperature > 0."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1)
    # min-p: relative to the most likely token
    drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def top_logprobs(logprobs: torch.Tensor, chosen: int, n: int) -> dict[int, Logprob]:
    """The chosen token's logprob and the n most likely tokens', each with its rank (1 = best)."""
    values, ids = logprobs.topk(n) if n else (logprobs[:0], logprobs[:0].long())
    chosen_lp = logprobs[chosen]
    out = {chosen: Logprob(float(chosen_lp), int((logprobs > chosen_lp).sum()) + 1)}
    for rank, (tok, lp) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
        out.setdefault(tok, Logprob(lp, rank))
    return out
