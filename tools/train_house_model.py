"""Train Loom's house model: a small GQA Llama on Tiny Shakespeare plus synthetic needles.

Writes a Hugging Face layout directory (config.json, bf16 model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, README.md, loss_curve.png, training_log.json) that
`transformers.LlamaForCausalLM` and Loom's own loader read unchanged.

Recipe, in order: a byte-level BPE tokenizer trained on the training split; the last 10% of the
corpus held out for evaluation only; training batches mixing plain Shakespeare windows with dense
needle sequences (several facts and questions each, answer tokens up-weighted in the loss);
a curriculum from short needle-dense contexts to long ones; the checkpoint with the best held-out loss among those
that retrieve about as well as any so far is kept.
Everything is seeded, so a given command and thread count reproduce the same model.

Example (the shipped model's exact command is in its README):
    python tools/train_house_model.py --corpus ../shared/corpora/tinyshakespeare.txt --out models/house
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The script lives in tools/; make the repository's `loom` package importable when run directly.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loom.layers.norm import RMSNorm  # noqa: E402  (the engine's own, so the numerics match)
from loom.bench.needles import (  # noqa: E402
    character_names,
    make_needle_sample,
    needle_answer,
    needle_fact,
    needle_question,
    random_number,
)

BOS, EOS = "<s>", "</s>"
EVAL_CONTEXTS = (256, 512, 1024)  # needle evaluation lengths, those within the model's context

# Speaker-turn chat in the corpus's own layout ("ROMEO:\n...\n\n"). BOS is written by the
# template, as in Hugging Face Llama templates, so render it and encode without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dropout: float = 0.1  # residual dropout, training only; not part of the HF config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Stage:
    context: int
    share: float            # of the training steps
    needle_fraction: float  # of the sequences in a batch


@dataclass
class TrainConfig:
    corpus: Path
    out: Path
    # Continue from the weights of an earlier run's output directory (same corpus, so the same
    # tokenizer) instead of a fresh initialization: a run can be split into phases.
    init: Path | None = None
    seed: int = 1234
    threads: int = os.cpu_count() or 1
    heldout_fraction: float = 0.1
    heldout_loss_chars: int = 0    # held-out loss over this many leading characters (0: all of them)
    steps: int = 3400
    tokens_per_batch: int = 4096
    # Stages run in order: (context length, share of steps, share of sequences carrying needles).
    # Retrieval is first learned on short, needle-only batches, where it is cheap and its signal
    # dense; later stages stretch it to the full window and give the steps back to Shakespeare.
    curriculum: list[Stage] = field(default_factory=lambda: [
        Stage(128, 0.25, 1.0), Stage(256, 0.2, 0.7), Stage(512, 0.2, 0.5), Stage(1024, 0.35, 0.4)])
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_facts: int = 8             # facts (each asked once) per needle sequence, at most
    answer_weight: float = 8.0     # loss weight of answer tokens; plain text tokens weigh 1
    haystack_weight: float = 0.3   # loss weight of the Shakespeare inside needle sequences
    eval_every: int = 150
    eval_needles: int = 32         # per context length, during training
    final_needles: int = 200       # per context length, on the kept checkpoint
    # A checkpoint whose mean needle accuracy is this far below the best seen is never kept,
    # however good its held-out loss: overfitting must not discard retrieval learned late.
    needle_tolerance: float = 0.05
    # > 0: once some checkpoint reaches this needle accuracy at every length, keep the lowest
    # held-out loss among those that do (instead of the tolerance rule above)
    min_needle_accuracy: float = 0.0
    stop_after: int = 0            # end after this step (0: all); the LR schedule still spans `steps`
    max_minutes: float = 0.0       # stop training early after this long (0: run all steps)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE that adds BOS on encode and round-trips any text through decode."""
    tokenizer = Tokenizer(models.BPE())
    # Digits are split one per token so every five-digit answer is five single-digit tokens,
    # whatever merges BPE learns; the corpus itself has almost no digits.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model: plain PyTorch, parameter names and numerics of transformers' LlamaForCausalLM
# --------------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF Llama's convention: the head is split in halves, not interleaved pairs.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class LlamaBody(nn.Module):
    """The `model.` prefix of HF parameter names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HouseLlama(nn.Module):
    """Llama with tied input/output embeddings (saves a vocab x hidden matrix on a tiny model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_dropout = nn.Dropout(cfg.dropout)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.apply(self._init_weights)
        # GPT-2 style: shrink the residual-branch outputs so the stream's variance stays O(1).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed_dropout(self.model.embed_tokens(ids))
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    tokenizer: Tokenizer
    heldout_text: str
    train_ids: torch.Tensor          # training split, no special tokens
    train_lines: list[str]
    train_line_costs: list[int]      # tokens of each line plus its newline
    heldout_lines: list[str]
    names: list[str]

    @property
    def bos_id(self) -> int:
        return self.tokenizer.token_to_id(BOS)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_to_id(EOS)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


def load_corpus(cfg: TrainConfig, vocab_size: int) -> Corpus:
    text = cfg.corpus.read_text(encoding="utf-8")
    split = int(len(text) * (1 - cfg.heldout_fraction))
    train_text, heldout_text = text[:split], text[split:]
    tokenizer = train_tokenizer(train_text, vocab_size)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False).ids)
    train_lines = train_text.split("\n")
    costs = [len(e.ids) for e in tokenizer.encode_batch([l + "\n" for l in train_lines], add_special_tokens=False)]
    return Corpus(tokenizer, heldout_text[:cfg.heldout_loss_chars or None], train_ids, train_lines, costs,
                  heldout_text.split("\n"), character_names(train_text))


def needle_sequence(corpus: Corpus, length: int, max_facts: int, answer_weight: float,
                    haystack_weight: float, rng: random.Random) -> tuple[list[int], list[float]]:
    """A training sequence of `length` + 1 tokens: Shakespeare with several facts hidden in it
    and one question per fact somewhere after it, the last question closing the sequence as in
    the evaluation format. Answers weigh `answer_weight`, the facts' random digits 0 and all
    other text `haystack_weight`."""
    names = rng.sample(corpus.names, rng.randint(1, max_facts))
    numbers = [random_number(rng) for _ in names]
    facts = [needle_fact(n, x) for n, x in zip(names, numbers)]
    questions = [needle_question(n) for n in names]
    answers = [needle_answer(x) for x in numbers]
    costs = [len(e.ids) for e in corpus.tokenizer.encode_batch(
        [f + "\n" + q + a + "\n" for f, q, a in zip(facts, questions, answers)], add_special_tokens=False)]
    # Keep at least half of the sequence for Shakespeare: fewer facts in short contexts.
    n_facts = len(names)
    while n_facts > 1 and sum(costs[:n_facts]) > length // 2:
        n_facts -= 1

    budget = length - sum(costs[:n_facts])  # the BOS takes the (length + 1)-th slot
    start = rng.randrange(len(corpus.train_lines))
    n_lines = 0
    while n_lines < len(corpus.train_lines):
        cost = corpus.train_line_costs[(start + n_lines) % len(corpus.train_lines)]
        if cost > budget:
            break
        budget -= cost
        n_lines += 1

    fact_at = [rng.randint(0, n_lines) for _ in range(n_facts)]
    ask_at = [rng.randint(f, n_lines) for f in fact_at]
    ask_at[rng.randrange(n_facts)] = n_lines + 1  # one question ends the sequence

    def render(n: int) -> tuple[str, list[tuple[int, int, float]]]:
        """Text with `n` haystack lines and (start, end, weight) char spans of the digits."""
        events: list[tuple[int, int, int]] = [(min(fact_at[i], n), 0, i) for i in range(n_facts)]
        events += [(min(ask_at[i], n + 1), 1, i) for i in range(n_facts)]
        events.sort()
        parts: list[str] = []
        spans: list[tuple[int, int, float]] = []
        pos, line = 0, 0
        for at, kind, i in events + [(n + 2, 2, -1)]:
            while line < min(at, n):
                parts.append(corpus.train_lines[(start + line) % len(corpus.train_lines)] + "\n")
                pos += len(parts[-1])
                line += 1
            if kind == 0:
                number_start = pos + len(facts[i]) - len(numbers[i]) - 1
                spans.append((number_start, number_start + len(numbers[i]), 0.0))
                parts.append(facts[i] + "\n")
            elif kind == 1:
                answer_start = pos + len(questions[i])
                spans.append((answer_start, answer_start + len(answers[i]), answer_weight))
                parts.append(questions[i] + answers[i] + "\n")
            else:
                break
            pos += len(parts[-1])
        return "".join(parts).rstrip("\n"), spans

    while True:  # per-line costs are estimates; drop haystack lines until the real text fits
        text, spans = render(n_lines)
        encoding = corpus.tokenizer.encode(text)
        if len(encoding.ids) <= length + 1 or n_lines == 0:
            break
        n_lines -= 1
    ids = encoding.ids[: length + 1]
    weights = [haystack_weight] * len(ids)
    for j, (s, _) in enumerate(encoding.offsets[: len(ids)]):
        if j == 0:
            continue  # BOS
        for a, b, w in spans:
            if a <= s < b:
                weights[j] = w
    pad = length + 1 - len(ids)
    return ids + [corpus.eos_id] * pad, weights + [0.0] * pad


def make_batch(corpus: Corpus, cfg: TrainConfig, stage: Stage, rng: random.Random
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and per-target loss weights, each (batch, stage.context)."""
    length = stage.context
    rows, weights = [], []
    for _ in range(max(1, cfg.tokens_per_batch // length)):
        if rng.random() < stage.needle_fraction:
            ids, w = needle_sequence(corpus, length, cfg.max_facts, cfg.answer_weight, cfg.haystack_weight, rng)
        else:
            s = rng.randrange(len(corpus.train_ids) - length)
            ids = [corpus.bos_id] + corpus.train_ids[s: s + length].tolist()
            w = [1.0] * (length + 1)
        rows.append(ids)
        weights.append(w)
    seq = torch.tensor(rows)
    return seq[:, :-1], seq[:, 1:], torch.tensor(weights)[:, 1:]


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def heldout_nats_per_char(model: HouseLlama, corpus: Corpus, context: int, bf16: bool,
                          windows_per_batch: int = 16) -> float:
    """Total token NLL of the held-out text / its characters, in windows of `context` tokens,
    each starting with BOS (the first text token of a window is predicted from BOS alone). The
    full windows run in batches; the last, shorter one alone."""
    model.eval()
    ids = corpus.tokenizer.encode(corpus.heldout_text, add_special_tokens=False).ids
    step = context - 1
    windows = [[corpus.bos_id] + ids[i: i + step] for i in range(0, len(ids), step)]
    full = [w for w in windows if len(w) == context]
    batches = [full[i: i + windows_per_batch] for i in range(0, len(full), windows_per_batch)]
    batches += [[w] for w in windows if len(w) < context]
    total = 0.0
    for batch in batches:
        x = torch.tensor(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    return total / len(corpus.heldout_text)


def unigram_nats_per_char(corpus: Corpus) -> float:
    """Baseline: add-one-smoothed training-split token frequencies scored on the held-out text."""
    vocab = corpus.tokenizer.get_vocab_size()
    counts = torch.bincount(corpus.train_ids, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    ids = torch.tensor(corpus.tokenizer.encode(corpus.heldout_text, add_special_tokens=False).ids)
    return -logp[ids].sum().item() / len(corpus.heldout_text)


def eval_contexts(max_context: int) -> list[int]:
    return [c for c in EVAL_CONTEXTS if c <= max_context] or [max_context]


def build_needle_set(corpus: Corpus, per_context: int, max_context: int, seed: int
                     ) -> dict[int, list[tuple[list[int], int]]]:
    """Fresh needles from the held-out text: (prompt+answer ids, prompt length) per context."""
    rng = random.Random(seed)
    sets: dict[int, list[tuple[list[int], int]]] = {}
    for context in eval_contexts(max_context):
        items = []
        for _ in range(per_context):
            s = make_needle_sample(corpus.heldout_lines, corpus.names, context, corpus.count_tokens, rng)
            prompt_ids = corpus.tokenizer.encode(s.prompt).ids
            full = corpus.tokenizer.encode(s.prompt + s.answer).ids
            assert full[: len(prompt_ids)] == prompt_ids, "answer must tokenize apart from the prompt"
            items.append((full, len(prompt_ids)))
        sets[context] = items
    return sets


@torch.no_grad()
def needle_accuracy(model: HouseLlama, needle_set: dict[int, list[tuple[list[int], int]]],
                    bf16: bool) -> dict[int, float]:
    """Exact-answer rate under greedy decoding. Greedy emits the answer iff every answer token is
    the argmax given the correct prefix, so one teacher-forced forward pass decides it."""
    model.eval()
    result = {}
    for context, items in needle_set.items():
        right = 0
        for full, prompt_len in items:
            x = torch.tensor([full])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x[:, :-1])
            predicted = logits[0, prompt_len - 1:].argmax(-1)
            right += int(torch.equal(predicted, x[0, prompt_len:]))
        result[context] = right / len(items)
    return result


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def stage_at(cfg: TrainConfig, step: int) -> Stage:
    edge = 0.0
    for stage in cfg.curriculum:
        edge += stage.share * cfg.steps
        if step < edge:
            return stage
    return cfg.curriculum[-1]


def make_optimizer(model: HouseLlama, cfg: TrainConfig) -> torch.optim.AdamW:
    # No decay on norms (1-D); the tied embedding is decayed, which regularizes it too.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def train(model: HouseLlama, corpus: Corpus, cfg: TrainConfig
          ) -> tuple[dict[str, torch.Tensor], list[dict], float]:
    """Returns the kept state dict and its step, the evaluation log and the training minutes."""
    rng = random.Random(cfg.seed)
    optimizer = make_optimizer(model, cfg)
    context = model.cfg.max_position_embeddings
    needle_set = build_needle_set(corpus, cfg.eval_needles, context, cfg.seed + 1)
    log: list[dict] = []
    best_needles = 0.0
    kept: dict = {}  # the kept checkpoint's log entry, mean needle accuracy and state
    started = time.perf_counter()
    # Since the last evaluation: summed weighted loss and steps; answer-token NLL and count.
    running, running_n, answer_nll, answer_n = 0.0, 0, 0.0, 0

    def evaluate(step: int) -> None:
        nonlocal best_needles, kept
        entry = {
            "step": step,
            "minutes": (time.perf_counter() - started) / 60,
            "train_loss": running / max(1, running_n),
            # ln 10 = 2.30 per digit while the model guesses; near 0 once it retrieves.
            "train_answer_nll": answer_nll / max(1, answer_n),
            "heldout_nats_per_char": heldout_nats_per_char(model, corpus, context, bf16=True),
            "needle_accuracy": {str(c): a for c, a in needle_accuracy(model, needle_set, bf16=True).items()},
        }
        log.append(entry)
        needles = sum(entry["needle_accuracy"].values()) / len(entry["needle_accuracy"])
        best_needles = max(best_needles, needles)
        qualified = bool(cfg.min_needle_accuracy) and min(entry["needle_accuracy"].values()) >= cfg.min_needle_accuracy
        if qualified or kept.get("qualified"):
            keep = qualified and (not kept.get("qualified")
                                  or entry["heldout_nats_per_char"] < kept["entry"]["heldout_nats_per_char"])
        else:
            keep = (not kept
                    or kept["needles"] < best_needles - cfg.needle_tolerance
                    or (needles >= best_needles - cfg.needle_tolerance
                        and entry["heldout_nats_per_char"] < kept["entry"]["heldout_nats_per_char"]))
        if keep:
            kept = {"entry": entry, "needles": needles, "qualified": qualified,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        per_context = " ".join(f"{c}:{a:.2f}" for c, a in entry["needle_accuracy"].items())
        print(f"step {step:5d}  {entry['minutes']:6.1f} min  train {entry['train_loss']:.3f}  "
              f"answer {entry['train_answer_nll']:.3f}  "
              f"heldout {entry['heldout_nats_per_char']:.4f} nats/char  needles {per_context}"
              f"{'  kept' if keep else ''}", flush=True)
        model.train()

    model.train()
    step = 0
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        inputs, targets, weights = make_batch(corpus, cfg, stage_at(cfg, step), rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        loss = (nll * weights.flatten()).sum() / weights.numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        running += loss.item()
        running_n += 1
        answer = weights.flatten() == cfg.answer_weight
        answer_nll += nll[answer].sum().item()
        answer_n += int(answer.sum())
        if (step + 1) % cfg.eval_every == 0:
            evaluate(step + 1)
            running, running_n, answer_nll, answer_n = 0.0, 0, 0.0, 0
        if cfg.stop_after and step + 1 >= cfg.stop_after:
            break
        if cfg.max_minutes and time.perf_counter() - started > cfg.max_minutes * 60:
            print(f"stopping at step {step + 1}: --max-minutes reached", flush=True)
            break
    if not log or log[-1]["step"] != step + 1:
        evaluate(step + 1)
    return kept["state"], kept["entry"]["step"], log, (time.perf_counter() - started) / 60


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, corpus: Corpus) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": corpus.bos_id,
        "eos_token_id": corpus.eos_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def export_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    # lm_head is tied to the embedding: HF re-ties it from tie_word_embeddings.
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file private; it is a shipped artifact


def plot_log(log: list[dict], unigram: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig, (ax_loss, ax_needle) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [e["heldout_nats_per_char"] for e in log], marker="o", label="held-out (nats/char)")
    ax_loss.axhline(unigram, color="gray", linestyle="--", label=f"unigram baseline ({unigram:.2f})")
    ax_loss.axhline(1.6, color="red", linestyle=":", label="target 1.6")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("nats per character")
    ax_loss.legend()
    ax_loss.set_title("held-out loss")
    for context in log[0]["needle_accuracy"]:
        ax_needle.plot(steps, [e["needle_accuracy"][context] for e in log], marker="o", label=f"{context} tokens")
    ax_needle.set_ylim(-0.02, 1.02)
    ax_needle.set_xlabel("step")
    ax_needle.set_ylabel("exact answers")
    ax_needle.set_title("needle accuracy (held-out haystacks)")
    ax_needle.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_readme(path: Path, commands: list[str], model_cfg: ModelConfig, cfg: TrainConfig, n_params: int,
                 results: dict) -> None:
    needles = "\n".join(f"| {c} | {a * 100:.1f}% |" for c, a in results["needle_accuracy"].items())
    stages = "\n".join(f"| {s.context} | {s.share} | {s.needle_fraction} |" for s in cfg.curriculum)
    reproducibility_note = (", and here on the step reached when --max-minutes stopped training"
                            if results["steps_run"] < cfg.steps else "")
    config_rows = "\n".join(f"| {k} | {v} |" for k, v in {
        **dataclasses.asdict(model_cfg), **{k: v for k, v in dataclasses.asdict(cfg).items()
                                            if k not in ("corpus", "out", "curriculum")}}.items())
    path.write_text(f"""# Loom house model

A {n_params / 1e6:.2f}M-parameter Llama (grouped-query attention, tied embeddings, context
{model_cfg.max_position_embeddings}) trained from scratch on Tiny Shakespeare (public domain) mixed with synthetic
needle-in-a-haystack retrieval samples, with a byte-level BPE tokenizer of {model_cfg.vocab_size} tokens.
Hugging Face layout: `transformers.LlamaForCausalLM.from_pretrained` loads it unchanged.

## Reproduce

{"Run in order; each command continues from the previous one's output (--init)." if len(commands) > 1 else ""}

{chr(10).join("    " + c for c in commands)}

Seeded throughout; the result depends only on the commands and the thread count
({cfg.threads} here, since float reductions are split by thread){reproducibility_note}.

## Recipe

{"The settings below are the last command's; the earlier commands above give theirs, and training_log.json keeps their evaluation logs (earlier_phases)." if len(commands) > 1 else ""}

- Tokenizer: byte-level BPE (`tokenizers`), digits split one per token, BOS `<s>` prepended by
  the post-processor, EOS `</s>`, byte-level decoder (decode(encode(x)) == x). Trained on the
  training split only.
- Data: the last {cfg.heldout_fraction:.0%} of the corpus is held out for evaluation only. Each training
  sequence starts with BOS; a share of them (set per curriculum stage) are needle sequences: Shakespeare with
  1 to {cfg.max_facts} lines `The secret number of NAME is NNNNN.` hidden in it and, for each, the line
  `What is the secret number of NAME? The secret number of NAME is NNNNN.` somewhere after it,
  the last one closing the sequence. Answer tokens weigh {cfg.answer_weight} in the loss, the facts'
  random digits 0, the rest of a needle sequence {cfg.haystack_weight}, plain sequences 1.
- Curriculum, stages in order, at a constant {cfg.tokens_per_batch} tokens per batch:

| context (tokens) | share of steps | share of needle sequences |
|---|---|---|
{stages}

- AdamW (betas 0.9/0.95, weight decay {cfg.weight_decay}), cosine learning rate {cfg.lr} -> {cfg.min_lr} after
  {cfg.warmup_steps} warmup steps, gradient clipping {cfg.grad_clip}, dropout {model_cfg.dropout}, bf16 autocast.
- Every {cfg.eval_every} steps: held-out loss and {cfg.eval_needles} needles per context length. The saved
  checkpoint has the lowest held-out loss among those whose mean needle accuracy is within
  {cfg.needle_tolerance} of the best seen (before retrieval emerges: simply the lowest held-out loss).

| setting (the last command) | value |
|---|---|
{config_rows}

## Evaluation (the saved bf16 weights, fp32 compute)

- Held-out loss: **{results['heldout_nats_per_char']:.4f} nats per character** (total token NLL / characters
  of the held-out text, windows of {model_cfg.max_position_embeddings} tokens each starting with BOS).
- Unigram baseline (add-one-smoothed training-split token frequencies): {results['unigram_nats_per_char']:.4f} nats per character.
- Needle retrieval, greedy, {cfg.final_needles} fresh needles per context length (prompt plus answer
  tokens, BOS included) built by `loom.bench.needles.make_needle_sample` on held-out haystacks.
  An answer counts when all of ` NNNNN.` is the argmax continuation, exactly when greedy
  decoding would produce it:

| context (tokens) | exact |
|---|---|
{needles}

- Kept checkpoint: step {results['kept_step']} of {results['steps_run']}; training took {results['train_minutes']:.1f} minutes
  with {cfg.threads} thread(s).

![loss curve](loss_curve.png)

`training_log.json` holds every evaluation made during training.
""", encoding="utf-8")


def export(out: Path, model: HouseLlama, state: dict[str, torch.Tensor], kept_step: int, corpus: Corpus,
           cfg: TrainConfig, log: list[dict], train_minutes: float, commands: list[str],
           earlier_phases: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = model.cfg
    export_weights(state, out / "model.safetensors")
    # Evaluate exactly what ships: the weights rounded to bf16, computed in fp32.
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    results = {
        "heldout_nats_per_char": heldout_nats_per_char(model, corpus, model_cfg.max_position_embeddings, bf16=False),
        "unigram_nats_per_char": unigram_nats_per_char(corpus),
        "needle_accuracy": {str(c): a for c, a in needle_accuracy(
            model, build_needle_set(corpus, cfg.final_needles, model_cfg.max_position_embeddings, cfg.seed + 2),
            bf16=False).items()},
        "kept_step": kept_step,
        "steps_run": log[-1]["step"],
        "train_minutes": train_minutes,
        "threads": cfg.threads,
    }
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg, corpus), indent=2) + "\n")
    corpus.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": model_cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": corpus.bos_id,
        "eos_token_id": corpus.eos_id,
    }, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(
        {"results": results, "log": log, "commands": commands, "earlier_phases": earlier_phases}, indent=2) + "\n")
    plot_log(log, results["unigram_nats_per_char"], out / "loss_curve.png")
    write_readme(out / "README.md", commands, model_cfg, cfg, model.num_parameters(), results)
    return results


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def parse_curriculum(spec: str) -> list[Stage]:
    """"128:0.3:1,1024:0.7:0.5" -> [Stage(128, 0.3, 1.0), Stage(1024, 0.7, 0.5)]."""
    stages = [Stage(int(c), float(s), float(n)) for c, s, n in (item.split(":") for item in spec.split(","))]
    if abs(sum(stage.share for stage in stages) - 1) > 1e-6:
        raise argparse.ArgumentTypeError("curriculum shares must sum to 1")
    return stages


def parse_args(argv: list[str] | None) -> tuple[ModelConfig, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--init", type=Path, default=None,
                        help="start from the weights of an earlier run's output directory")
    parser.add_argument("--curriculum", type=parse_curriculum,
                        help="context:share-of-steps:needle-fraction stages, e.g. 128:0.3:1,1024:0.7:0.5")
    # Every other field of the two configs is a flag of the same name with the same default.
    for config_cls in (ModelConfig, TrainConfig):
        for f in dataclasses.fields(config_cls):
            if f.name in ("corpus", "out", "curriculum", "init"):
                continue
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(parser.parse_args(argv))
    model_cfg = ModelConfig(**{f.name: args[f.name] for f in dataclasses.fields(ModelConfig)})
    train_kwargs = {f.name: args[f.name] for f in dataclasses.fields(TrainConfig)
                    if f.name != "curriculum" or args["curriculum"] is not None}
    cfg = TrainConfig(**train_kwargs)
    if max(stage.context for stage in cfg.curriculum) > model_cfg.max_position_embeddings:
        parser.error("curriculum contexts must not exceed --max-position-embeddings")
    if cfg.answer_weight <= 1:
        parser.error("--answer-weight must exceed 1 (answer tokens are told apart by their weight)")
    return model_cfg, cfg


def continue_from(model: HouseLlama, corpus: Corpus, init: Path) -> tuple[list[str], list[dict]]:
    """Loads an earlier run's weights into `model`; returns that run's commands and its logs."""
    if json.loads((init / "tokenizer.json").read_text()) != json.loads(corpus.tokenizer.to_str()):
        raise SystemExit(f"--init {init}: its tokenizer differs from this corpus's (another corpus or vocab size?)")
    state = {k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding
        raise SystemExit(f"--init {init}: weights do not fit this model (missing {missing}, unexpected {unexpected})")
    previous = json.loads((init / "training_log.json").read_text())
    commands = previous["commands"]
    phase = {"command": commands[-1], "results": previous["results"], "log": previous["log"]}
    return list(commands), previous["earlier_phases"] + [phase]


def main(argv: list[str] | None = None) -> dict:
    model_cfg, cfg = parse_args(argv)
    command = "python tools/train_house_model.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    corpus = load_corpus(cfg, model_cfg.vocab_size)
    model_cfg.vocab_size = corpus.tokenizer.get_vocab_size()  # BPE may stop short of the target
    model = HouseLlama(model_cfg)
    commands, earlier_phases = [command], []
    if cfg.init is not None:
        commands, earlier_phases = continue_from(model, corpus, cfg.init)
        commands.append(command)
    print(f"{model.num_parameters() / 1e6:.2f}M parameters, {len(corpus.train_ids)} training tokens, "
          f"{len(corpus.names)} names, {cfg.threads} thread(s)", flush=True)

    state, kept_step, log, minutes = train(model, corpus, cfg)
    results = export(cfg.out, model, state, kept_step, corpus, cfg, log, minutes, commands, earlier_phases)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
