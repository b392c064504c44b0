# Two commands do all the set-up on a fresh machine:
#   make run    create .venv, install bm, run `bm run datasets/prompts.jsonl` on the embedded tiny model
#   make test   lint, format check and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bm-installed
# The CPU build of torch; a plain `torch` requirement would pull the newest CUDA build (several GB).
TORCH_SPEC ?= torch==2.13.0
PROMPTS ?= datasets/prompts.jsonl
WORKLOAD ?= ../shared/bench/azure-conv-128-x0.25.jsonl

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/bm run $(PROMPTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/throughput.py $(WORKLOAD) --model-config configs/models/bench-llama-15m.json

clean:
	rm -rf $(VENV) bm-out .pytest_cache .ruff_cache
