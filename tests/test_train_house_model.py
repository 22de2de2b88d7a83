"""The house-model training script: needle format, and a tiny end-to-end run that must give a
directory transformers loads with the training model's logits."""
from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from loom.bench.needles import (
    character_names,
    make_needle_sample,
    needle_answer,
    needle_fact,
    needle_question,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "train_house_model.py"
CORPUS = REPO.parent / "shared" / "corpora" / "tinyshakespeare.txt"

FACT_RE = re.compile(r"^The secret number of ([A-Z][a-z]+) is (\d{5})\.$")
QA_RE = re.compile(r"^What is the secret number of ([A-Z][a-z]+)\? The secret number of \1 is (\d{5})\.$")

TINY_ARGS = [
    "--threads", "1", "--vocab-size", "512", "--hidden-size", "64", "--intermediate-size", "128",
    "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
    "--max-position-embeddings", "256", "--steps", "12", "--tokens-per-batch", "512",
    "--curriculum", "128:0.5:1,256:0.5:0.5", "--warmup-steps", "4", "--eval-every", "6",
    "--eval-needles", "4", "--final-needles", "4", "--heldout-loss-chars", "8000",
]


def load_script():
    """The training script as a module (it is a tool, not part of the `loom` package)."""
    if "train_house_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_house_model", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["train_house_model"]


# ---------------------------------------------------------------------------- needle format

def test_needle_strings_are_exactly_the_trained_format() -> None:
    assert needle_fact("Romeo", "12345") == "The secret number of Romeo is 12345."
    assert needle_question("Romeo") == "What is the secret number of Romeo? The secret number of Romeo is"
    assert needle_answer("12345") == " 12345."


def test_character_names_are_single_word_speakers() -> None:
    text = "ROMEO:\nHello.\n\nFirst Citizen:\nHi.\n\nALL:\nHail!\n\nJULIET:\nRomeo!\n\nROMEO:\nAgain.\n"
    assert character_names(text) == ["Juliet", "Romeo"]


def count_words(text: str) -> int:
    return len(text.split()) + 1  # +1 stands in for a BOS token


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_make_needle_sample_places_fact_and_fits_budget(depth: float) -> None:
    lines = [f"line {i} of the haystack" for i in range(200)]
    sample = make_needle_sample(lines, ["Romeo", "Juliet"], 120, count_words, random.Random(7), depth=depth)
    body = sample.prompt.split("\n")
    assert body[-1] == needle_question(sample.name)
    assert sample.answer == needle_answer(sample.number)
    assert re.fullmatch(r"[1-9]\d{4}", sample.number)
    haystack = body[:-1]
    fact_at = haystack.index(needle_fact(sample.name, sample.number))
    assert sum(FACT_RE.match(line) is not None for line in haystack) == 1
    assert fact_at == round(depth * (len(haystack) - 1))
    # Fills the budget to within one haystack line (5 words) without exceeding it.
    assert 120 - 5 < count_words(sample.prompt + sample.answer) <= 120


# ---------------------------------------------------------------------------- end to end

pytestmark_corpus = pytest.mark.skipif(not CORPUS.exists(), reason="Tiny Shakespeare corpus not found")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("house") / "model"
    subprocess.run([sys.executable, str(SCRIPT), "--corpus", str(CORPUS), "--out", str(out), *TINY_ARGS],
                   check=True, cwd=REPO, capture_output=True, timeout=120)
    return out


@pytestmark_corpus
def test_training_sequences_use_the_needle_format() -> None:
    script = load_script()
    cfg = script.TrainConfig(corpus=CORPUS, out=Path("unused"))
    corpus = script.load_corpus(cfg, vocab_size=512)
    ids, weights = script.needle_sequence(corpus, 256, max_facts=4, answer_weight=3.0,
                                            haystack_weight=0.5, rng=random.Random(0))
    assert len(ids) == len(weights) == 257 and ids[0] == corpus.bos_id
    real = [i for i, w in zip(ids, weights) if not (w == 0 and i == corpus.eos_id)]  # drop padding
    lines = corpus.tokenizer.decode(real).split("\n")
    facts = {m[1]: m[2] for m in map(FACT_RE.match, lines) if m}
    questions = [(i, m[1], m[2]) for i, m in enumerate(map(QA_RE.match, lines)) if m]
    assert facts and len(questions) == len(facts)
    assert questions[-1][0] == len(lines) - 1  # a question closes the sequence
    for at, name, number in questions:
        assert facts[name] == number
        assert lines.index(needle_fact(name, number)) < at  # asked only after it was told
    answers = corpus.tokenizer.decode([i for i, w in zip(ids, weights) if w == 3.0])
    assert answers == "".join(needle_answer(number) for _, _, number in questions)
    told = [m[2] for m in map(FACT_RE.match, lines) if m]
    assert corpus.tokenizer.decode([i for i, w in zip(real, weights) if w == 0]) == "".join(told)
    assert set(weights[: len(real)]) == {0.0, 0.5, 3.0}


@pytestmark_corpus
def test_output_directory_layout(tiny_run: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", "loss_curve.png"):
        assert (tiny_run / name).is_file(), name
    config = json.loads((tiny_run / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    weights = load_file(tiny_run / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{part}.weight"
        for i in range(config["num_hidden_layers"])
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm")}
    assert set(weights) == expected  # tied: no lm_head.weight
    assert "python tools/train_house_model.py" in (tiny_run / "README.md").read_text()


@pytestmark_corpus
def test_tokenizer_adds_bos_and_round_trips(tiny_run: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_run / "tokenizer.json"))
    config = json.loads((tiny_run / "tokenizer_config.json").read_text())
    bos, eos = tokenizer.token_to_id(config["bos_token"]), tokenizer.token_to_id(config["eos_token"])
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and bos != eos
    text = "ROMEO:\nBut soft, what light through yonder window breaks?  99 \u00e9\n"
    ids = tokenizer.encode(text).ids
    assert ids[0] == bos and ids.count(bos) == 1
    assert tokenizer.decode(ids) == text
    digits = tokenizer.encode(" 12345.", add_special_tokens=False).tokens
    assert digits[1:6] == list("12345")  # one token per digit
    rendered = __import__("jinja2").Template(config["chat_template"]).render(
        messages=[{"role": "user", "content": "Speak."}], add_generation_prompt=True, bos_token="<s>")
    assert rendered == "<s>USER:\nSpeak.\n\nASSISTANT:\n"


@pytestmark_corpus
def test_transformers_reproduces_training_model(tiny_run: Path) -> None:
    transformers = pytest.importorskip("transformers")
    script = load_script()
    config = json.loads((tiny_run / "config.json").read_text())
    model_cfg = script.ModelConfig(
        **{f: config[f] for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                  "rope_theta", "rms_norm_eps")}, dropout=0.0)
    ours = script.HouseLlama(model_cfg).eval()
    state = {k: v.float() for k, v in load_file(tiny_run / "model.safetensors").items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_run, dtype=torch.float32).eval()

    ids = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.max_position_embeddings),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, hf_logits = ours(ids), hf(ids).logits
    assert ours_logits.abs().max() > 0.1  # trained weights, not a degenerate zero model
    assert (ours_logits - hf_logits).abs().max().item() < 1e-4

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_run)
    text = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?"
    assert hf_tokenizer(text).input_ids == Tokenizer.from_file(str(tiny_run / "tokenizer.json")).encode(text).ids


@pytestmark_corpus
def test_training_is_deterministic(tiny_run: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    subprocess.run([sys.executable, str(SCRIPT), "--corpus", str(CORPUS), "--out", str(again), *TINY_ARGS],
                   check=True, cwd=REPO, capture_output=True, timeout=120)
    assert (again / "model.safetensors").read_bytes() == (tiny_run / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny_run / "tokenizer.json").read_bytes()


@pytestmark_corpus
def test_a_second_phase_continues_from_the_first(tiny_run: Path, tmp_path: Path) -> None:
    """--init starts from an earlier run's weights (with a zero learning rate they come out
    unchanged); the README lists both commands in order."""
    phase2 = tmp_path / "phase2"
    args = [*TINY_ARGS[:TINY_ARGS.index("--steps")], "--steps", "4", "--curriculum", "256:1:1", "--eval-every", "2",
            "--eval-needles", "4", "--final-needles", "4", "--heldout-loss-chars", "8000", "--lr", "0", "--min-lr", "0"]
    subprocess.run([sys.executable, str(SCRIPT), "--corpus", str(CORPUS), "--init", str(tiny_run), "--out", str(phase2),
                    *args], check=True, cwd=REPO, capture_output=True, timeout=120)
    log = json.loads((phase2 / "training_log.json").read_text())
    first = json.loads((tiny_run / "training_log.json").read_text())
    assert len(log["commands"]) == 2 and log["commands"][0] == first["commands"][0] and "--init" in log["commands"][1]
    assert log["earlier_phases"][0]["log"] == first["log"]
    readme = (phase2 / "README.md").read_text()
    assert readme.index(log["commands"][0]) < readme.index(log["commands"][1])
    before, after = load_file(tiny_run / "model.safetensors"), load_file(phase2 / "model.safetensors")
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
