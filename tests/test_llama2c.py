"""`loom convert llama2c` on the stories260K fixture, checked against run.c's forward pass.

The ground truth is tests/llama2c_reference.py (the C forward pass in plain PyTorch on the raw
`.bin`); the converted directory must give the same greedy ids in Hugging Face `transformers`
and in Loom.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llama2c_reference import Llama2cReference
from loom.models.llama2c import convert_llama2c

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).resolve().parents[2] / "shared/models/stories260K/stories260K.bin"
if not FIXTURE.exists():
    pytest.skip("../shared/models/stories260K not found (a user's clone without the shared fixtures)",
                allow_module_level=True)

NEW_TOKENS = 48
# No tokenizer ships with the fixture, so prompts are raw ids, each starting with BOS (1).
PROMPTS = [
    [1],
    [1, 403, 407, 261, 378],
    [1, 17, 250, 93, 311, 44, 502, 129, 8, 77, 460, 300, 12, 199, 65, 400, 3],
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("stories260K-hf")
    convert_llama2c(FIXTURE, dst)
    return dst


@pytest.fixture(scope="module")
def reference_ids() -> list[list[int]]:
    ref = Llama2cReference(FIXTURE)
    return [ref.greedy(p, NEW_TOKENS) for p in PROMPTS]


def _hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy ids from transformers, recomputing the whole sequence each step (no cache to trust)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def test_config(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 172, 5)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (512, 512)
    assert config["tie_word_embeddings"] is True


def test_transformers_matches_reference(converted: Path, reference_ids: list[list[int]]) -> None:
    got = [_hf_greedy(converted, p, NEW_TOKENS) for p in PROMPTS]
    assert got == reference_ids


def test_untied_classifier(tmp_path: Path) -> None:
    # The fixture is tied; append a classifier and flip vocab_size's sign to exercise lm_head.
    raw = bytearray(FIXTURE.read_bytes())
    dim, vocab = struct.unpack_from("<i", raw, 0)[0], struct.unpack_from("<i", raw, 20)[0]
    struct.pack_into("<i", raw, 20, -vocab)
    wcls = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    src = tmp_path / "untied.bin"
    src.write_bytes(bytes(raw) + wcls.numpy().tobytes())
    dst = tmp_path / "hf"
    convert_llama2c(src, dst)

    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False
    prompt = PROMPTS[1]
    assert _hf_greedy(dst, prompt, 16) == Llama2cReference(src).greedy(prompt, 16)


def test_loom_matches_reference(converted: Path, reference_ids: list[list[int]]) -> None:
    from loom import LLM, SamplingParams

    llm = LLM(model=str(converted), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_ids


def test_cli(converted: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    dst = tmp_path / "cli-out"
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "convert", "llama2c", str(FIXTURE), str(dst)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (dst / "config.json").read_text() == (converted / "config.json").read_text()
    got, want = load_file(dst / "model.safetensors"), load_file(converted / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _header_with(field_index: int, value: int) -> bytes:
    raw = bytearray(FIXTURE.read_bytes())
    struct.pack_into("<i", raw, 4 * field_index, value)
    return bytes(raw)


@pytest.mark.parametrize(("content", "field"), [
    (lambda: FIXTURE.read_bytes()[:20], "header"),
    (lambda: FIXTURE.read_bytes()[:28 + 4 * 40_000], "wq"),             # cut inside layer weights
    (lambda: FIXTURE.read_bytes()[:-4], "freq_cis_imag"),
    (lambda: _header_with(5, -512), "wcls"),                             # claims an untied classifier
    (lambda: _header_with(4, 3), "n_kv_heads"),                          # 3 does not divide 8 heads
    (lambda: _header_with(3, 0), "n_heads"),
    (lambda: FIXTURE.read_bytes() + b"\0" * 8, "vocab_size"),            # trailing data
], ids=["header", "wq", "freq_cis", "wcls", "n_kv_heads", "n_heads", "trailing"])
def test_bad_file(tmp_path: Path, content: Callable[[], bytes], field: str) -> None:
    src = tmp_path / "bad.bin"
    src.write_bytes(content())
    with pytest.raises(ValueError, match=field) as err:
        convert_llama2c(src, tmp_path / "out")
    assert str(src) in str(err.value)
    assert not (tmp_path / "out").exists()
