"""The `loom` command line's contract for mistakes: one line naming the problem, status 1, no
traceback unless asked for with --debug."""
from __future__ import annotations

import json

import pytest

from loom.cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return exit_info.value.code, capsys.readouterr().err


def test_missing_model_directory(capsys):
    code, err = run(capsys, "generate", "--model", "/nonexistent/model", "hi")
    assert code == 1 and err == "loom: error: /nonexistent/model: model directory not found\n"


def test_broken_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    code, err = run(capsys, "generate", "--model", str(tmp_path), "hi")
    assert code == 1 and err.startswith(f"loom: error: {tmp_path / 'config.json'}: not valid JSON")
    assert err.count("\n") == 1
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, err = run(capsys, "generate", "--model", str(tmp_path), "hi")
    assert code == 1 and "field 'architectures'" in err and err.count("\n") == 1


def test_bad_option_value(capsys, hf_models, tmp_path):
    model_dir, _ = hf_models("llama_gqa")
    capsys.readouterr()  # what building the model printed
    code, err = run(capsys, "generate", "--model", str(model_dir), "--max-tokens", "0", "hi")
    assert code == 1 and err == "loom: error: max_tokens: must be >= 1, got 0\n"
    code, err = run(capsys, "quantize", str(model_dir), str(tmp_path / "q"), "--method", "int4", "--group-size", "48")
    assert code == 1 and err == "loom: error: group_size: must be one of (32, 64, 128), got 48\n"
    code, err = run(capsys, "quantize", str(model_dir), str(tmp_path / "q"), "--method", "int8", "--symmetric")
    assert code == 1 and "--symmetric: chooses int4's format" in err and not (tmp_path / "q").exists()


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        main(["generate", "--model", "/nonexistent/model", "hi", "--debug"])
    with pytest.raises(FileNotFoundError):
        main(["--debug", "generate", "--model", "/nonexistent/model", "hi"])


def test_reports_record_their_command_without_the_output_folder():
    """A report's `command` reproduces it; where it was written is a path of that machine."""
    from loom.bench.report import command
    from loom.config import cache_root

    assert command(["bench", "serve", "--out-dir", "/tmp/x", "--launch", "loom"]) == "loom bench serve --launch loom"
    assert command(["bench", "prefix", "--out-dir=/a/b", "--dtype", "bfloat16"]) == "loom bench prefix --dtype bfloat16"
    cached = cache_root() / "models" / "m"
    assert command(["bench", "quality", "--model", str(cached)]) == "loom bench quality --model <loom cache>/models/m"


def test_serve_options_reach_the_engine(hf_models):
    """`loom serve`'s quantization options become the engine's: int4 symmetric at group 64 quantizes every
    linear layer so (the options are what the server's engine is built from)."""
    from loom import LLM
    from loom.cli import build_parser
    from loom.cli.serve import _engine_options
    from loom.quant.linear import WeightOnlyLinear

    model_dir, _ = hf_models("llama_gqa")
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--quantization", "int4",
                                      "--group-size", "64", "--symmetric", "--max-num-seqs", "2"])
    layers = [m for m in LLM(**_engine_options(args)).engine.runner.model.modules()
              if isinstance(m, WeightOnlyLinear)]
    assert layers and all(m.symmetric and m.group_size == 64 for m in layers)
