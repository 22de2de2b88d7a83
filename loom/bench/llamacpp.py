"""The llama.cpp peers: llama-cpp-python in a venv of its own (`loom bench latency`), its
OpenAI server, and llama.cpp's `llama-server` built from the same sources (`loom bench serve`).

The peer lives in a separate venv because llama-cpp-python compiles llama.cpp at install time
(a few minutes) and must not become a dependency of Loom. This file serves both sides: imported
by Loom it builds the venv and drives it; run as a script by the venv's python it times
llama.cpp. So its top level imports nothing outside the standard library. The GGUF files it
runs are written on Loom's side (loom/models/gguf.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PEER_PACKAGES = ["llama-cpp-python", "numpy"]
# A native CPU build (all the SIMD this machine has) with no GPU backend: the peer is a CPU
# baseline. Less AMX: on CPUs that have it, llama.cpp's AMX backend takes q8_0/q4_0 matmuls,
# and in this release it segfaults on them (ggml_backend_amx_mul_mat, llama.cpp issue 20824;
# its q4_0 results were also wrong, PR 16315). An explicit -mno-* wins over -march=native.
_NO_AMX = "-mno-amx-tile -mno-amx-int8"
PEER_CMAKE_ARGS = f"-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF '-DCMAKE_C_FLAGS={_NO_AMX}' '-DCMAKE_CXX_FLAGS={_NO_AMX}'"


def peer_dir() -> Path:
    """Where the peers' venvs and builds live (kept across runs)."""
    from loom.config import cache_root  # imported here: the peer venv has no torch

    return cache_root() / "peers"


def peer_gguf(model_dir: Path, gguf_type: str) -> Path:
    """The model's weights as a GGUF file of `gguf_type` ("f32", "bf16", "q8_0", ...) for the
    llama.cpp peers, written once into Loom's cache."""
    from loom.models.gguf import export_gguf

    gguf = peer_dir() / "gguf" / f"{Path(model_dir).name}-{gguf_type}.gguf"
    if not gguf.is_file():
        export_gguf(model_dir, gguf, gguf_type)
    return gguf


def ensure_llamacpp_venv() -> Path:
    """Creates (once) the peer venv with llama-cpp-python built for this CPU; returns its python."""
    venv = peer_dir() / "llamacpp-venv"
    python = venv / "bin" / "python"
    marker = venv / ".loom-ready"
    env = dict(os.environ)
    env["CMAKE_ARGS"] = env.get("CMAKE_ARGS", PEER_CMAKE_ARGS)
    build = " ".join(PEER_PACKAGES) + "\n" + env["CMAKE_ARGS"] + "\n"
    if marker.is_file() and marker.read_text() == build:
        return python
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    run_logged([[sys.executable, "-m", "venv", "--clear", str(venv)],
                 [str(python), "-m", "pip", "install", "--no-cache-dir", *PEER_PACKAGES]],
                peer_dir() / "llamacpp-build.log", env, "building the llama.cpp peer venv")
    marker.write_text(build)
    return python


def _peer_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def ensure_llama_cpp_server() -> Path:
    """Adds (once) the `server` extra's packages to the peer venv, whose llama-cpp-python stays
    as built (the same version is asked for); returns the venv's python."""
    python = ensure_llamacpp_venv()
    marker = python.parents[1] / ".loom-server-ready"
    spec = f"llama-cpp-python[server]=={_peer_version(python)}"
    if not (marker.is_file() and marker.read_text() == spec):
        run_logged([[str(python), "-m", "pip", "install", "--no-cache-dir", spec]],
                    peer_dir() / "llamacpp-server-install.log",
                    dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", PEER_CMAKE_ARGS)),
                    "installing llama-cpp-python's server")
        marker.write_text(spec)
    return python


def ensure_llama_server() -> Path:
    """Builds (once) llama.cpp's own `llama-server` with cmake, from the llama.cpp sources inside
    the source distribution of the peer venv's llama-cpp-python (so both peers run the same
    llama.cpp), with the same CPU flags; returns the binary."""
    import tarfile
    import tempfile

    python = ensure_llamacpp_venv()
    version = _peer_version(python)
    home = peer_dir() / "llama-server"
    binary, marker = home / "llama-server", home / ".loom-ready"
    build = f"llama-cpp-python=={version}\n{PEER_CMAKE_ARGS}\n"
    if binary.is_file() and marker.is_file() and marker.read_text() == build:
        return binary
    home.mkdir(parents=True, exist_ok=True)
    log = home / "build.log"
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        run_logged([[str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                      f"llama-cpp-python=={version}"]], log, os.environ, "downloading llama-cpp-python's sources")
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
            sdist.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("*/vendor/llama.cpp"))
        # static: the binary outlives the build tree
        flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
        run_logged([["cmake", "-S", str(source), "-B", f"{tmp}/build", *flags],
                     ["cmake", "--build", f"{tmp}/build", "--target", "llama-server", "-j", str(os.cpu_count() or 1)]],
                    log, os.environ, "building llama-server")
        built = next(Path(tmp, "build").rglob("llama-server"))
        built.replace(binary)
    marker.write_text(build)
    return binary


@dataclass(frozen=True)
class PeerVenv:
    """A peer's venv of plain pip installs (every peer but llama.cpp, which compiles)."""
    name: str
    packages: tuple[str, ...]
    # installed after `packages`, with torch held at the version `packages` pins
    extra: tuple[str, ...] = ()
    # removed last: packages pulled in that cannot load beside that torch and that the peer never uses
    remove: tuple[str, ...] = ()


def ensure_venv(peer: PeerVenv) -> Path:
    """Creates (once) the peer's venv; returns its python. A failure raises, naming the log."""
    venv = peer_dir() / f"{peer.name}-venv"
    python = venv / "bin" / "python"
    marker = venv / ".loom-ready"
    build = repr(peer) + "\n"
    if marker.is_file() and marker.read_text() == build:
        return python
    pip = [str(python), "-m", "pip"]
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)], [*pip, "install", "--no-cache-dir", *peer.packages]]
    if peer.extra:
        constraints = peer_dir() / f"{peer.name}-constraints.txt"
        constraints.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text("".join(f"{p}\n" for p in peer.packages if p.startswith("torch==")))
        steps.append([*pip, "install", "--no-cache-dir", "-c", str(constraints), *peer.extra])
    if peer.remove:
        steps.append([*pip, "uninstall", "-y", *peer.remove])
    run_logged(steps, peer_dir() / f"{peer.name}-install.log", None, f"installing the {peer.name} peer venv")
    marker.write_text(build)
    return python


def run_logged(steps: list[list[str]], log_path: Path, env: dict | None, what: str) -> None:
    """Runs each command in turn, all output to `log_path`; a failure raises, naming the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for cmd in steps:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode != 0:
                raise RuntimeError(f"{what} failed at `{' '.join(cmd)}`; see {log_path}")


def run_llamacpp(gguf_path: Path, prompt_token_ids: list[int], max_tokens: int, threads: int, repeats: int,
                 kv_cache_q8_0: bool = False) -> dict:
    """Batch-1 greedy decode timed in llama.cpp: the prompt is evaluated in one call (prefill,
    which also yields the first token), then max_tokens - 1 single-token steps (decode), EOS
    ignored. Returns medians over `repeats` and the ids generated by the first repeat.
    llama.cpp's threads spin at barriers: with as many threads as cores, any other busy process
    slows it by orders of magnitude, so time it on an otherwise idle machine. `kv_cache_q8_0`:
    keys and values cached as q8_0 (`-ctk q8_0 -ctv q8_0`, which a quantized V cache needs flash
    attention for), llama.cpp's 8-bit cache."""
    if max_tokens < 2 or repeats < 1:
        raise ValueError("max_tokens must be >= 2 and repeats >= 1")
    return _run_in_peer("time", gguf_path=str(gguf_path), prompt_token_ids=list(prompt_token_ids),
                        max_tokens=max_tokens, threads=threads, repeats=repeats, kv_cache_q8_0=kv_cache_q8_0)


class LlamaCppDecodeRun:
    """llama.cpp kept loaded in its peer venv for batch-1 decode runs timed one at a time, as
    `run_llamacpp` times them: `time_decode()` runs one and returns its decode tokens/s. For
    taking turns with another engine in the same minutes (`latency.interleaved`). Use as a
    context manager: leaving it ends the peer process."""

    def __init__(self, gguf_path: Path, prompt_token_ids: list[int], max_tokens: int, threads: int,
                 kv_cache_q8_0: bool = False) -> None:
        if max_tokens < 2:
            raise ValueError("max_tokens must be >= 2")
        self.decode_steps = max_tokens - 1
        self.generated_ids: list[int] = []  # by the last run
        kwargs = {"gguf_path": str(gguf_path), "prompt_token_ids": list(prompt_token_ids), "max_tokens": max_tokens,
                  "threads": threads, "kv_cache_q8_0": kv_cache_q8_0}
        # The peer's stderr goes to a file, read if it fails: a pipe nobody reads while it runs
        # would stall it once full.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([str(ensure_llamacpp_venv()), "-I", str(Path(__file__).resolve()), "serve",
                                       json.dumps(kwargs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        try:
            self._reply()  # loaded
        except RuntimeError:
            self.close()
            raise

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            raise RuntimeError(f"llama.cpp peer ended (exit code {self._proc.returncode}):\n"
                               f"{self._stderr.read()[-4000:]}")
        return json.loads(line)

    def decode(self) -> float:
        """One run, its tokens kept in `generated_ids`; returns its decode seconds as the peer
        timed them."""
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        reply = self._reply()
        self.generated_ids = reply["generated_ids"]
        return reply["decode_s"]

    def time_decode(self) -> float:
        """One run's decode steps per second."""
        return self.decode_steps / self.decode()

    def close(self) -> None:
        if not self._proc.stdin.closed:
            self._proc.stdin.close()  # the peer's loop ends with its input
        self._proc.wait()
        self._proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> LlamaCppDecodeRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_in_peer(command: str, **kwargs: object) -> dict:
    python = ensure_llamacpp_venv()
    # -I: the script's folder (loom/bench) must not shadow modules of the peer venv.
    proc = subprocess.run([str(python), "-I", str(Path(__file__).resolve()), command, json.dumps(kwargs)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp peer `{command}` failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- what follows runs inside the peer venv (numpy, gguf, llama_cpp) ----

def _decoder(gguf_path: str, prompt_token_ids: list[int], max_tokens: int, threads: int, kv_cache_q8_0: bool):
    """The model loaded; returns a function that runs the prompt and max_tokens - 1 decode steps
    afresh, greedy, and returns (prefill seconds, decode seconds, the ids generated)."""
    import time

    import llama_cpp
    import numpy as np

    kv_cache = {"type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0, "flash_attn": True} \
        if kv_cache_q8_0 else {}
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=len(prompt_token_ids) + max_tokens, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False, **kv_cache)
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:  # Llama.eval keeps no logits unless logits_all: read llama.cpp's own
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    def run() -> tuple[float, float, list[int]]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_token_ids)
        ids = [last_argmax()]
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            llm.eval(ids[-1:])
            ids.append(last_argmax())
        return t1 - t0, time.perf_counter() - t1, ids

    return run


def _time(gguf_path: str, prompt_token_ids: list[int], max_tokens: int, threads: int, repeats: int,
          kv_cache_q8_0: bool) -> dict:
    import statistics

    run = _decoder(gguf_path, prompt_token_ids, max_tokens, threads, kv_cache_q8_0)
    prefill_s, decode_s, first_ids = [], [], None
    for _ in range(repeats):
        prefill, decode, ids = run()
        prefill_s.append(prefill)
        decode_s.append(decode)
        first_ids = first_ids or ids
    decode = statistics.median(decode_s)
    return {"engine": "llama.cpp", "batch_size": 1,
            "note": "llama-cpp-python decodes one sequence at a time: batch 1 only",
            "threads": threads, "repeats": repeats, "prompt_len": len(prompt_token_ids), "max_tokens": max_tokens,
            "prefill_ms": 1000 * statistics.median(prefill_s), "decode_steps": max_tokens - 1,
            "decode_tok_per_s": (max_tokens - 1) / decode, "decode_ms_per_token": 1000 * decode / (max_tokens - 1),
            "decode_tok_per_s_all": [(max_tokens - 1) / s for s in decode_s], "generated_ids": first_ids}


def _serve(**kwargs: object) -> None:
    """Loads the model, says so, then runs and reports one decode for each "run" line read, until
    its input ends (LlamaCppDecodeRun's side)."""
    run = _decoder(**kwargs)
    print(json.dumps({"loaded": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            prefill, decode, ids = run()
            print(json.dumps({"prefill_s": prefill, "decode_s": decode, "generated_ids": ids}), flush=True)


if __name__ == "__main__":
    _command, _kwargs = sys.argv[1], json.loads(sys.argv[2])
    if _command == "serve":
        _serve(**_kwargs)
    else:
        print(json.dumps({"time": _time}[_command](**_kwargs)))
