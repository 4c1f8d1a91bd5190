# llmstack: `make dev` runs the stack locally, `make test` runs the tests.
# Both install what they need into .venv on first use.

PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STACK ?= local

.PHONY: help install dev test test-fast bench plan render clean

help:
	@echo "make dev          run the whole serving path on this machine (arrives with the local-stack change)"
	@echo "make bench        benchmarks (figures recorded in BENCHMARKS.md)"
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

dev:
	@echo "make dev arrives with the local-stack change (issue: make dev). Today: make plan STACK=local, make render STACK=local."
	@exit 1

# Benchmarks: figures go to BENCHMARKS.md with the command that produced them.
bench: $(STAMP)
	$(PY) -m ops.kv_capacity --stack local
	$(PY) -m ops.kv_capacity --stack tests/stacks/Pulumi.draft.yaml

plan: $(STAMP)
	$(VENV)/bin/llmctl plan --stack $(STACK)

render: $(STAMP)
	$(VENV)/bin/llmctl render --stack $(STACK)

clean:
	rm -rf build .pytest_cache
