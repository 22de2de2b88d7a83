"""Model quality measured through Loom's own engine: held-out loss per character (prompt
logprobs), needle retrieval (greedy), and greedy agreement between two engines."""
from __future__ import annotations

import random
from pathlib import Path

from loom import LLM, SamplingParams
from loom.bench.needles import character_names, make_needle_sample

HELDOUT_FRACTION = 0.1  # the house model's training script holds out the corpus's last 10%


def split_corpus(corpus: Path) -> tuple[str, str]:
    text = corpus.read_text()
    cut = int(len(text) * (1 - HELDOUT_FRACTION))
    return text[:cut], text[cut:]


def nats_per_char(llm: LLM, text: str) -> float:
    """Total token NLL of `text` / its characters, scored in windows that each start with BOS
    and fill the context (leaving the one position the engine must generate)."""
    tok = llm.get_tokenizer()
    bos = tok.encode("")  # the tokenizer's own BOS prefix
    ids = tok.encode(text, add_special_tokens=False)
    span = llm.engine.config.scheduler.max_model_len - 1 - len(bos)
    windows = [{"prompt_token_ids": bos + ids[i:i + span]} for i in range(0, len(ids), span)]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    total = 0.0
    for window, out in zip(windows, outs):
        for pos in range(len(bos), len(window["prompt_token_ids"])):
            total -= out.prompt_logprobs[pos][window["prompt_token_ids"][pos]].logprob
    return total / len(text)


def needle_accuracy(llm: LLM, train_text: str, heldout_text: str, contexts: list[int], per_context: int,
                    seed: int = 1234) -> dict[int, float]:
    """Exact answers (' NNNNN.') over fresh needles hidden in held-out text, greedy."""
    tok = llm.get_tokenizer()
    lines = [line for line in heldout_text.split("\n")]
    names = character_names(train_text)
    rng = random.Random(seed)
    result = {}
    for context in contexts:
        samples = [make_needle_sample(lines, names, context, lambda s: len(tok.encode(s)), rng)
                   for _ in range(per_context)]
        answer_len = max(len(tok.encode(s.answer, add_special_tokens=False)) for s in samples) + 1
        outs = llm.generate([s.prompt for s in samples], SamplingParams(temperature=0, max_tokens=answer_len),
                            use_tqdm=False)
        result[context] = sum(o.outputs[0].text.startswith(s.answer) for s, o in zip(samples, outs)) / len(samples)
    return result


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Share of prompts whose continuations are identical, and the mean share of tokens before
    the first difference."""
    same = sum(a == b for a, b in zip(reference, other))
    prefix = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return {"identical": same / len(reference), "mean_matching_prefix": sum(prefix) / len(prefix)}
