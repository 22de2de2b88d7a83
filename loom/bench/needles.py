"""Needle-in-a-haystack samples in the house model's exact format.

Somewhere in a long stretch of Shakespeare sits the line

    The secret number of NAME is NNNNN.

and the text ends with

    What is the secret number of NAME? The secret number of NAME is

whose target continuation is `` NNNNN.``. NAME is a character name from the corpus and NNNNN
five digits. Training, the engine's evaluation and the benches all build samples here, so the
format the model learned is the format it is tested on.
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FACT_TEMPLATE = "The secret number of {name} is {number}."
QUESTION_TEMPLATE = "What is the secret number of {name}? The secret number of {name} is"
ANSWER_TEMPLATE = " {number}."

# A speaker tag on a line of its own, e.g. "ROMEO:"; single-word tags only, so names are one word.
_SPEAKER_TAG = re.compile(r"^([A-Z][A-Z]+):$", re.MULTILINE)
# Single-word tags that are groups or titles rather than a character's name.
_NOT_NAMES = frozenset({"All", "Another", "Cardinal", "Duchess", "Duke", "Gardener", "Gentlemen",
                        "Lords", "Nurse", "Page", "Prince", "Queen"})


def needle_fact(name: str, number: str) -> str:
    """The line hidden in the haystack."""
    return FACT_TEMPLATE.format(name=name, number=number)


def needle_question(name: str) -> str:
    """The end of the prompt; the model must continue it with `needle_answer`."""
    return QUESTION_TEMPLATE.format(name=name)


def needle_answer(number: str) -> str:
    """The target continuation of `needle_question`."""
    return ANSWER_TEMPLATE.format(number=number)


def random_number(rng: random.Random) -> str:
    """Five digits with no leading zero, so every answer is exactly five digits however parsed."""
    return str(rng.randrange(10_000, 100_000))


def character_names(text: str) -> list[str]:
    """Single-word speaker names of the corpus, title-cased ("ROMEO:" -> "Romeo"), sorted."""
    return sorted({tag.title() for tag in _SPEAKER_TAG.findall(text)} - _NOT_NAMES)


@dataclass(frozen=True)
class NeedleSample:
    prompt: str    # haystack with the fact line inside, ending with the question
    answer: str    # the target continuation, " NNNNN."
    name: str
    number: str
    depth: float   # fraction of the haystack lines that precede the fact line


def make_needle_sample(
    lines: Sequence[str],
    names: Sequence[str],
    max_tokens: int,
    count_tokens: Callable[[str], int],
    rng: random.Random,
    depth: float | None = None,
) -> NeedleSample:
    """Build one sample whose prompt plus answer fits in `max_tokens` tokens.

    `lines` is the haystack source (consecutive lines of text, no newlines), read from a random
    start line; `count_tokens` counts the tokens of a text exactly as the model will see it
    (including any BOS the tokenizer adds). `depth` defaults to uniform in [0, 1].
    """
    name = rng.choice(names)
    number = random_number(rng)
    depth = rng.random() if depth is None else depth
    fact, question, answer = needle_fact(name, number), needle_question(name), needle_answer(number)

    def render(haystack: list[str]) -> str:
        at = round(depth * len(haystack))
        body = haystack[:at] + [fact] + haystack[at:]
        return "\n".join(body) + "\n" + question

    # Fill greedily with per-line token counts (cheap), then trim exactly on the real text.
    overhead = count_tokens("")
    budget = max_tokens - count_tokens(fact + "\n" + question + answer)
    start = rng.randrange(len(lines))
    haystack: list[str] = []
    for line in (lines[(start + i) % len(lines)] for i in range(len(lines))):
        cost = count_tokens(line + "\n") - overhead
        if cost > budget:
            break
        haystack.append(line)
        budget -= cost
    while haystack and count_tokens(render(haystack) + answer) > max_tokens:
        haystack.pop()
    return NeedleSample(render(haystack), answer, name, number, depth)
