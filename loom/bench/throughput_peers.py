"""The CPU peers of `loom bench throughput` and `loom bench prefill`, each in a venv of its own:
OpenVINO GenAI (its continuous-batching pipeline: paged KV cache and continuous batching on the
CPU; its LLMPipeline for one prompt at a time; the model exported to OpenVINO IR with
optimum-intel) and CTranslate2's batched generator (the model converted with its own converter).

Like the llama.cpp peer, this file serves both sides: imported by Loom it builds the venvs,
converts the model once and sends the workload (token ids); run as a script by a peer venv's
python it times the peer and prints one JSON line. Its top level imports nothing outside the
standard library.

Both peers get the same token ids as Loom, greedy decoding and every requested token (EOS
ignored). OpenVINO runs all requests through one pipeline, as Loom does; CTranslate2 runs static
batches in arrival order, each to its longest output, and only requested tokens count (as the
transformers peer)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


# Each peer's venv (loom.bench.llamacpp.PeerVenv's fields; plain data, as this file's top level
# must import nothing outside the standard library). torch as Loom pins it (the CPU build; only
# the exporters use it). optimum-intel requires torchvision, whose PyPI build cannot load beside
# the CPU torch and which exporting a causal LM never imports, so it is removed (transformers then
# sees no torchvision, as it should).
OPENVINO = {"name": "openvino", "packages": ("torch==2.13.0",),
            "extra": ("optimum-intel[openvino]==2.2.0", "openvino-genai==2026.4.1.0"), "remove": ("torchvision",)}
CTRANSLATE2 = {"name": "ctranslate2", "packages": ("torch==2.13.0", "transformers>=4.56,<5.6", "ctranslate2==4.8.5")}

# OpenVINO's KV cache holds what Loom's does: the model's dtype, or with Loom's int8 cache its
# own 8-bit one (u8, a scale and zero point per token and head); its CPU plugin would otherwise
# pick u8 whatever Loom's, and its inference precision (bf16 wherever the CPU has it).
OPENVINO_PRECISION = {"float32": "f32", "bfloat16": "bf16"}


def run_openvino(model_dir: Path, dtype: str, prompts: list[list[int]], output_lens: list[int],
                 threads: int, kv_cache_dtype: str = "auto") -> dict:
    """Every request added to one ContinuousBatchingPipeline at once, timed to the last token."""
    return _run(OPENVINO, "openvino", model_dir, dtype, threads, prompts=prompts, output_lens=output_lens,
                kv_cache_dtype=kv_cache_dtype)


def run_openvino_prefill(model_dir: Path, dtype: str, prompts: dict[int, list[list[int]]], threads: int) -> dict:
    """Median seconds to the first token of each length's prompts, one at a time through an
    LLMPipeline (each prompt new to it, so nothing is reused from an earlier one)."""
    return _run(OPENVINO, "openvino_prefill", model_dir, dtype, threads,
                prompts={str(n): p for n, p in prompts.items()})


def run_ctranslate2(model_dir: Path, dtype: str, prompts: list[list[int]], output_lens: list[int],
                    threads: int, batch_size: int) -> dict:
    """Static batches of `batch_size` in arrival order through `Generator.generate_batch`."""
    return _run(CTRANSLATE2, "ctranslate2", model_dir, dtype, threads, prompts=prompts, output_lens=output_lens,
                batch_size=batch_size)


def _run(peer: dict, command: str, model_dir: Path, dtype: str, threads: int, **fields: object) -> dict:
    """Runs `command` in the peer's venv on a job naming the model, where the peer's conversion
    of it lives (Loom's cache), the dtype and threads, and the command's own fields."""
    from loom.bench.llamacpp import PeerVenv, ensure_venv, peer_dir

    venv = PeerVenv(**peer)
    model = Path(model_dir).resolve()
    job = {"model": str(model), "converted": str(peer_dir() / "models" / f"{model.name}-{venv.name}"),
           "dtype": dtype, "threads": threads, **fields}
    python = ensure_venv(venv)
    # -I: the script's folder (loom/bench) must not shadow modules of the peer venv.
    done = subprocess.run([str(python), "-I", str(Path(__file__).resolve()), command], input=json.dumps(job),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {venv.name} peer failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- what follows runs inside a peer venv ----

def _useful(job: dict, seconds: float, **fields: object) -> dict:
    """The result of a timed run: requested tokens over seconds (and the peer's own fields)."""
    tokens = sum(job["output_lens"])
    return {"dtype": job["dtype"], "threads": job["threads"], "requests": len(job["prompts"]), "seconds": seconds,
            "output_tokens": tokens, "output_tok_per_s": tokens / seconds, **fields}


def _converted(job: dict, convert: Callable[[Path, Path], None]) -> Path:
    """The job's model in the peer's format: `convert(model, out)` once, then reused (a marker
    naming the source, written last, tells a finished conversion from an interrupted one)."""
    out, marker = Path(job["converted"]), Path(job["converted"]) / ".loom-source"
    if not (marker.is_file() and marker.read_text() == job["model"]):
        convert(Path(job["model"]), out)
        marker.write_text(job["model"])
    return out


def _export_openvino(model: Path, out: Path) -> None:
    # fp32 weights in the IR: the plugin's inference precision sets the dtype the model runs in
    subprocess.run([str(Path(sys.executable).with_name("optimum-cli")), "export", "openvino", "--model", str(model),
                    "--task", "text-generation-with-past", "--weight-format", "fp32", str(out)],
                   check=True, stdout=sys.stderr)


def _openvino_kv_precision(job: dict) -> str:
    return "u8" if job.get("kv_cache_dtype") == "int8" else OPENVINO_PRECISION[job["dtype"]]


def _openvino_properties(job: dict) -> dict:
    return {"INFERENCE_NUM_THREADS": job["threads"], "INFERENCE_PRECISION_HINT": OPENVINO_PRECISION[job["dtype"]],
            "KV_CACHE_PRECISION": _openvino_kv_precision(job)}


def _openvino_config(max_new_tokens: int):
    import openvino_genai as genai

    c = genai.GenerationConfig()
    c.max_new_tokens = c.min_new_tokens = max_new_tokens
    c.ignore_eos, c.do_sample = True, False
    return c


def _openvino_ids(prompt: list[int]):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([prompt], dtype=np.int64))


def _openvino_prefill(job: dict) -> dict:
    import statistics
    import time

    import openvino_genai as genai

    pipe = genai.LLMPipeline(str(_converted(job, _export_openvino)), "CPU", _openvino_properties(job))
    one = _openvino_config(1)
    pipe.generate(_openvino_ids([5] * 64), one)  # compiles before the clock starts

    first_tokens: dict[str, list[int]] = {}

    def ttft(n: str, prompt: list[int]) -> float:
        start = time.perf_counter()
        result = pipe.generate(_openvino_ids(prompt), one)
        seconds = time.perf_counter() - start
        first_tokens.setdefault(n, []).append(int(result.tokens[0][0]))
        return seconds

    ttft_s = {n: statistics.median(ttft(n, p) for p in prompts) for n, prompts in job["prompts"].items()}
    return {"engine": "openvino-genai LLMPipeline", "dtype": job["dtype"], "version": genai.__version__,
            "ttft_s": ttft_s, "first_tokens": first_tokens}


def _openvino(job: dict) -> dict:
    import time

    import openvino_genai as genai

    out = _converted(job, _export_openvino)
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 4  # GB: every request's blocks fit, as in Loom's run (no preemption)
    scheduler.max_num_seqs = 256
    scheduler.enable_prefix_caching = False
    pipe = genai.ContinuousBatchingPipeline(str(out), scheduler, "CPU", _openvino_properties(job))
    pipe.generate([_openvino_ids([5] * 16)], [_openvino_config(4)])  # compiles before the clock starts
    start = time.perf_counter()
    results = pipe.generate([_openvino_ids(p) for p in job["prompts"]],
                            [_openvino_config(n) for n in job["output_lens"]])
    seconds = time.perf_counter() - start
    generated = [len(r.m_generation_ids[0]) for r in results]
    if generated != job["output_lens"]:
        raise RuntimeError(f"OpenVINO generated {sum(generated)} tokens, {sum(job['output_lens'])} requested")
    return _useful(job, seconds, engine="openvino-genai continuous batching",
                   first_request_ids=list(results[0].m_generation_ids[0]),
                   version=genai.__version__, kv_cache_precision=_openvino_kv_precision(job),
                   scheduler={"cache_size_gb": scheduler.cache_size, "max_num_seqs": scheduler.max_num_seqs,
                              "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                              "dynamic_split_fuse": scheduler.dynamic_split_fuse})


def _ctranslate2(job: dict) -> dict:
    import time

    import ctranslate2

    supported = ctranslate2.get_supported_compute_types("cpu")
    if job["dtype"] not in supported:
        return {"dtype": job["dtype"], "skipped": f"CTranslate2 {ctranslate2.__version__} has no {job['dtype']} "
                f"compute type on this CPU (it offers {', '.join(sorted(supported))})"}
    out = _converted(job, _convert_ctranslate2)
    words = json.loads((out / "vocabulary.json").read_text())  # the generator takes token strings
    generator = ctranslate2.Generator(str(out), device="cpu", compute_type=job["dtype"], inter_threads=1,
                                      intra_threads=job["threads"])
    generator.generate_batch([[words[5]] * 16], max_length=2, include_prompt_in_result=False)
    prompts, lens, size = job["prompts"], job["output_lens"], job["batch_size"]
    first = None
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        new = max(lens[i:i + size])
        results = generator.generate_batch([[words[t] for t in p] for p in prompts[i:i + size]], max_length=new,
                                           min_length=new, include_prompt_in_result=False, sampling_topk=1)
        if any(len(r.sequences_ids[0]) != new for r in results):
            raise RuntimeError(f"CTranslate2 stopped a sequence of its batch before {new} tokens")
        first = first or results[0].sequences_ids[0][:lens[0]]
    seconds = time.perf_counter() - start
    return _useful(job, seconds, engine=f"ctranslate2 batch {size}", batch_size=size, version=ctranslate2.__version__,
                   first_request_ids=first)


def _convert_ctranslate2(model: Path, out: Path) -> None:
    """The converter reads the vocabulary from a tokenizer; a model without one (Loom's reference
    model) gets a word-level tokenizer of its vocabulary size, one string per id."""
    import tempfile

    import ctranslate2
    from tokenizers import Tokenizer, models

    with tempfile.TemporaryDirectory() as tmp:
        source = model
        if not (model / "tokenizer.json").is_file():
            source = Path(tmp)
            for f in model.iterdir():
                (source / f.name).symlink_to(f)
            config = json.loads((model / "config.json").read_text())
            special = {"<unk>": 0, "<s>": config.get("bos_token_id", 1), "</s>": config.get("eos_token_id", 2)}
            vocab = {f"t{i}": i for i in range(config["vocab_size"]) if i not in special.values()} | special
            Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(source / "tokenizer.json"))
            (source / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>"}))
        ctranslate2.converters.TransformersConverter(str(source)).convert(str(out), quantization="float32", force=True)


if __name__ == "__main__":
    _job = json.loads(sys.stdin.read())
    print(json.dumps({"openvino": _openvino, "openvino_prefill": _openvino_prefill,
                      "ctranslate2": _ctranslate2}[sys.argv[1]](_job)))
