"""Serving benchmark against any OpenAI-compatible server: streamed /v1/completions requests
sent at a fixed concurrency or as Poisson arrivals, timed on the client.

Per request: time to first token (TTFT: send to the first chunk with tokens), inter-token
latencies (ITL: between chunks; a chunk may carry several tokens, and the gap then counts
once), time per output token after the first (TPOT: (end - first) / (tokens - 1)) and
end-to-end latency. Tokens are what the server's usage says (the last chunk, as
`stream_options.include_usage` asks), else the chunks counted. Prompts are token ids, so a
model without a tokenizer can be measured and every server reads the same tokens.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx


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


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(len(prompt))
    # return_token_ids (vLLM's, ignored elsewhere): tokens stream even from a model without a tokenizer
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def _run(base_url: str, model: str, workload: list[tuple[list[int], int]], concurrency: int | None,
               request_rate: float | None, seed: int, api_key: str | None) -> tuple[list[RequestResult], float]:
    # A connection per request: llama.cpp's HTTP server closes a kept-alive connection after a few
    # requests, and a request sent on it as it closes fails without an answer.
    limits = httpx.Limits(max_connections=max(concurrency or len(workload), 1), max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency or len(workload))
    rng = random.Random(seed)

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits,
                                 headers=headers) as client:
        async def gated(prompt: list[int], max_tokens: int, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            async with gate:
                return await _one(client, model, prompt, max_tokens)

        delays, t = [], 0.0
        for _ in workload:  # Poisson arrivals: exponential gaps at the request rate
            delays.append(t)
            t += rng.expovariate(request_rate) if request_rate else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p, n, d) for (p, n), d in zip(workload, delays)))
        return list(results), time.perf_counter() - start


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"mean_ms": 1000 * statistics.fmean(ordered), "median_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def benchmark(base_url: str, model: str, workload: list[tuple[list[int], int]], concurrency: int | None = None,
              request_rate: float | None = None, seed: int = 0, api_key: str | None = None) -> dict:
    """Runs the workload (prompt ids, output tokens) against the server; the figures as a dict."""
    results, duration = asyncio.run(_run(base_url.rstrip("/"), model, workload, concurrency, request_rate, seed,
                                         api_key))
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    return {
        "base_url": base_url, "model": model, "num_requests": len(results), "completed": len(done),
        "errors": [r.error for r in results if not r.ok][:10], "num_errors": len(results) - len(done),
        "concurrency": concurrency, "request_rate": request_rate, "duration_s": duration,
        "request_throughput": len(done) / duration, "output_tok_per_s": output / duration,
        "total_input_tokens": sum(r.prompt_len for r in done), "total_output_tokens": output,
        "ttft": _summary([r.ttft for r in done]), "tpot": _summary([t for r in done if (t := r.tpot) is not None]),
        "itl": _summary([x for r in done for x in r.itl]), "e2e": _summary([r.e2e for r in done]),
        "requests": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results],
    }
