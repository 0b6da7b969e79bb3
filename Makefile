# Targets named in the README. `make test` and `make demo` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv lint typecheck test test-vulkan unit proto llama model demo controller clean browser bench bench-capacity bench-prefix-routing bench-conversations bench-hot-path

# First-run set-up (venv, llama.cpp build, model, browser) runs its steps side by side, with
# the system python3, before the venv exists; see ops/bootstrap.py. Cached steps are no-ops.
BOOTSTRAP := $(PYTHON) -m ops.bootstrap

venv:
	@$(BOOTSTRAP) test --only venv

proto: venv
	$(PY) -m wire.generate

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check domain application infrastructure interfaces agent ops tests bench common wire/generate.py wire/keepalive.py wire/grpc_verbosity.py
	$(VENV)/bin/lint-imports --no-cache

typecheck: venv
	$(VENV)/bin/mypy

# llama.cpp binaries and the test model, cached outside the checkout (see ops/).
# The llama.cpp backend is this machine's (cuda with an NVIDIA GPU and nvcc, ...; README "GPUs");
# LLAMA_BACKEND=cuda make llama forces one, CUDA_ARCHITECTURES=90 names the GPUs to build for.
llama:
	@$(BOOTSTRAP) test --only llama.cpp

model:
	@$(BOOTSTRAP) test --only model

# Headless Chromium for the dashboard test: Debian's package, never `playwright install`.
browser:
	@$(BOOTSTRAP) test --only browser

# The whole suite: lint, types, unit, integration (real Postgres/Redis), e2e (real llama.cpp).
test:
	@$(BOOTSTRAP) test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check domain application infrastructure interfaces agent ops tests bench common wire/generate.py wire/keepalive.py wire/grpc_verbosity.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest

unit: venv
	$(VENV)/bin/pytest tests/unit

# Opt-in: the Vulkan backend end to end on lavapipe (Mesa's software Vulkan device). Needs
# glslc, libvulkan-dev and mesa-vulkan-drivers; builds the vulkan backend first (23 min here).
test-vulkan: venv
	$(VENV)/bin/pytest -m vulkan tests/vulkan

demo:
	@$(BOOTSTRAP) demo
	$(PY) -m ops.demo

# Direct llama-server vs through the controller, side by side (results in var/bench/).
bench:
	@$(BOOTSTRAP) test --only venv --only llama.cpp --only model
	$(PY) -m bench.compare_paths --wait-idle 900

# What the controller adds to a warm request's first token, without llama.cpp: a stand-in server
# against the controller with one synthetic agent, interleaved (embedded store).
bench-hot-path:
	@$(BOOTSTRAP) test --only venv
	$(PY) -m bench.hot_path

# Many clients at once: one controller on Postgres + Redis (DATABASE_URL-style BENCH_DATABASE_URL
# and BENCH_REDIS_URL, default the local services), synthetic agents, 800 streams.
bench-capacity:
	@$(BOOTSTRAP) test --only venv
	$(PY) -m bench.capacity

# Cache-aware routing on and off (PREFIX_ROUTING), side by side: where conversations' later
# turns land, prefix hits, queue wait, latency. Postgres + Redis as for bench-capacity.
bench-prefix-routing:
	@$(BOOTSTRAP) test --only venv
	$(PY) -m bench.prefix_routing

# Conversations on real llama.cpp, cache-aware routing on and off interleaved: two local clusters
# of two warm servers each; TTFT of first and later turns, cached prompt tokens, tokens/s.
bench-conversations:
	@$(BOOTSTRAP) test --only venv --only llama.cpp --only model
	$(PY) -m bench.conversations

controller: venv
	$(VENV)/bin/dacp controller

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
