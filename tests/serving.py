"""A real HTTP server for tests: `loom serve`'s app and engine on uvicorn in the test's own
process, on a free loopback port, so a test can also look at the engine's state."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import httpx

from loom import LLM
from loom.engine.async_llm_engine import AsyncLLMEngine
from loom.server.app import ServerConfig, build_app
from loom.server.metrics import Metrics

from conftest import pause


POLL_S = 0.05


def poll(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` holds within about `seconds` of checking it every POLL_S (a bound on
    waiting, counted in sleeps: nothing here measures time)."""
    for _ in range(round(seconds / POLL_S)):
        if condition():
            return True
        pause(POLL_S)
    return condition()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    def __init__(self, llm: LLM, **config: object) -> None:
        import uvicorn

        self.metrics = Metrics("house")
        self.engine = AsyncLLMEngine(llm.engine, on_step=self.metrics.record)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(ServerConfig(model_name="house", **config), lambda: self.engine, self.metrics)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert poll(lambda: self.server.started, 30), "server did not start"

    def idle(self, timeout: float = 2.0) -> bool:
        """Whether every request has ended and every block is back in the pool within `timeout`."""
        def settled() -> bool:
            if self.engine.num_requests or self.engine.engine.has_unfinished_requests():
                return False
            stats = self.engine.engine.stats()
            return stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0

        return poll(settled, timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown(5)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value}, the model_name label left out."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
