"""The llama.cpp peer: the q/k row permutation of GGUF files (always), and the GGUF export run
by llama.cpp itself (only with LOOM_TEST_PEERS=1, since the peer venv compiles llama.cpp for
minutes)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import hf_greedy
from loom.models.gguf import permute_qk


def test_permute_qk_interleaves_each_heads_halves():
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of head_dim 4
    assert permute_qk(rows, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_permuted_rows_with_pairwise_rope_match_hf_rope():
    """RoPE on halves (HF) of W x equals, up to the same permutation, RoPE on adjacent pairs
    (llama.cpp) of permute(W) x; applied to q and k alike, the attention scores are unchanged."""
    rng = np.random.default_rng(0)
    n_heads, head_dim, pos = 3, 8, 5
    w = rng.standard_normal((n_heads * head_dim, 16))
    x = rng.standard_normal(16)
    angle = pos * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
    cos, sin = np.cos(angle), np.sin(angle)

    q = (w @ x).reshape(n_heads, 2, head_dim // 2)  # HF: rotate (first half, second half) pairs
    hf = np.concatenate([q[:, 0] * cos - q[:, 1] * sin, q[:, 1] * cos + q[:, 0] * sin], axis=-1)

    p = (permute_qk(w, n_heads) @ x).reshape(n_heads, head_dim // 2, 2)  # llama.cpp: rotate adjacent pairs
    cpp = np.stack([p[..., 0] * cos - p[..., 1] * sin, p[..., 1] * cos + p[..., 0] * sin], axis=-1)

    np.testing.assert_allclose(permute_qk(hf.reshape(-1, 1), n_heads).ravel(), cpp.ravel(), rtol=1e-12)


peers = pytest.mark.skipif(os.environ.get("LOOM_TEST_PEERS") != "1",
                           reason="set LOOM_TEST_PEERS=1: building the llama.cpp peer venv compiles llama.cpp "
                                  "(minutes), so it is not in the default suite")


def build_tiny_llama(d: Path, heads: int, kv_heads: int):
    """A 2-layer random Llama of hidden size 64, saved to `d`: (d, the transformers model)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight changes the tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), heads=4, kv_heads=2)


@peers
def test_llamacpp_f32_greedy_matches_transformers(tiny_llama, tmp_path):
    from loom.bench.llamacpp import run_llamacpp
    from loom.models.gguf import export_gguf

    model_dir, model = tiny_llama
    prompt = [1, 17, 200, 45, 3, 99, 128, 7, 64, 250, 12, 33]
    gguf_path = export_gguf(model_dir, tmp_path / "tiny-f32.gguf", "f32")
    result = run_llamacpp(gguf_path, prompt, max_tokens=8, threads=2, repeats=1)
    assert result["generated_ids"] == hf_greedy(model, prompt, 8)


@peers
def test_llamacpp_q8_0_runs(tiny_llama, tmp_path):
    from loom.bench.llamacpp import run_llamacpp
    from loom.models.gguf import export_gguf

    model_dir, _ = tiny_llama
    gguf_path = export_gguf(model_dir, tmp_path / "tiny-q8_0.gguf", "q8_0")
    result = run_llamacpp(gguf_path, [1, 5, 9, 200], max_tokens=8, threads=2, repeats=2)
    assert len(result["generated_ids"]) == 8 and "decode_tok_per_s" in result


@peers
def test_llamacpp_decode_run_stays_loaded_between_runs(tiny_llama, tmp_path):
    """The peer kept loaded for runs one at a time (batch 1 taking turns with Loom): every run
    decodes the prompt afresh, greedy as transformers; a peer that cannot load says why."""
    from loom.bench.llamacpp import LlamaCppDecodeRun
    from loom.models.gguf import export_gguf

    model_dir, model = tiny_llama
    prompt = [1, 17, 200, 45, 3, 99, 128, 7, 64, 250, 12, 33]
    gguf_path = export_gguf(model_dir, tmp_path / "tiny-f32.gguf", "f32")
    with LlamaCppDecodeRun(gguf_path, prompt, max_tokens=8, threads=2) as run:
        for _ in range(2):
            run.decode()
            assert run.generated_ids == hf_greedy(model, prompt, 8)
    with pytest.raises(RuntimeError, match="llama.cpp peer ended"):
        LlamaCppDecodeRun(tmp_path / "missing.gguf", prompt, max_tokens=8, threads=2)


@peers
def test_llamacpp_q8_0_kv_cache_greedy_matches_transformers(tmp_path):
    """llama.cpp's 8-bit cache (what `loom bench latency --kv-cache-dtype int8` gives it): f32
    weights, a short greedy run, the same tokens as transformers'."""
    from loom.bench.llamacpp import run_llamacpp
    from loom.models.gguf import export_gguf

    model_dir, model = build_tiny_llama(tmp_path / "model", heads=2, kv_heads=1)  # q8_0 rows: 32 dims a block
    prompt = [1, 17, 200, 45, 3, 99, 128, 7, 64, 250, 12, 33]
    gguf_path = export_gguf(model_dir, tmp_path / "tiny-f32.gguf", "f32")
    result = run_llamacpp(gguf_path, prompt, max_tokens=8, threads=2, repeats=1, kv_cache_q8_0=True)
    assert result["generated_ids"] == hf_greedy(model, prompt, 8)


@peers
def test_llama_server_serves_the_same_greedy_tokens(tiny_llama):
    """llama.cpp's llama-server, built from the same sources and started as `loom bench serve`
    starts it, on the f32 GGUF: its greedy tokens through /v1/completions equal transformers'."""
    import httpx

    from loom.bench.servers import launch_llama_server

    from loom.bench.serve import ServeRequest

    model_dir, model = tiny_llama
    prompt = [1, 17, 200, 45, 3, 99, 128, 7, 64, 250, 12, 33]
    server = launch_llama_server(model_dir, "float32", parallel=2, context_per_slot=64, threads=2,
                                 probe=ServeRequest(prompt, len(prompt), 1))
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "n_probs": 1}
        r = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        assert r["tokens"] == hf_greedy(model, prompt, 8)
    finally:
        server.stop()


@peers
def test_llama_cpp_python_server_writes_loom_s_greedy_text():
    """llama-cpp-python's OpenAI server, started as `loom bench serve` starts it, on the house
    model's f32 GGUF (its byte-level BPE vocabulary exported along): a text prompt's greedy
    continuation equals Loom's."""
    import httpx

    from loom import LLM, SamplingParams
    from loom.bench.serve import ServeRequest, request_body
    from loom.bench.servers import launch_llama_cpp_python
    from loom.cli.generate import DEFAULT_MODEL

    want = LLM(str(DEFAULT_MODEL)).generate("ROMEO:", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0].text
    request = ServeRequest("ROMEO:", 3, 16)
    server = launch_llama_cpp_python(DEFAULT_MODEL, "float32", context=256, threads=2, probe=request)
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json=request_body(server.model, request, stream=False),
                            timeout=60).json()
        assert answer["choices"][0]["text"] == want
    finally:
        server.stop()
