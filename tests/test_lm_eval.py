"""lm-evaluation-harness against `loom serve`: a loglikelihood task from a local file through
its `local-completions` model (echo with prompt logprobs; lm-eval tokenizes through the
server's /tokenize), scored exactly as the offline engine's prompt logprobs score it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loom import LLM, SamplingParams
from serving import ThreadedServer

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"

QUESTIONS = [
    ("ROMEO: But soft, what light through yonder window", [" breaks", " sings", " sleeps"], 0),
    ("JULIET: O Romeo, Romeo, wherefore art thou", [" Romeo", " bread", " seven"], 0),
    ("First Citizen: Before we proceed any further, hear me", [" speak", " swim", " fly"], 0),
    ("KING RICHARD III: A horse! a horse! my kingdom for a", [" horse", " lamp", " river"], 0),
    ("HAMLET: To be, or not to", [" be", " see", " eat"], 0),
    ("MERCUTIO: A plague o' both your", [" houses", " apples", " clouds"], 0),
]


@pytest.fixture()
def task_dir(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "loom_quotes.yaml").write_text(f"""task: loom_quotes
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return tmp_path


def test_loglikelihoods_equal_the_offline_engines(task_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = ThreadedServer(LLM(str(HOUSE)))
    try:
        args = f"model=house,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1"
        results = simple_evaluate(model="local-completions", model_args=args, tasks=["loom_quotes"],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
        lm = get_model("local-completions").create_from_arg_string(args)
        assert type(lm.tokenizer).__name__ == "RemoteTokenizer"  # it found /tokenizer_info and /tokenize
        offline = LLM(str(HOUSE))
        samples = sorted(results["samples"]["loom_quotes"], key=lambda s: s["doc_id"])
        assert len(samples) == len(QUESTIONS) and all(len(s["resps"]) == 3 for s in samples)
        right = 0
        for sample, (question, choices, answer) in zip(samples, QUESTIONS):
            scores = []
            for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
                context_ids, continuation_ids = lm._encode_pair(context, continuation)
                ids = context_ids + continuation_ids
                out = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                       use_tqdm=False)[0]
                want = sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(context_ids), len(ids)))
                assert math.isclose(response[0][0], want, abs_tol=1e-4), (question, continuation)
                scores.append(want)
            right += max(range(len(scores)), key=scores.__getitem__) == answer
        assert results["results"]["loom_quotes"]["acc,none"] == pytest.approx(right / len(QUESTIONS))
        assert right >= 4, right  # the house model knows its Shakespeare (measured: 5 of 6)
    finally:
        server.stop()
