"""Servers `loom bench serve` starts itself, each on a free loopback port and stopped after:
`loom serve`, and llama.cpp's `llama-server` on the same weights written as GGUF."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loom.config import cache_root

# Loom's weight formats and the GGUF type llama-server runs for each.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}


@dataclass
class Launched:
    name: str
    url: str
    model: str  # the name the server answers to
    process: subprocess.Popen
    log: Path
    startup_s: float = 0.0  # launch to a healthy /health

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, cmd: list[str], port: int, model: str, timeout: float) -> Launched:
    log = cache_root() / "peers" / f"{name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Launched(name, f"http://127.0.0.1:{port}", model, process, log)
    while True:  # both servers answer /health with 200 once they can serve, 503 while loading
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode} while starting; see {log}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.perf_counter() - start > timeout:
            server.stop()
            raise RuntimeError(f"{name} was not healthy after {timeout:.0f} s; see {log}")
        time.sleep(0.2)
    server.startup_s = time.perf_counter() - start
    return server


def launch_loom(model_dir: Path, weights: str, max_num_seqs: int, threads: int, timeout: float = 900) -> Launched:
    """`loom serve` on `model_dir` in `weights` (a dtype, or int8 / int4 over bf16)."""
    port = _free_port()
    dtype, quantization = (weights, None) if weights in ("float32", "bfloat16") else ("bfloat16", weights)
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--model", str(model_dir), "--dtype", dtype, "--port", str(port),
           "--threads", str(threads), "--max-num-seqs", str(max_num_seqs)]
    if quantization:
        cmd += ["--quantization", quantization]
    return _start("loom", cmd, port, Path(model_dir).resolve().name, timeout)


def launch_llama_server(model_dir: Path, weights: str, parallel: int, context_per_slot: int, threads: int,
                        timeout: float = 900) -> Launched:
    """llama.cpp's llama-server (continuous batching, `parallel` slots) on `model_dir` written as
    the GGUF type matching `weights`."""
    from loom.bench.llamacpp import ensure_llama_server
    from loom.models.gguf import export_gguf

    binary = ensure_llama_server()
    gguf_type = GGUF_TYPES[weights]
    gguf = cache_root() / "peers" / "gguf" / f"{Path(model_dir).name}-{gguf_type}.gguf"
    if not gguf.is_file():
        export_gguf(model_dir, gguf, gguf_type)
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-cb", "-c", str(parallel * context_per_slot),
           "--alias", Path(model_dir).resolve().name]
    return _start("llama-server", cmd, port, Path(model_dir).resolve().name, timeout)
