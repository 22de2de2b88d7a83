"""The KV-compression peer: NVIDIA's kvpress, whose presses compress a Hugging Face model's
cache at prefill, in a venv of its own (`loom bench kv-quality --kvpress`).

kvpress pins a transformers older than Loom's tests use, so it cannot share Loom's venv. This
file serves both sides, like the llama.cpp peer: imported by Loom it builds the venv and sends
it the needle prompts (token ids, from Loom's tokenizer); run as a script by the venv's python
it generates greedily under each press and budget and returns the token ids. Its top level
imports nothing outside the standard library.

Presses, set to what Loom's policies of the same name do: StreamingLLMPress (4 sink tokens)
against `streaming`, SnapKVPress with a window of 32 queries and pooling over 7 tokens against
`snapkv`. A budget b keeps the fraction b of the prompt (compression_ratio 1 - b).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# torch as Loom pins it (pip takes the CPU build from this machine's disk); kvpress 0.5 needs
# a transformers before 5.3.
PEER_PACKAGES = ("torch==2.13.0", "transformers>=4.56,<5.3", "kvpress==0.5.5")
PRESSES = ("streaming", "snapkv")


def ensure_kvpress_venv() -> Path:
    """Creates (once) the peer venv; returns its python."""
    from loom.bench.llamacpp import PeerVenv, ensure_venv

    return ensure_venv(PeerVenv("kvpress", PEER_PACKAGES))


def run_kvpress(model_dir: Path, prompts: list[list[int]], max_tokens: int, budgets: list[float],
                threads: int) -> dict[str, dict[str, list[list[int]]]]:
    """Greedy continuations of each prompt under each press and budget: {press: {budget: ids}}."""
    python = ensure_kvpress_venv()
    job = {"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, "budgets": budgets,
           "threads": threads}
    done = subprocess.run([str(python), __file__], input=json.dumps(job), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the kvpress peer failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _generate(job: dict) -> dict:
    """In the peer venv: every press and budget over every prompt."""
    import torch
    from kvpress import SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    presses = {"streaming": lambda ratio: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
               "snapkv": lambda ratio: SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)}
    out: dict = {}
    for name, make in presses.items():
        out[name] = {}
        for budget in job["budgets"]:
            press, ids = make(1 - budget), []
            for prompt in job["prompts"]:
                x = torch.tensor([prompt])
                with torch.no_grad(), press(model):
                    generated = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=job["max_tokens"],
                                               min_new_tokens=job["max_tokens"], do_sample=False, pad_token_id=0)
                ids.append(generated[0, len(prompt):].tolist())
            out[name][str(budget)] = ids
    return out


if __name__ == "__main__":
    print(json.dumps(_generate(json.loads(sys.stdin.read()))))
