# llmstack: `make dev` runs the stack locally, `make test` runs the tests.
# Both install what they need into .venv on first use.

PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STACK ?= local
PORT ?= 8080
LITELLM := .cache/llmstack/litellm-venv/bin/litellm

.PHONY: help install lint redis-server wrk promtool dev preview deploy destroy cloud-stack test test-fast test-deep bench plan render clean

help:
	@echo "make dev          run the whole serving path on this machine (gateway on PORT=8080)"
	@echo "make bench        benchmarks (figures recorded in BENCHMARKS.md)"
	@echo "make test         install into .venv and run every test (test-fast: without the slow ones;"
	@echo "                  test-deep: every test, hypothesis properties explored deeper)"
	@echo "make plan STACK=  capacity and cost of a stack (llmctl plan)"
	@echo "make render STACK= Kubernetes manifests of a stack into build/manifests/"
	@echo "make preview|deploy|destroy STACK=dev   Pulumi, after llmctl plan (deploy: llmctl doctor) passes"

$(STAMP): pyproject.toml ops/devstack/install_cpu_engine.sh
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (llmstack runs on Python 3.11 or 3.12; PYTHON=python3.12 to use 3.12)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[cli,serve,gateway,infra,ops,dev,bench,test]"
	bash ops/devstack/install_cpu_engine.sh $(PIP)
	@touch $(STAMP)

# The tests use a real redis-server. As root with apt (CI, our machines) we install it;
# elsewhere we say how.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "==> installing redis-server (apt-get)"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is needed by the tests: install it (Debian/Ubuntu: sudo apt-get install -y redis-server)"; exit 1; fi; }

# The alert-rule tests also run Prometheus's own promtool (Debian's prometheus package ships
# it; the daemon is not started). Without it they still parse every rule with promql-parser.
promtool:
	@command -v promtool >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "==> installing promtool (apt-get install prometheus)"; \
	    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
	      || echo "could not install promtool: alert rules are checked with promql-parser only"; \
	  else echo "promtool not found: alert rules are checked with promql-parser only (Debian/Ubuntu: sudo apt-get install prometheus)"; fi; }

install: $(STAMP)

# Lint, types and the import contract first (seconds with mypy's cache), then every test.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest runs side by side. The end-to-end tests (tests/e2e: one shared dev stack, mostly
# waiting on engines) run in the background, their output kept in build/e2e-tests.log and shown
# when they end (that run leaves .pytest_cache to the other). Every other test runs in the
# foreground on PYTEST_WORKERS processes (pytest-xdist; `--dist loadfile` keeps a module's tests on
# one worker, so tests that measure CPU or share a module's servers never run beside each other),
# so a unit test's failure shows within minutes.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: $(STAMP) redis-server promtool lint
	@mkdir -p build
	@$(PY) -m pytest -q -p no:cacheprovider tests/e2e > build/e2e-tests.log 2>&1 & e2e=$$!; \
	  $(PYTEST) --ignore=tests/e2e; others=$$?; \
	  echo "==> the end-to-end tests (tests/e2e; log: build/e2e-tests.log)"; \
	  wait $$e2e; e2e_status=$$?; cat build/e2e-tests.log; \
	  test $$others = 0 && test $$e2e_status = 0

# Without the tests marked slow (real server processes, engines): a few minutes.
test-fast: $(STAMP) redis-server promtool lint
	$(PYTEST) -m "not slow"

test-deep: export HYPOTHESIS_PROFILE = deep
test-deep: test

# The whole serving path on this machine; Ctrl-C stops it. PORT is the gateway's port.
dev: $(STAMP)
	$(PY) -m ops.devstack --stack $(STACK) --port $(PORT) $(if $(filter 1,$(TRACE)),--trace)

# Benchmarks: figures go to BENCHMARKS.md with the command that produced them.
bench: $(STAMP) redis-server wrk $(LITELLM)
	$(PY) -m ops.benchmarks.kv_capacity --stack local
	$(PY) -m ops.benchmarks.kv_capacity --stack tests/stacks/Pulumi.draft.yaml
	$(PY) -m ops.benchmarks.http_clients
	$(PY) -m ops.benchmarks.gateway --litellm $(LITELLM) --out build/bench/gateway.json
	$(PY) -m ops.benchmarks.fair_queue_gateway --out build/bench/fair_queue_gateway.json
	$(PY) -m ops.benchmarks.gateway_stream --out build/bench/gateway_stream.json
	$(PY) -m ops.benchmarks.gateway_stream --interval-ms 10 --out build/bench/gateway_stream_paced.json
	$(PY) -m ops.benchmarks.serving --out build/bench/serving.json
	$(PY) -m ops.benchmarks.serving --client llmctl --paths direct --out build/bench/serving-llmctl.json
	$(PY) -m ops.benchmarks.prefix_routing --out build/bench/prefix_routing.json
	$(PY) -m ops.benchmarks.autoscale_demo --out build/bench/autoscale.json
	$(PY) -m ops.benchmarks.saturation_scaling --out build/bench/saturation_scaling.json
	$(PY) -m ops.benchmarks.model_sync --out build/bench/model_sync.json
	$(PY) -m ops.benchmarks.batch --out build/bench/batch.json

# The gateway benchmark drives load with Debian's wrk, and compares with LiteLLM proxy, which
# gets its own venv: it is a comparison point, never a dependency of llmstack.
$(LITELLM):
	$(PYTHON) -m venv .cache/llmstack/litellm-venv
	.cache/llmstack/litellm-venv/bin/pip install -q "litellm[proxy]==1.108.7"

wrk:
	@command -v wrk >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "==> installing wrk (apt-get)"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	  else echo "make bench needs wrk (Debian/Ubuntu: sudo apt-get install -y wrk)"; exit 1; fi; }

# Cloud stacks: checks (not local, Pulumi CLI, AWS credentials, llmctl plan), then Pulumi.
preview deploy destroy: cloud-stack $(STAMP)
	$(PY) -m ops.llmctl.deploy $@ --stack $(STACK)

cloud-stack:
	@test "$(STACK)" != local || { echo "STACK=local is the CPU stack for make dev; nothing to provision. Use STACK=dev or STACK=prod."; exit 1; }

plan: $(STAMP)
	$(VENV)/bin/llmctl plan --stack $(STACK)

render: $(STAMP)
	$(VENV)/bin/llmctl render --stack $(STACK)

clean:
	rm -rf build .pytest_cache
