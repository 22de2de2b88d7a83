"""`loom bench quality`: its held-out loss is the model's own negative log-likelihood, and the
command scores every variant against bf16 and writes its report."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from loom import LLM
from loom.bench.quality import heldout_loss

REPO = Path(__file__).resolve().parents[1]
HOUSE = REPO / "models" / "house"


def test_heldout_loss_is_the_negative_log_likelihood():
    """Windows of 100 tokens, each after BOS, scored through the engine's prompt logprobs equal
    transformers' token NLL summed over the same windows."""
    from transformers import AutoModelForCausalLM

    text = (REPO / "docs" / "architecture.md").read_text()[:3000]
    llm = LLM(str(HOUSE), dtype="float32")
    got = heldout_loss(llm, text, window=100)
    tok = llm.get_tokenizer()
    bos, ids = tok.encode(""), tok.encode(text, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(HOUSE, dtype=torch.float32).eval()
    total, scored = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 100):
            window = torch.tensor([bos + ids[start:start + 100]])
            logprobs = hf(window).logits[0, :-1].log_softmax(dim=-1)
            targets = window[0, 1:]
            total -= logprobs.gather(1, targets[:, None]).sum().item()
            scored += len(targets)
    assert got["tokens"] == scored
    assert math.isclose(got["nats_per_token"], total / scored, rel_tol=1e-4)
    assert math.isclose(got["nats_per_char"], total / len(text), rel_tol=1e-4)
    assert math.isclose(got["perplexity"], math.exp(got["nats_per_token"]), rel_tol=1e-9)


def test_quality_command_scores_every_variant(tmp_path, capsys):
    """fp32, an int8 KV cache, int8 weights and a second copy of the bf16 checkpoint against bf16:
    the copy agrees on every greedy token (the engine is deterministic), quantization costs
    little, and the report is named after the command's default model."""
    from loom.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join((REPO / name).read_text() for name in ("README.md", "docs/architecture.md")))
    main(["bench", "quality", "--corpus", str(corpus), "--needles", "0", "--quantization", "int8",
          "--checkpoints", str(HOUSE), "--window", "256", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "quality.json").read_text())
    rows = report["results"]
    assert list(rows) == ["bfloat16", "float32", "bfloat16, int8 KV cache", "int8", "house"]
    assert rows["house"]["greedy_agreement_64_prompts"] == {"identical": 1.0, "mean_matching_prefix": 1.0}
    assert rows["house"]["perplexity"] == rows["bfloat16"]["perplexity"]
    for label in ("float32", "bfloat16, int8 KV cache", "int8"):
        assert abs(rows[label]["loss_increase_vs_bf16"]) < 0.05, (label, rows[label])
    assert (tmp_path / "quality.png").is_file()
    assert "wrote" in capsys.readouterr().out
