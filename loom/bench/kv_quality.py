"""KV compression's quality, measured the way Keyformer reports it: greedy generations under a
compressed cache against the full cache's generation of the same prompt (ROUGE-1/2/L
F-measures), the loss of the text that really follows each prompt, teacher-forced through the
compressed cache's decode steps (held-out text: the model never trained on it), and needle
retrieval in the house model's format, at budgets from 10% to 90% of the prompt, for every
policy."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from loom import LLM, SamplingParams
from loom.bench.needles import character_names, make_needle_sample
from loom.bench.report import cpu_label
from loom.kv.policy import KV_POLICIES

BUDGETS = (0.1, 0.25, 0.5, 0.75, 0.9)
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


def passages(llm: LLM, text: str, count: int, length: int, continuation: int, seed: int = 0) -> list[dict]:
    """`count` prompts of `length` tokens (BOS included) cut from `text` at random tokens, each
    with the `continuation` tokens that follow it in the text."""
    tok = llm.get_tokenizer()
    ids, bos = tok.encode(text, add_special_tokens=False), tok.encode("")
    rng = random.Random(seed)
    cut = length - len(bos)
    starts = [rng.randrange(len(ids) - cut - continuation) for _ in range(count)]
    return [{"prompt_token_ids": bos + ids[s:s + cut], "continuation": ids[s + cut:s + cut + continuation]}
            for s in starts]


def teacher_forcing(tokens: list[int]):
    """A logits processor that leaves only the next of `tokens` to be chosen: decode then
    follows them, and each step's logprob (the raw model's) is that token's."""
    def force(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[tokens[len(generated)]] = 0
        return forced
    return force


def rouge(references: list[str], candidates: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measures of each candidate against its reference."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS))
    scores = [scorer.score(r, c) for r, c in zip(references, candidates)]
    return {k: sum(s[k].fmeasure for s in scores) / len(scores) for k in ROUGE_KEYS}


def needles(llm: LLM, train_text: str, heldout_text: str, context: int, count: int, seed: int = 1234) -> list:
    tok = llm.get_tokenizer()
    names, lines = character_names(train_text), heldout_text.split("\n")
    rng = random.Random(seed)
    return [make_needle_sample(lines, names, context, lambda s: len(tok.encode(s)), rng) for _ in range(count)]


def evaluate(llm: LLM, prompts: list[dict], samples: list, max_tokens: int) -> dict:
    """For every policy and budget: greedy generations of `prompts` (ROUGE against the full
    cache's), the mean loss of their continuations (nats per token), and needle accuracy."""
    tok = llm.get_tokenizer()
    answer_len = max(len(tok.encode(s.answer, add_special_tokens=False)) for s in samples) + 1 if samples else 0
    inputs = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]

    def generate(policy: str, budget: float | None) -> tuple[list[str], float, float | None]:
        kv = dict(kv_policy=policy, kv_budget=budget)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **kv)
        texts = [o.outputs[0].text for o in llm.generate(inputs, params, use_tqdm=False)]
        forced = [SamplingParams(temperature=0, max_tokens=len(p["continuation"]), ignore_eos=True, logprobs=0,
                                 logits_processors=[teacher_forcing(p["continuation"])], **kv) for p in prompts]
        logprobs = [lp[t].logprob for p, o in zip(prompts, llm.generate(inputs, forced, use_tqdm=False))
                    for lp, t in zip(o.outputs[0].logprobs, p["continuation"])]
        loss = -sum(logprobs) / len(logprobs)
        if not samples:
            return texts, loss, None
        params = SamplingParams(temperature=0, max_tokens=answer_len, **kv)
        outs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
        return texts, loss, sum(o.outputs[0].text.startswith(s.answer) for s, o in zip(samples, outs)) / len(samples)

    def row(policy: str, budget: float, texts: list[str], loss: float, accuracy: float | None) -> dict:
        return {"policy": policy, "budget": budget, **rouge(full_texts, texts), "heldout_loss": loss,
                "needle_accuracy": accuracy}

    full_texts, full_loss, full_needles = generate("full", None)
    rows = [row("full", 1.0, full_texts, full_loss, full_needles)]
    for policy in (p for p in KV_POLICIES if p != "full"):
        for budget in BUDGETS:
            rows.append(row(policy, budget, *generate(policy, budget)))
    return {"rows": rows, "full_generations": full_texts[:4]}


def kvpress_needles(llm: LLM, model_dir: Path, samples: list, rows: list[dict], threads: int) -> None:
    """The peer: kvpress's StreamingLLM and SnapKV presses on the same needle prompts (Loom's
    token ids) and budgets, through transformers; adds `kvpress_needle_accuracy` to the rows of
    Loom's policies of the same names."""
    from loom.bench.kvpress_peer import PRESSES, run_kvpress

    tok = llm.get_tokenizer()
    answer_len = max(len(tok.encode(s.answer, add_special_tokens=False)) for s in samples) + 1
    generated = run_kvpress(model_dir, [tok.encode(s.prompt) for s in samples], answer_len, list(BUDGETS), threads)
    for row in rows:
        if row["policy"] in PRESSES:
            ids = generated[row["policy"]][str(row["budget"])]
            row["kvpress_needle_accuracy"] = sum(tok.decode(i).startswith(s.answer) for s, i in zip(samples, ids)) / len(samples)


def plot(path: Path, title: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rougeL", "ROUGE-L against the full cache"), ("heldout_loss", "loss of the continuations (nats/token)")]
    if rows[0]["needle_accuracy"] is not None:
        panels.append(("needle_accuracy", "needle accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], panels):
        for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
            mine = [r for r in rows if r["policy"] == policy]
            line, = ax.plot([100 * r["budget"] for r in mine], [r[key] for r in mine], marker="o", label=policy)
            peer = [r for r in mine if f"kvpress_{key}" in r]
            if peer:  # the peer's same press, dashed in the same colour
                ax.plot([100 * r["budget"] for r in peer], [r[f"kvpress_{key}"] for r in peer], marker="x",
                        linestyle="--", color=line.get_color(), label=f"kvpress {policy}")
        ax.axhline(rows[0][key], color="gray", linestyle=":", label="full cache")
        ax.set_xlabel("KV budget (% of the prompt)")
        ax.set_ylabel(ylabel)
        if key != "heldout_loss":
            ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n{cpu_label()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
