PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of PyTorch; a GPU user installs their own torch into .venv first (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test setup bench clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m loom.cli generate --max-tokens 64 "ROMEO:"

test: setup
	$(PY) -m pytest -q

# The engine-core and decoding benchmarks (tens of minutes; JSON + PNG under docs/benchmarks/).
bench: setup
	$(PY) -m loom.cli bench attention
	$(PY) -m loom.cli bench prefix
	$(PY) -m loom.cli bench parallel
	$(PY) -m loom.cli bench throughput

clean:
	rm -rf $(VENV) build *.egg-info
