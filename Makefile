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
# checkov pins versions that clash with the project's, so it lives in a venv of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV := $(CHECKOV_VENV)/bin/checkov
PYTEST_ARGS ?= -m "not slow"

.PHONY: help setup demo test test-all lint bench bench-smoke

help:
	@echo "make demo    spot-eviction demo against an embedded S3 server"
	@echo "make test    the test suite (what CI runs)"
	@echo "make lint    ruff and mypy"
	@echo "make bench   side-by-side benchmarks (slow)"

$(PY):
	python3 -m venv $(dir $(PY))..

# torch is pinned to 2.13.0 only where no torch is installed: an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

setup: $(STAMP)

$(CHECKOV):
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30

demo: setup
	$(PY) examples/demo.py

test: setup $(CHECKOV)
	CHECKOV=$(CURDIR)/$(CHECKOV) $(PY) -m pytest $(PYTEST_ARGS)

test-all: PYTEST_ARGS :=
test-all: test

lint: setup
	$(PY) -m ruff format --check spotckpt tests benchmarks examples
	$(PY) -m ruff check spotckpt tests benchmarks examples
	$(PY) -m mypy spotckpt

bench: setup
	$(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	$(PY) benchmarks/run.py
