# llmstack: `make dev` runs the stack locally, `make test` runs the tests.
# Both install what they need into .venv on first use.

PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STACK ?= local

.PHONY: help install test test-fast plan render clean

help:
	@echo "make dev          run the whole serving path on this machine (arrives with the local-stack change)"
	@echo "make test         install into .venv and run every test"
	@echo "make plan STACK=  capacity and cost of a stack (llmctl plan)"
	@echo "make render STACK= Kubernetes manifests of a stack into build/manifests/"

$(STAMP): pyproject.toml ops/install_cpu_engine.sh
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (llmstack targets Python 3.11)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[serve,test]"
	bash ops/install_cpu_engine.sh $(PIP)
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

plan: $(STAMP)
	$(VENV)/bin/llmctl plan --stack $(STACK)

render: $(STAMP)
	$(VENV)/bin/llmctl render --stack $(STACK)

clean:
	rm -rf build .pytest_cache
