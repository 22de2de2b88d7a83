"""Servers `loom bench serve` starts itself, each on a free loopback port and stopped after:
`loom serve`; llama.cpp's `llama-server` and llama-cpp-python's server
(`python -m llama_cpp.server`) on the same weights written as GGUF."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loom.bench import clock
from loom.bench.llamacpp import peer_gguf
from loom.bench.serve import ServeRequest, request_body, split_weights
from loom.config import cache_root

# Loom's weight formats and the GGUF type the llama.cpp servers run for each.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}


@dataclass
class Launched:
    name: str
    url: str
    model: str  # the name the server answers to
    process: subprocess.Popen
    log: Path
    startup_s: float = 0.0       # launch to ready (a healthy /health, or /v1/models where there is none)
    first_answer_s: float = 0.0  # launch to the first request answered

    def rss_bytes(self) -> int:
        """The server process's resident memory now."""
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, cmd: list[str], port: int, model: str, probe: ServeRequest, timeout: float,
           ready_path: str = "/health", env: dict[str, str] | None = None) -> Launched:
    """Starts `cmd`, waits until `ready_path` answers 200 (the servers answer 503 while loading),
    then sends `probe` (one token) and waits for its answer."""
    log = cache_root() / "peers" / f"{name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start, deadline = clock.now(), time.monotonic() + timeout  # the deadline bounds a wait: the machine's clock
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Launched(name, f"http://127.0.0.1:{port}", model, process, log)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode} while starting; see {log}")
        try:
            if httpx.get(server.url + ready_path, timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} was not ready after {timeout:.0f} s; see {log}")
        time.sleep(0.2)
    server.startup_s = clock.now() - start
    first = ServeRequest(probe.prompt, probe.prompt_len, 1)
    answer = httpx.post(server.url + "/v1/completions", json=request_body(model, first, stream=False), timeout=timeout)
    if answer.status_code != 200:
        server.stop()
        raise RuntimeError(f"{name} answered its first request with HTTP {answer.status_code}: {answer.text[:300]}")
    server.first_answer_s = clock.now() - start
    return server


def launch_loom(model_dir: Path, weights: str, max_num_seqs: int, threads: int, probe: ServeRequest,
                compile_cache: Path | None = None, timeout: float = 900) -> Launched:
    """`loom serve` on `model_dir` in `weights` (a dtype, or int8 / int4 over bf16). With
    `compile_cache`, torch's compiled graphs and Loom's C++ kernels are built into and read from
    that folder (an empty one: a cold start)."""
    port = free_port()
    dtype, quantization = split_weights(weights)
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--model", str(model_dir), "--dtype", dtype, "--port", str(port),
           "--threads", str(threads), "--max-num-seqs", str(max_num_seqs)]
    if quantization:
        cmd += ["--quantization", quantization]
    env = None
    if compile_cache is not None:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(compile_cache / "inductor"),
                   TORCH_EXTENSIONS_DIR=str(compile_cache / "extensions"))
    return _start("loom", cmd, port, Path(model_dir).resolve().name, probe, timeout, env=env)


def _gguf(model_dir: Path, weights: str) -> Path:
    return peer_gguf(model_dir, GGUF_TYPES[weights])


def launch_llama_server(model_dir: Path, weights: str, parallel: int, context_per_slot: int, threads: int,
                        probe: ServeRequest, timeout: float = 900) -> Launched:
    """llama.cpp's llama-server (continuous batching, `parallel` slots) on `model_dir` written as
    the GGUF type matching `weights`."""
    from loom.bench.llamacpp import ensure_llama_server

    binary = ensure_llama_server()
    port = free_port()
    name = Path(model_dir).resolve().name
    cmd = [str(binary), "-m", str(_gguf(model_dir, weights)), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-cb", "-c", str(parallel * context_per_slot),
           "--alias", name]
    return _start("llama-server", cmd, port, name, probe, timeout)


def launch_llama_cpp_python(model_dir: Path, weights: str, context: int, threads: int, probe: ServeRequest,
                            timeout: float = 900) -> Launched:
    """llama-cpp-python's OpenAI server (one request at a time) on the same GGUF. It takes text
    prompts only. Its default of cutting a stream short when another request arrives is turned
    off: under concurrent clients it would end nearly every stream early."""
    from loom.bench.llamacpp import ensure_llama_cpp_server

    python = ensure_llama_cpp_server()
    port = free_port()
    name = Path(model_dir).resolve().name
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(_gguf(model_dir, weights)), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--n_ctx", str(context), "--model_alias", name, "--interrupt_requests", "False"]
    # /v1/models: this server has no /health; it loads the model before it listens
    return _start("llama-cpp-python", cmd, port, name, probe, timeout, ready_path="/v1/models")


def launch(name: str, model_dir: Path, weights: str, slots: int, context_per_slot: int, threads: int,
           probe: ServeRequest, compile_cache: Path | None = None) -> Launched:
    """Starts the server `name` ("loom", "llama-server" or "llama-cpp-python") for `slots`
    requests at once of up to `context_per_slot` tokens each."""
    if name == "loom":
        return launch_loom(model_dir, weights, slots, threads, probe, compile_cache)
    if name == "llama-server":
        return launch_llama_server(model_dir, weights, slots, context_per_slot, threads, probe)
    if name == "llama-cpp-python":
        return launch_llama_cpp_python(model_dir, weights, context_per_slot, threads, probe)
    raise ValueError(f"no server named {name!r}")


def loom_gauges(url: str) -> dict[str, float]:
    """Loom's gauges from the server's /metrics, and its resident memory as rss_bytes where it
    says (empty for a server without them)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return {}
    gauges = {f.name.removeprefix("loom:"): f.samples[0].value for f in families
              if f.type == "gauge" and f.name.startswith("loom:") and f.samples}
    rss = [f.samples[0].value for f in families if f.name == "process_resident_memory_bytes" and f.samples]
    return gauges | ({"rss_bytes": rss[0]} if rss else {})


def settled_kv_usage(url: str, idle: float | None, polls: int = 50) -> float | None:
    """KV usage once it is back to `idle`, or after `polls` tries 0.1 s apart."""
    usage = None
    for _ in range(polls):
        usage = loom_gauges(url).get("kv_cache_usage_perc")
        if usage is None or usage == idle:
            break
        time.sleep(0.1)
    return usage
