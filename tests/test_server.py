"""The OpenAI-compatible server: the official `openai` client and raw bodies against a real
HTTP server on a free port, compared with the offline engine; disconnects, limits and bad
input."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from loom import LLM, SamplingParams
from loom.engine.async_llm_engine import AsyncLLMEngine
from loom.server.app import ServerConfig, build_app
from loom.server.metrics import Metrics
from conftest import pause
from serving import POLL_S, ThreadedServer, free_port, poll, scrape

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "What is the secret number of JULIET?"]


@pytest.fixture(scope="module")
def offline():
    return LLM(str(HOUSE), max_num_seqs=32)


@pytest.fixture(scope="module")
def server():
    s = ThreadedServer(LLM(str(HOUSE), max_num_seqs=32))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ---- the openai client ----------------------------------------------------------------------------
def test_completions_equal_offline_streamed_or_not(client, offline):
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy(), use_tqdm=False)]
    batch = client.completions.create(model="house", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == want
    assert batch.usage.completion_tokens == 24 * len(PROMPTS)
    assert batch.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(p)) for p in PROMPTS)
    for prompt, text in zip(PROMPTS, want):
        chunks = list(client.completions.create(model="house", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_kv_compression_fields(client, offline):
    prompt = PROMPTS[2]
    want = offline.generate(prompt, greedy(kv_policy="streaming", kv_budget=8), use_tqdm=False)[0].outputs[0].text
    assert want != offline.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model="house", prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"kv_policy": "streaming", "kv_budget": 8})
    assert got.choices[0].text == want


def test_chat_equals_offline_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "Who is JULIET?"}]
    want = offline.chat(messages, greedy(32), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model="house", messages=messages, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want.finish_reason
    chunks = list(client.chat.completions.create(model="house", messages=messages, max_tokens=32, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_n_seed_stop_and_logprobs(client, offline):
    kw = dict(model="house", prompt="ROMEO:", max_tokens=16, temperature=1.0, seed=7)
    first, again = (client.completions.create(n=3, **kw) for _ in range(2))
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    want = offline.generate("ROMEO:", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16), use_tqdm=False)
    assert sorted(c.text for c in first.choices) == sorted(o.text for o in want[0].outputs)

    plain = client.completions.create(model="house", prompt="ROMEO:", max_tokens=24, temperature=0).choices[0].text
    stop = plain.split()[1]
    stopped = client.completions.create(model="house", prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == plain[:plain.index(stop)] and stopped.choices[0].finish_reason == "stop"

    got = client.completions.create(model="house", prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=3)
    ref = offline.generate("ROMEO:", greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)
    assert "".join(lp.tokens) == got.choices[0].text and lp.text_offset[0] == 0

    chat = client.chat.completions.create(model="house", messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompts_logprobs(server, offline, max_tokens):
    """What lm-evaluation-harness's local-completions reads for loglikelihoods: the prompt's
    tokens, their logprobs (None for the first) and top logprobs, then max_tokens generated."""
    prompt = "ROMEO: speak, JULIET"
    ids = offline.get_tokenizer().encode(prompt)
    ref = offline.generate(prompt, greedy(1, prompt_logprobs=2, logprobs=2), use_tqdm=False)[0]
    for sent in (prompt, ids):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": sent, "max_tokens": max_tokens, "echo": True,
                                                              "logprobs": 2, "temperature": 0}).json()
        choice = r["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [d[t].logprob for d, t in zip(ref.prompt_logprobs[1:], ids[1:])]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
        generated = ref.outputs[0].text if max_tokens else ""
        assert choice["text"] == prompt + generated
        assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]).endswith(choice["text"])  # after BOS


def test_models_tokenize_detokenize(server, offline):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["house"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "ROMEO: speak"}).json()
    assert ids["tokens"] == offline.get_tokenizer().encode("ROMEO: speak") and ids["count"] == len(ids["tokens"])
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("ROMEO: speak")
    conversation = [{"role": "user", "content": "Speak."}]
    for add in (True, False):
        got = httpx.post(f"{server.url}/tokenize", json={"messages": conversation, "add_generation_prompt": add})
        assert got.json()["tokens"] == offline.get_tokenizer().encode_chat(conversation, add_generation_prompt=add)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tokenizer = offline.get_tokenizer()
    assert info["eos_token"] == tokenizer.eos_token and info["vocab_size"] == tokenizer.vocab_size
    assert info["chat_templates"] == tokenizer.chat_templates and info["model_max_length"] == 1024


# ---- request bodies as vLLM's `bench serve` sends them -------------------------------------------
def test_bench_serve_bodies(server):
    body = {"model": "house", "prompt": "ROMEO:", "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 20,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 20 and usage["prompt_tokens"] == 3

    chat = {"model": "house", "messages": [{"role": "user", "content": [{"type": "text", "text": "Speak."}]}],
            "temperature": 0.0, "max_completion_tokens": 12, "stream": False, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


def test_concurrent_streams_equal_offline(server, offline):
    prompts = [f"{name}:" for name in ("ROMEO", "JULIET", "MERCUTIO", "TYBALT")] * 8
    want = [o.outputs[0].text for o in offline.generate(prompts, greedy(20, ignore_eos=True), use_tqdm=False)]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True, "ignore_eos": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == want
    assert server.idle()


# ---- clients that leave ---------------------------------------------------------------------------
def test_disconnected_clients_free_their_blocks(server):
    long = {"prompt": "ROMEO:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def leave_mid_stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # closes the connection with the answer half sent

    async def leave_while_waiting(client: httpx.AsyncClient) -> None:
        waiting = asyncio.create_task(client.post("/v1/completions", json=long))
        for _ in range(round(60 / POLL_S)):  # until the engine holds all 32 requests
            if added[0] == 32 or waiting.done():
                break
            await asyncio.sleep(POLL_S)
        waiting.cancel()  # closes the connection with no answer yet
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    async def all_of_them() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await asyncio.gather(*(leave_mid_stream(client) for _ in range(16)),
                                 *(leave_while_waiting(client) for _ in range(16)))

    idle_usage = scrape(server.url)["loom:kv_cache_usage_perc"]
    aborted = scrape(server.url).get("loom:request_success_total{finished_reason=abort}", 0)
    runner = server.engine.engine.runner
    execute = runner.execute
    add_request = server.engine.add_request
    added = [0]

    def counted_add_request(*args, **kwargs):
        added[0] += 1
        return add_request(*args, **kwargs)

    def slow_execute(batch):  # 400 tokens take over 2 s: every client leaves before its answer ends
        pause(0.005)
        return execute(batch)

    runner.execute = slow_execute
    server.engine.add_request = counted_add_request
    try:
        asyncio.run(all_of_them())
    finally:
        runner.execute = execute
        del server.engine.add_request
    assert poll(lambda: scrape(server.url)["loom:kv_cache_usage_perc"] == idle_usage, 2), scrape(server.url)
    assert scrape(server.url)["loom:request_success_total{finished_reason=abort}"] - aborted == 32
    assert server.idle(), server.engine.engine.stats()


def test_metrics_count_what_was_served(server):
    before = scrape(server.url)
    bodies = [{"prompt": "ROMEO:", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
              {"prompt": "JULIET: speak", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}]
    usage = [httpx.post(f"{server.url}/v1/completions", json=bodies[0]).json()["usage"]]
    with httpx.stream("POST", f"{server.url}/v1/completions", json=bodies[1]) as r:
        assert r.status_code == 200 and r.read()
    usage.append({"prompt_tokens": len(httpx.post(f"{server.url}/tokenize", json={"prompt": "JULIET: speak"})
                                        .json()["tokens"]), "completion_tokens": 5})
    assert server.idle()
    after = scrape(server.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("loom:generation_tokens_total") == 12
    assert grew("loom:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert grew("loom:request_success_total{finished_reason=length}") == 2
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"loom:{histogram}_count") == 2, histogram
    assert grew("loom:inter_token_latency_seconds_count") == 6 + 4  # one per token after the first
    assert after["loom:num_requests_running"] == after["loom:num_requests_waiting"] == 0
    assert grew("loom:prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usage)


# ---- bad input -----------------------------------------------------------------------------------
HOSTILE = [
    ({"prompt": "x", "top_k": 2.5}, "top_k"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "n": 10000, "temperature": 1}, "n"),
    ({"prompt": "x", "logprobs": 1000}, "logprobs"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "\udcff abc"}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x " * 5000}, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "min_p": -1}, "min_p"),
    ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": -1}, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop": ["x"] * 100}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "min_tokens": 100, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [["a"]]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": [[1, 2], [3, 10**9]]}, "prompt_token_ids"),
    ({"prompt": ["ROMEO:", ""]}, "prompt"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"prompt": "x", "model": 5}, "model"),
    ({"prompt": "x", "echo": True, "logprobs": 1000}, "logprobs"),
    ({"prompt": "x", "kv_policy": "lru"}, "kv_policy"),
    ({"prompt": "x", "kv_policy": "window", "kv_budget": 2.5}, "kv_budget"),
    ({"prompt": "x", "kv_policy": "streaming", "kv_budget": 0.5}, "kv_budget"),  # no room past the sinks
]


@pytest.mark.parametrize("body, param", HOSTILE)
def test_bad_completions_get_openai_errors(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["code"] == r.status_code


@pytest.mark.parametrize("content", [b"{bad json", b"\xff\xfe{}", b"[1, 2]", b'"text"'])
def test_malformed_bodies(server, content):
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


CHAT_HOSTILE = [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 100, "temperature": 1}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "x"}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, "prompt"),
    ({"messages": [{"role": "user", "content": "\udcff"}]}, "messages"),
]


@pytest.mark.parametrize("body, param", CHAT_HOSTILE)
def test_bad_chats_get_openai_errors(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})  # json.dumps escapes lone surrogates
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"messages": []}),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
    ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": [10**12]}), ("/detokenize", {"tokens": "abc"}),
])
def test_bad_tokenizer_requests(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_bad_chat_and_huge_body(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "' + b"x" * (20 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]
    # after all that, the server is healthy and right
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert server.idle()


def test_chat_without_template_is_refused(hf_models):
    """A checkpoint with a tokenizer but no chat template: 400, never a plain join."""
    model_dir, _ = hf_models("llama_gqa")
    s = ThreadedServer(LLM(str(model_dir)))
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
    finally:
        s.stop()


# ---- limits --------------------------------------------------------------------------------------
def test_api_key_and_full_queue():
    s = ThreadedServer(LLM(str(HOUSE), max_num_seqs=1), api_key="sesame", max_queued_requests=0)
    try:
        body = {"prompt": "ROMEO:", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
        assert httpx.post(f"{s.url}/v1/completions", json=body).status_code == 401
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{s.url}/health").status_code == 200  # open: load balancers probe it
        auth = {"Authorization": "Bearer sesame"}
        runner, release = s.engine.engine.runner, threading.Event()
        execute = runner.execute

        def held_execute(batch):  # the one allowed request stays in flight until released
            release.wait(30)
            return execute(batch)

        runner.execute = held_execute
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, headers=auth, timeout=60) as held:
            assert poll(lambda: s.engine.num_requests == 1, 30)
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=auth)
            assert r.status_code == 429 and r.headers["retry-after"]
            assert r.json()["error"]["type"] == "rate_limit_error"
            release.set()
            runner.execute = execute
            assert held.status_code == 200
        assert s.idle(timeout=10)
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, headers=auth)
        assert r.status_code == 200
    finally:
        s.stop()


def test_failed_step_gives_500_and_the_server_goes_on(server):
    runner = server.engine.engine.runner
    execute = runner.execute
    add_request = server.engine.add_request
    added = [0]

    def counted_add_request(*args, **kwargs):
        added[0] += 1
        return add_request(*args, **kwargs)

    def fail(batch):
        runner.execute = execute  # once
        raise RuntimeError("kernel fault")

    runner.execute = fail
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert server.idle()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


# ---- the command ---------------------------------------------------------------------------------
def test_loom_serve_starts_answers_and_drains_on_sigterm(counter_clock):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", "serve", "--port", str(port), "--model", str(HOUSE)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
            except httpx.TransportError:
                return False

        assert poll(healthy, 300)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "house"
        # SIGTERM with a long stream in flight: the stream runs to its end, then the process exits
        body = {"prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 1000
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Finished server process" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_says_starting_until_the_engine_can_serve():
    from fastapi.testclient import TestClient

    engine: dict[str, AsyncLLMEngine] = {}
    client = TestClient(build_app(ServerConfig(model_name="house"), lambda: engine.get("engine"), Metrics("house")))
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "starting"}
    r = client.post("/v1/completions", json={"prompt": "ROMEO:"})
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "server_error"
    engine["engine"] = AsyncLLMEngine(LLM(str(HOUSE)).engine)
    try:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200
    finally:
        engine["engine"].shutdown(5)


def test_chat_page_is_served(server):
    """The page at / (its browser behaviour needs a browser; here: it is served, whole)."""
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '"/v1/chat/completions"' in r.text and "stream: true" in r.text and r.text.rstrip().endswith("</html>")


@pytest.mark.parametrize("load", [["--concurrency", "4"], ["--request-rate", "50"]])
@pytest.mark.parametrize("prompts", ["ids", "text"])
def test_bench_serve_measures_every_request(server, tmp_path, load, prompts, counter_clock):
    from loom.bench.serve import make_workload
    from loom.cli import main

    text = ["--tokenizer", str(HOUSE)] if prompts == "text" else []
    main(["bench", "serve", "--base-url", server.url, "--model", "house", "--num-requests", "12", *load, *text,
          "--prompt-len", "8", "32", "--output-len", "8", "16", "--seed", "3", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "serve-house.json").read_text())["runs"][0]
    tokenizer = LLM(str(HOUSE)).get_tokenizer()  # its vocabulary is what the bench read from /tokenizer_info
    workload = make_workload(12, (8, 32), (8, 16), 3, tokenizer.vocab_size, tokenizer if text else None)
    assert all(isinstance(w.prompt, str if text else list) for w in workload)
    assert report["completed"] == 12 and report["num_errors"] == 0
    assert report["total_output_tokens"] == sum(r.output_len for r in workload)  # ignore_eos: all of them
    assert report["total_input_tokens"] == sum(w.prompt_len for w in workload)
    assert all(r["output_tokens"] == w.output_len for r, w in zip(report["requests"], workload))
    assert set(report["ttft"]) == {"mean_ms", "median_ms", "p99_ms"} and (tmp_path / "serve-house.png").is_file()
    assert server.idle()


def test_bench_serve_counts_failed_requests(server, counter_clock):
    """A refused request and a server that is not there are errors of the run, each with its
    reason, never an exception that loses the other requests' figures."""
    from loom.bench.serve import ServeRequest, benchmark

    workload = [ServeRequest([5, 6, 7], 3, 4)] * 3
    refused = benchmark(server.url, "no-such-model", workload, concurrency=2)
    assert refused["completed"] == 0 and refused["num_errors"] == 3
    assert all(e.startswith("HTTP 404") and "no-such-model" in e for e in refused["errors"])
    absent = benchmark(f"http://127.0.0.1:{free_port()}", "house", workload, concurrency=2)
    assert absent["num_errors"] == 3 and all(e.startswith("ConnectionRefusedError") for e in absent["errors"])
    served = benchmark(server.url, "house", workload, concurrency=2)
    assert served["num_errors"] == 0 and served["total_output_tokens"] == 12
    assert server.idle()


class _CannedServer(socketserver.ThreadingTCPServer):
    """Answers every request with `response` (raw bytes), then closes the connection."""
    daemon_threads = True

    def __init__(self, response: bytes) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                length = 0
                while (line := self.rfile.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.rfile.read(length)
                self.wfile.write(response)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _sse_events(tokens: int) -> list[bytes]:
    chunks = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(tokens)]
    chunks.append({"choices": [], "usage": {"completion_tokens": tokens}})
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("framing", ["chunked", "length", "close", "cut", "short"])
def test_bench_serve_client_reads_every_framing_and_counts_a_cut_stream_as_an_error(framing, counter_clock):
    """The bench's client reads a streamed body in chunks, of a stated length, or ended by the
    connection's close; a chunked stream the server closes before its last chunk, or a body
    shorter than its length, is an error of that request."""
    from loom.bench.serve import ServeRequest, benchmark

    events = _sse_events(3)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing in ("chunked", "cut"):
        sent = events[:2] if framing == "cut" else events
        body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in sent) + (b"" if framing == "cut" else b"0\r\n\r\n")
        response = head + b"Transfer-Encoding: chunked\r\n\r\n" + body
    elif framing == "length":
        body = b"".join(events)
        response = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "close":
        response = head + b"Connection: close\r\n\r\n" + b"".join(events)
    else:  # short: a length the body never reaches
        response = head + b"Content-Length: 100000\r\n\r\n" + b"".join(events)
    server = _CannedServer(response)
    try:
        run = benchmark(server.url, "m", [ServeRequest([1, 2], 2, 3)] * 2, concurrency=2)
    finally:
        server.shutdown()
        server.server_close()
    if framing in ("cut", "short"):
        assert run["num_errors"] == 2
        assert all(e.startswith("ConnectionError") and "mid-response" in e for e in run["errors"])
    else:
        assert run["num_errors"] == 0 and run["total_output_tokens"] == 6
        assert all(r["output_tokens"] == 3 for r in run["requests"])


def test_bench_serve_soak_samples_memory_and_kv(server, tmp_path, counter_clock):
    """A soak (--duration at a --request-rate) samples the server's resident memory and KV use
    from /metrics while it runs, and finds the KV cache back to idle at its end."""
    from loom.cli import main

    main(["bench", "serve", "--base-url", server.url, "--model", "house", "--request-rate", "8", "--duration", "3",
          "--prompt-len", "8", "16", "--output-len", "4", "8", "--label", "soak", "--out-dir", str(tmp_path)])
    run, = json.loads((tmp_path / "serve-soak.json").read_text())["runs"]
    assert run["num_requests"] > 0 and run["num_errors"] == 0
    assert len(run["samples"]) >= 5 and all(s["rss_bytes"] > 0 and "kv_cache_usage_perc" in s for s in run["samples"])
    assert run["kv_usage_after"] == run["kv_usage_idle"] == 0
    assert run["rss_after_bytes"] > 0 and -0.5 < run["rss_growth_after_warmup"] < 0.5
    assert (tmp_path / "serve-soak.png").is_file() and server.idle()


def test_bench_text_prompts_read_back_as_their_length():
    """Text prompts are random ids decoded: re-encoded, each is as long as the bench says, near
    the length drawn, and the same for the same seed."""
    from loom.bench.serve import make_workload

    tokenizer = LLM(str(HOUSE)).get_tokenizer()
    workload = make_workload(20, (64, 128), (1, 2), 7, 0, tokenizer)
    assert workload == make_workload(20, (64, 128), (1, 2), 7, 0, tokenizer)
    for w in workload:
        assert len(tokenizer.encode(w.prompt)) == w.prompt_len
        assert 64 * 0.9 <= w.prompt_len <= 128 + 1  # +1: the BOS the tokenizer adds


def test_reference_model_borrows_a_tokenizer(tmp_path):
    """with_tokenizer: the same weights (linked), the tokenizer's files and BOS/EOS; a tokenizer
    larger than the model's vocabulary is refused."""
    from loom.models.reference import with_tokenizer

    model = tmp_path / "ref"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text(json.dumps({"vocab_size": 8000, "bos_token_id": 1, "eos_token_id": 2}))
    twin = with_tokenizer(model, HOUSE)
    assert (twin / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert (twin / "tokenizer.json").read_bytes() == (HOUSE / "tokenizer.json").read_bytes()
    house = json.loads((HOUSE / "config.json").read_text())
    config = json.loads((twin / "config.json").read_text())
    assert config["vocab_size"] == 8000
    assert (config["bos_token_id"], config["eos_token_id"]) == (house["bos_token_id"], house["eos_token_id"])
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(ValueError, match="do not fit"):
        with_tokenizer(model.rename(tmp_path / "small"), HOUSE)


def test_model_without_tokenizer_streams_token_ids(hf_models):
    """Token-id prompts to a model with no tokenizer: with return_token_ids (vLLM's field) every
    chunk carries its tokens, and together they are the offline engine's."""
    model_dir, _ = hf_models("llama_gqa")
    llm = LLM(str(model_dir))
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(12, ignore_eos=True), use_tqdm=False)[0]
    s = ThreadedServer(llm)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        assert ids == want.outputs[0].token_ids and len(chunks) >= 12
        plain = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": False}).json()
        assert plain["choices"][0]["token_ids"] == want.outputs[0].token_ids
    finally:
        s.stop()


def test_bench_serve_launches_loom_itself(tmp_path, counter_clock):
    """`--launch loom offline --rounds 2`: the server it starts and the same engine in-process take
    turns on the same text prompts, new prompts each round; every request served in both, the
    server's start-up and first answer recorded, the ratios the medians of the rounds'."""
    import statistics

    from loom.cli import main

    main(["bench", "serve", "--launch", "loom", "offline", "--launch-model", str(HOUSE), "--num-requests", "6",
          "--concurrency", "3", "--prompt-len", "8", "16", "--output-len", "4", "8", "--rounds", "2",
          "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "serve-house.json").read_text())
    assert report["workload"]["prompts"] == "text"
    assert [(r["server"], r["round"]) for r in report["runs"]] == [("loom", 0), ("offline", 0), ("loom", 1),
                                                                    ("offline", 1)]
    for run in report["runs"]:
        assert (run["weights"], run["completed"], run["num_errors"]) == ("bfloat16", 6, 0)
    rounds = [report["runs"][:2], report["runs"][2:]]
    for served, offline in rounds:
        assert [r["prompt_len"] for r in served["requests"]] == [r["prompt_len"] for r in offline["requests"]]
        assert [r["output_tokens"] for r in served["requests"]] == [r["output_tokens"] for r in offline["requests"]]
        assert {"startup_s", "first_answer_s"} <= served.keys() and served["model"] == "house"
    assert [r["prompt_len"] for r in rounds[0][0]["requests"]] != [r["prompt_len"] for r in rounds[1][0]["requests"]]
    keys = {"bfloat16: loom serve / offline engine output tok/s", "bfloat16: loom serve / offline engine median TPOT"}
    assert set(report["ratios"]) == keys and len(report["ratios_by_round"]) == 2
    for k in keys:
        assert report["ratios"][k] == statistics.median(rr[k] for rr in report["ratios_by_round"])
