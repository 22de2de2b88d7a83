"""Serving benchmark against any OpenAI-compatible server: streamed /v1/completions requests
sent at a fixed concurrency or as Poisson arrivals, timed on the client. On a machine the server
shares, the client's CPU per streamed token is taken from the server's cores, so the client does
as little as it can: a connection of its own per request on the event loop, the response read
by httptools (the C parser uvicorn uses), each piece of the body only noted with its arrival
time while the stream lasts. It takes about half the CPU per token aiohttp's client took, which
took 40% of httpx's.

Per request: time to first token (TTFT: send to the first chunk with tokens), inter-token
latencies (ITL: between chunks; a chunk may carry several tokens, and the gap then counts
once), time per output token after the first (TPOT: (end - first) / (tokens - 1)) and
end-to-end latency. Tokens are what the server's usage says (the last chunk, as
`stream_options.include_usage` asks), else the chunks counted.

Prompts are text when the bench has the model's tokenizer (random token ids decoded, as vLLM's
random dataset makes them; a server that takes text only can then be measured), else token
ids, so a model without a tokenizer can be measured too. Every server of a run reads the same
prompts. `run_offline` drives Loom's engine in-process the same way, the baseline of the
server's own overhead.
"""
from __future__ import annotations

import asyncio
import json
import random
import ssl
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httptools

from loom.bench import clock
from loom.bench.report import model_label
from loom.tokenizer import Tokenizer

if TYPE_CHECKING:
    from loom import LLM

REQUEST_TIMEOUT_S = 3600.0  # one streamed request, end to end


@dataclass
class ServeRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens, as the model's tokenizer counts them
    output_len: int


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                  vocab_size: int, tokenizer: Tokenizer | None = None) -> list[ServeRequest]:
    """Random prompts of lengths drawn from `prompt_range`: text when `tokenizer` is given (its
    random ids decoded, re-encoded and cut to length, so the text reads back as about that many
    tokens), else ids below `vocab_size`. Output lengths are drawn from `output_range`."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        n, output_len = rng.randint(*prompt_range), rng.randint(*output_range)
        if tokenizer is None:
            workload.append(ServeRequest([rng.randrange(3, vocab_size) for _ in range(n)], n, output_len))
            continue
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(2 * n)]  # merging on re-encoding shortens
        text = tokenizer.decode(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:n])
        workload.append(ServeRequest(text, len(tokenizer.encode(text)), output_len))
    return workload


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(model: str, request: ServeRequest, stream: bool = True) -> dict:
    """Greedy, exactly `output_len` tokens: ignore_eos (vLLM's, llama-server's) and min_tokens
    (llama-cpp-python's way; Loom takes both); return_token_ids (vLLM's) lets tokens stream even
    from a model without a tokenizer. Each server ignores the fields it does not know."""
    return {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
            "min_tokens": request.output_len, "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}), "return_token_ids": True}


class _Exchange(asyncio.Protocol):
    """One HTTP/1.1 request on a connection of its own: the response's status, and each piece of
    its body with when it arrived."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.framed = False  # chunked, or of a stated length: closing early is then an error
        self.pieces: list[tuple[float, bytes]] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._end(ValueError(f"malformed HTTP response: {error}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.framed |= name.lower() in (b"transfer-encoding", b"content-length")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.pieces.append((clock.now(), body))

    def on_message_complete(self) -> None:
        self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        # Only a body without a length or chunks ends with the connection.
        early = exc is not None or self.framed or not self.status
        self._end(ConnectionError(f"the server closed the connection mid-response{f' ({exc})' if exc else ''}")
                  if early else None)

    def _end(self, error: Exception | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)


async def _post(url: str, payload: dict, headers: dict[str, str]) -> _Exchange:
    """POSTs `payload` as JSON to `url` (http or https) and waits for the whole response."""
    parts = urlsplit(url)
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
    body = json.dumps(payload).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": parts.netloc, "Content-Type": "application/json",
                                                 "Content-Length": str(len(body)), "Connection": "close",
                                                 **headers}.items())
    request = f"POST {parts.path or '/'} HTTP/1.1\r\n{head}\r\n".encode() + body
    loop = asyncio.get_running_loop()
    transport, exchange = await loop.create_connection(lambda: _Exchange(request), host, port, ssl=tls)
    try:
        await exchange.done
    finally:
        transport.close()
    return exchange


async def _one(url: str, model: str, request: ServeRequest, headers: dict[str, str]) -> RequestResult:
    """One streamed request; the events' JSON is read after the stream ends."""
    result = RequestResult(request.prompt_len)
    start = clock.now()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            response = await _post(url, request_body(model, request), headers)
        result.e2e = clock.now() - start
        if response.status != 200:
            result.error = f"HTTP {response.status}: {b''.join(p for _, p in response.pieces)[:200]!r}"
            return result
        pending, arrivals = b"", []
        for arrival, data in response.pieces:
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or []):
                    arrivals.append(arrival)
        if arrivals:
            result.ttft = arrivals[0] - start
            result.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
        result.output_tokens = result.output_tokens or len(arrivals)
        result.ok = bool(arrivals)
        result.error = "" if result.ok else "no text streamed"
    except (OSError, TimeoutError, ValueError) as error:  # ValueError: bad JSON or HTTP
        result.error = f"{type(error).__name__}: {error}"
    return result


Probe = Callable[[], dict[str, float]]


async def _run(base_url: str, model: str, workload: list[ServeRequest], concurrency: int | None,
               request_rate: float | None, seed: int, api_key: str | None, duration: float | None,
               probe: Probe | None, probe_every: float) -> tuple[list[RequestResult], float, list[dict]]:
    # A connection per request: llama.cpp's HTTP server closes a kept-alive connection after a few
    # requests, and a request sent on it as it closes fails without an answer.
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency or len(workload))
    rng = random.Random(seed)
    samples: list[dict] = []

    async def gated(request: ServeRequest, delay: float) -> RequestResult:
        await asyncio.sleep(delay)
        async with gate:
            return await _one(url, model, request, headers)

    async def sample(start: float) -> None:
        while True:
            samples.append({"t": clock.now() - start, **await asyncio.to_thread(probe)})
            await asyncio.sleep(probe_every)

    delays, t = [], 0.0
    for _ in workload:  # Poisson arrivals: exponential gaps at the request rate
        if duration is not None and t >= duration:
            break
        delays.append(t)
        t += rng.expovariate(request_rate) if request_rate else 0.0
    start = clock.now()
    sampler = asyncio.create_task(sample(start)) if probe else None
    results = await asyncio.gather(*(gated(r, d) for r, d in zip(workload, delays)))
    elapsed = clock.now() - start
    if sampler:
        sampler.cancel()
    return list(results), elapsed, samples


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"mean_ms": 1000 * statistics.fmean(ordered), "median_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughput and latency figures of a run's requests."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(results), "completed": len(done),
        "errors": [r.error for r in results if not r.ok][:10], "num_errors": len(results) - len(done),
        "duration_s": duration, "request_throughput": len(done) / duration, "output_tok_per_s": output / duration,
        "total_input_tokens": sum(r.prompt_len for r in done), "total_output_tokens": output,
        "ttft": _summary([r.ttft for r in done]), "tpot": _summary([t for r in done if (t := r.tpot) is not None]),
        "itl": _summary([x for r in done for x in r.itl]), "e2e": _summary([r.e2e for r in done]),
        "requests": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results],
    }


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (Loom's server runs on it too): about 15% less client CPU per
    streamed chunk than asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def benchmark(base_url: str, model: str, workload: list[ServeRequest], concurrency: int | None = None,
              request_rate: float | None = None, seed: int = 0, api_key: str | None = None,
              duration: float | None = None, probe: Probe | None = None, probe_every: float = 10.0) -> dict:
    """Runs the workload against the server; the figures as a dict. With `duration`, only the
    requests arriving before it are sent; `probe` (resident memory, KV usage: whatever it reads)
    is sampled every `probe_every` seconds while the run lasts."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        results, elapsed, samples = runner.run(_run(base_url.rstrip("/"), model, workload, concurrency, request_rate,
                                                    seed, api_key, duration, probe, probe_every))
    return {"base_url": base_url, "model": model, "concurrency": concurrency, "request_rate": request_rate,
            **summarize(results, elapsed), **({"samples": samples} if probe else {})}


def offline_llm(model_dir: Path, weights: str, concurrency: int, threads: int) -> LLM:
    """Loom's engine in this process as `run_offline` drives it, warmed by one short request."""
    from loom import LLM, SamplingParams

    dtype, quantization = split_weights(weights)
    llm = LLM(str(model_dir), dtype=dtype, quantization=quantization, max_num_seqs=concurrency, num_threads=threads)
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return llm


def run_offline(llm: LLM, workload: list[ServeRequest], concurrency: int) -> dict:
    """The workload through Loom's engine in this process, `concurrency` requests in flight as
    the HTTP clients keep them (the next one added when one finishes), timed like them: what
    the server adds on top is the difference."""
    from loom import SamplingParams

    engine = llm.engine
    pending = list(reversed(workload))
    inflight: dict[str, tuple[RequestResult, float]] = {}  # id -> (result, time of its last token)
    results: list[RequestResult] = []
    start = clock.now()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            request = pending.pop()
            prompt = request.prompt if isinstance(request.prompt, str) else {"prompt_token_ids": request.prompt}
            params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
            result = RequestResult(request.prompt_len)
            inflight[engine.add_request(prompt, params)] = (result, clock.now())
            results.append(result)
        for out in engine.step():
            result, sent_or_last = inflight[out.request_id]
            now, tokens = clock.now(), len(out.outputs[0].token_ids)
            if tokens > result.output_tokens:
                if result.output_tokens == 0:
                    result.ttft = now - sent_or_last
                    result.e2e = result.ttft  # e2e accumulates from the send: ttft + the gaps after
                else:
                    result.itl.append(now - sent_or_last)
                    result.e2e += now - sent_or_last
                result.output_tokens = tokens
                inflight[out.request_id] = (result, now)
            if out.finished:
                result.ok = out.outputs[0].finish_reason == "length"
                result.error = "" if result.ok else f"finished with {out.outputs[0].finish_reason}"
                del inflight[out.request_id]
    return {"base_url": None, "model": model_label(llm.engine.config.model), "concurrency": concurrency, "request_rate": None,
            **summarize(results, clock.now() - start)}


def ratios(runs: list[dict]) -> dict[str, float]:
    """Loom's server against each peer (output tok/s) and against its own engine offline (output
    tok/s and median TPOT), for each weight format."""
    ratios = {}
    for mine in (r for r in runs if r["server"] == "loom"):
        w = mine["weights"]
        for other in (r for r in runs if r["weights"] == w and r["server"] not in ("loom", "offline")):
            if other["output_tok_per_s"]:
                ratios[f"{w}: loom / {other['server']} output tok/s"] = \
                    mine["output_tok_per_s"] / other["output_tok_per_s"]
        for offline in (r for r in runs if r["weights"] == w and r["server"] == "offline"):
            ratios[f"{w}: loom serve / offline engine output tok/s"] = \
                mine["output_tok_per_s"] / offline["output_tok_per_s"]
            if mine["tpot"] and offline["tpot"]:
                ratios[f"{w}: loom serve / offline engine median TPOT"] = \
                    mine["tpot"]["median_ms"] / offline["tpot"]["median_ms"]
    return ratios


def ratios_over_rounds(runs: list[dict]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The median over rounds of each round's `ratios`, and those per round. Targets take turns
    within a round, so a ratio pairs runs minutes apart and the machine's drift mostly cancels."""
    by_round = [ratios([r for r in runs if r["round"] == i]) for i in sorted({r["round"] for r in runs})]
    return {k: statistics.median(rr[k] for rr in by_round) for k in by_round[0]}, by_round


def split_weights(weights: str) -> tuple[str, str | None]:
    """A weight format as (dtype, quantization): float32, bfloat16, or int8 / int4 over bf16."""
    return (weights, None) if weights in ("float32", "bfloat16") else ("bfloat16", weights)


def soak_plot(path: Path, title: str, runs: list[dict]) -> None:
    """Resident memory and KV usage of each soaked server over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loom.bench.report import cpu_label

    fig, (mem, kv) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in runs:
        samples, label = run.get("samples") or [], f"{run['server']} {run['weights'] or ''}"
        t = [s["t"] for s in samples]
        if samples and "rss_bytes" in samples[0]:
            mem.plot(t, [s["rss_bytes"] / 2**20 for s in samples], label=label)
        if samples and "kv_cache_usage_perc" in samples[0]:
            kv.plot(t, [100 * s["kv_cache_usage_perc"] for s in samples], label=label)
    mem.set_ylabel("resident memory (MiB)")
    kv.set_ylabel("KV cache in use (%)")
    kv.set_xlabel("seconds since the first request")
    for ax in (mem, kv):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    mem.set_title(f"{title}\n{cpu_label()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
