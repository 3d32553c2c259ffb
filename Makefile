# Two commands a user needs: `make demo` and `make test`. Each builds its own virtual
# environment when none is active, installs what it needs, and starts the servers it uses.
SHELL := /bin/bash
.DEFAULT_GOAL := help
ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := .venv/bin/python
endif
STAMP := $(dir $(PY)).spotckpt-installed
DEMO_STAMP := $(dir $(PY)).spotckpt-demo-installed
BENCH_STAMP := $(dir $(PY)).spotckpt-bench-installed
# checkov pins versions that clash with the project's, so it lives in a venv of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV := $(CHECKOV_VENV)/bin/checkov
# Three workers on two cores (35 min serial, 26 with three, measured here): most of the suite is
# child processes (gloo ranks, trainers, servers) that start torch and then wait on each other.
# --dist loadfile keeps each test file on one worker, so its module fixtures are built once.
PYTEST_ARGS ?= -m "not slow" -n 3 --dist loadfile --durations=25

# make check: the tests that start no process and open no network socket (tests/suite_guard.py
# fails one that does), in one process, after make lint: the inner loop, under two minutes.
CHECK_ARGS ?= -m "not process and not slow" --no-processes -q

.PHONY: help setup test-deps demo test test-all check lint bench bench-smoke faketime azurite crash deadline

help:
	@echo "make setup        create .venv (unless a virtual environment is active), install"
	@echo "                  the test stack (every extra: .[test])"
	@echo "make demo         spot-eviction demo against an embedded S3 server (installs only"
	@echo "                  the core and moto's server: .[demo])"
	@echo "                  (SPOTCKPT_URI=s3://... or a folder: use that store instead)"
	@echo "make test         the test suite, without the slow campaigns"
	@echo "make test-all     the test suite with the slow campaigns"
	@echo "make lint         ruff format --check, ruff check, mypy, lint-imports (the layers)"
	@echo "make check        make lint, then the tests that start no process (under 2 minutes)"
	@echo "make crash        every store call of every scenario as a crash point (SAMPLE=N: N of them)"
	@echo "make deadline     the emergency-save campaign under the cloud model (QUICK=1: 3 runs)"
	@echo "make bench        side-by-side benchmarks (about 20 minutes)"
	@echo "make bench-smoke  the benchmarks at small sizes, one repetition (about a minute)"
	@echo "make azurite      install Azurite (the Azure Storage emulator, npm) into .azurite"
	@echo "CI (bash .ci/run): make lint, make test, make demo on S3, on a local folder and on Azurite"

$(PY):
	python3 -m venv $(dir $(PY))..

# torch==2.13.0 is installed only where no torch is installed (pinned, so that every machine
# runs the version CI runs). Which build that is depends on the index pip uses: PyPI's Linux
# wheel is the CUDA one; install the CPU wheel first to avoid it (see README.md).
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,azure,fsspec]"
	touch $@

# The demo needs the core and moto's server only (about 1.2 GiB with torch's CPU wheel, against
# 3 GiB for the test stack); where the test stack is already installed and current, it has both.
$(DEMO_STAMP): pyproject.toml constraints.txt | $(PY)
	@if [ "$(STAMP)" -nt pyproject.toml ] && [ "$(STAMP)" -nt constraints.txt ]; then :; else \
		$(PY) -m pip install -q --upgrade pip && \
		{ $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0; } && \
		$(PY) -m pip install -q -c constraints.txt -e ".[demo]"; fi
	touch $@

setup: $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	touch $@

$(CHECKOV):
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

# gc's clock tests run `spotckpt gc` under libfaketime, from Debian's faketime package: installed
# here when it is missing and apt-get can (as root, as CI runs); without it those tests say so.
faketime:
	@command -v faketime >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null; } || \
		echo "make: could not install faketime (apt-get install faketime); gc's clock tests need it" >&2

# Azurite, the Azure Storage emulator, comes from npm; the Azure tests start it from here
# (tests/azurite.py) and say how to install it where it is missing.
AZURITE := .azurite/node_modules/.bin/azurite-blob
$(AZURITE):
	npm install --no-audit --no-fund --prefix .azurite azurite@3.35.0

azurite: $(AZURITE)

# Everything `make test` needs; independent of each other, so `make -j4 test-deps` installs them
# side by side (CI does: pip, npm and apt-get mostly wait on downloads and disks).
test-deps: setup $(CHECKOV) faketime $(AZURITE)

test: test-deps
	CHECKOV=$(CURDIR)/$(CHECKOV) $(PY) -m pytest $(PYTEST_ARGS)

test-all: PYTEST_ARGS :=
test-all: test crash deadline

# The crash explorer (docs/guarantees.md): every recorded store call is a fault point, on the
# local folder, S3 (moto), the GCS fake and Azurite (each skipped, with a line, where missing),
# (a seeded 300 points per server: a replay there costs seconds), and seeded samples of points
# SIGKILLed in a child process and on one of two gloo ranks, and of points in the upload process
# of async_mode="process" saves.
CRASH_ARGS ?= --backend local --backend s3 --backend gcs --backend azure --server-sample 300 \
	--kill-sample 20 --kill-ranks-sample 2 --upload-sample 30
# SAMPLE=N explores a seeded sample of N trace points, without the process samples.
crash: setup $(AZURITE)
	$(PY) tests/crash/explore.py $(CRASH_ARGS) $(if $(SAMPLE),--sample $(SAMPLE) --kill-sample 0 \
		--kill-ranks-sample 0 --upload-sample 0)

# The emergency-save campaign (docs/preemption.md): real notices and SIGKILLs at the deadline,
# rank processes behind the cloud model's per-node links; about 40 runs, QUICK=1 three.
deadline: $(BENCH_STAMP)
	$(PY) benchmarks/deadline.py $(if $(QUICK),--quick)

check: lint
	$(PY) -m pytest $(CHECK_ARGS)

lint: setup
	$(PY) -m ruff format --check spotckpt tests benchmarks examples
	$(PY) -m ruff check spotckpt tests benchmarks examples
	$(PY) -m mypy spotckpt
	$(dir $(PY))lint-imports --no-cache

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py

bench-smoke: $(BENCH_STAMP)
	$(PY) benchmarks/run.py --quick
