"""Fuzzing the server over its own OpenAPI schema (schemathesis): no generated request gets a
5xx, every error has OpenAI's shape, and afterwards the server is healthy and right."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from loom import LLM, SamplingParams
from serving import ThreadedServer

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
EXAMPLES_PER_OPERATION = 130  # GETs without parameters stop at a few: over 500 requests in all
SENT: list[int] = []  # status codes of every fuzzed request


@pytest.fixture(scope="module")
def fuzz_server():
    # A short context bounds the work of any request the fuzzer makes up.
    s = ThreadedServer(LLM(str(HOUSE), max_model_len=64, max_num_seqs=8))
    yield s
    s.stop()


def test_no_generated_request_breaks_the_server(fuzz_server):
    """Each operation of /openapi.json in turn, driven by hypothesis (schemathesis's strategies,
    without its pytest plugin, which this pytest no longer supports). Derandomized: the same
    requests every run, so that a failure reproduces (and CI never flakes on a new draw)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None, derandomize=True)
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            SENT.append(response.status_code)
            assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"]
                assert error["code"] == response.status_code
                assert error["type"] in ("invalid_request_error", "authentication_error", "rate_limit_error")

        fuzz()


def test_after_fuzzing_the_server_is_healthy_and_right(fuzz_server):
    assert len(SENT) >= 500, len(SENT)
    assert httpx.get(f"{fuzz_server.url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0})
    want = LLM(str(HOUSE), max_model_len=64).generate("ROMEO:", SamplingParams(temperature=0, max_tokens=8),
                                                      use_tqdm=False)
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    assert fuzz_server.idle()
