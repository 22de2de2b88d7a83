"""Prometheus metrics under vLLM's names with a `loom:` prefix, so dashboards built for vLLM port
by changing the prefix. Updated on the engine's step thread after every step; prometheus-client
is thread-safe, and `/metrics` renders whatever the last step left."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from loom.engine.llm_engine import LLMEngine

# Bucket bounds (seconds) as vLLM's, trimmed to what a CPU engine can show.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and the like, as vLLM exposes
        labels, r = ["model_name"], self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"loom:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"loom:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"loom:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests decoding or prefilling in the last step.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (including swapped out).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed or swapped out).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a token.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter("loom:request_success", "Requests finished, by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between a request's successive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self._state = (0, 0, 0.0)  # what the gauges show: running, waiting, KV usage
        self._seen = (0, 0, 0)  # the engine's cumulative prefix queries, hits and preemptions so far
        # With several ranks (Loom's own): collectives rank 0 issued, by kind (all_reduce, gather, broadcast)
        self.collective_calls = Counter("loom:collective_calls", "Collectives issued, by kind.", labels + ["kind"],
                                        registry=r)
        self.collective_bytes = Counter("loom:collective_bytes", "Bytes each rank put into collectives, by kind.",
                                        labels + ["kind"], registry=r)
        self._model_name = model_name
        self._seen_calls: dict[str, int] = {}  # the engine's cumulative collective calls and bytes so far
        self._seen_bytes: dict[str, int] = {}

    def record(self, engine: LLMEngine) -> None:
        """After a step, on the step thread: the engine's state and what the step did. It runs
        between every two steps, so it reads the engine's counters without walking its blocks and
        leaves alone the metrics the step did not move (each update takes a lock)."""
        stats, it = engine.stats(kv_slots=False), engine.last_iteration
        state = (stats.num_running, stats.num_waiting + stats.num_swapped,
                 1 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        if state != self._state:
            for gauge, value in zip((self.running, self.waiting, self.kv_usage), state):
                gauge.set(value)
            self._state = state
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        if totals != self._seen:
            for counter, now, before in zip((self.prefix_queries, self.prefix_hits, self.preemptions), totals,
                                            self._seen):
                counter.inc(now - before)
            self._seen = totals
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for counter, totals, seen in ((self.collective_calls, stats.collective_calls, self._seen_calls),
                                      (self.collective_bytes, stats.collective_bytes, self._seen_bytes)):
            for kind, total in totals.items():
                counter.labels(self._model_name, kind).inc(total - seen.get(kind, 0))
                seen[kind] = total
        for value in it.time_to_first_token:
            self.ttft.observe(value)
        for value in it.inter_token_latency:
            self.itl.observe(value)
        for finished in it.finished:
            self.success[finished.finish_reason].inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue.observe(finished.queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
