"""Model quality measured through Loom's own engine: held-out loss per character and per token
(prompt logprobs), needle retrieval (greedy; the house model's format), answers to questions
with known answers (chat models), and greedy agreement between two engines."""
from __future__ import annotations

import math
import random
import re
from pathlib import Path

from loom import LLM, SamplingParams
from loom.bench.needles import character_names, make_needle_sample

HELDOUT_FRACTION = 0.1  # the house model's training script holds out the corpus's last 10%


def split_corpus(corpus: Path) -> tuple[str, str]:
    text = corpus.read_text()
    cut = int(len(text) * (1 - HELDOUT_FRACTION))
    return text[:cut], text[cut:]


def heldout_loss(llm: LLM, text: str, window: int) -> dict[str, float]:
    """Total token NLL of `text` in windows of `window` tokens (or the context, if shorter),
    each starting with BOS: per character, and per token with its perplexity."""
    tok = llm.get_tokenizer()
    bos = tok.encode("")  # the tokenizer's own BOS prefix (may be empty)
    ids = tok.encode(text, add_special_tokens=False)
    span = min(window, llm.engine.config.scheduler.max_model_len - 1 - len(bos))
    windows = [{"prompt_token_ids": bos + ids[i:i + span]} for i in range(0, len(ids), span)]
    if not bos:  # the first token of a window has no context to be scored from
        windows = [w for w in windows if len(w["prompt_token_ids"]) > 1]
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    total, scored = 0.0, 0
    for window_ids, out in zip(windows, outs):
        for pos in range(max(len(bos), 1), len(window_ids["prompt_token_ids"])):
            total -= out.prompt_logprobs[pos][window_ids["prompt_token_ids"][pos]].logprob
            scored += 1
    return {"nats_per_char": total / len(text), "nats_per_token": total / scored,
            "perplexity": math.exp(total / scored), "tokens": scored}


# Questions whose answers a small instruction-tuned model should know, and a string the answer
# must contain (case-insensitive).
QUESTIONS = [("What is the capital of France?", "paris"), ("How many legs does a spider have?", "eight|8"),
             ("What color is the sky on a clear day?", "blue"), ("What is 2 + 2?", "4|four"),
             ("Who wrote Romeo and Juliet?", "shakespeare"), ("What planet do we live on?", "earth"),
             ("How many days are in a week?", "seven|7"), ("What is the freezing point of water in Celsius?", "0|zero"),
             ("What is the largest ocean on Earth?", "pacific"), ("Which animal is known as the king of the jungle?", "lion")]


def chat_answers(llm: LLM, max_tokens: int = 48) -> dict[str, object]:
    """Greedy answers to QUESTIONS through the model's chat template: the share that contains
    the known answer, and the answers themselves."""
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in QUESTIONS],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    answers = [o.outputs[0].text.strip() for o in outs]
    right = [bool(re.search(rf"\b({expected})\b", a.lower())) for (_, expected), a in zip(QUESTIONS, answers)]
    return {"accuracy": sum(right) / len(right), "answers": answers}


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
