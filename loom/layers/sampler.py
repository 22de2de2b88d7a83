"""Token sampling for a batch of rows, each with its own SamplingParams.

Greedy rows take the argmax. The others go through temperature, then top-k, top-p and min-p
masks (applied on the sorted distribution), then an exponential race, which draws exactly from
the masked softmax: argmax(p / E) with E ~ Exp(1) i.i.d. A row with a seed draws its noise from
its own generator, so its tokens do not depend on its batch mates.
"""
from __future__ import annotations

import torch

from loom.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [B, V] float32 -> one token id per row."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sampled = self._sample(logits[idx], [params[i] for i in rows], [generators[i] for i in rows])
            tokens[idx] = sampled
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        probs = filtered_probs(logits, params)
        noise = torch.empty_like(probs)
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g if g is not None else self.generator)
        return (probs / noise).argmax(dim=-1)


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
