# Targets named in the README. `make test` and `make demo` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv lint typecheck test unit proto llama model demo controller clean browser bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

proto: venv
	$(PY) -m proto.generate

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check domain application infrastructure interfaces agent ops tests bench proto/generate.py proto/__init__.py

typecheck: venv
	$(VENV)/bin/mypy

# llama.cpp binaries and the test model, cached outside the checkout (see ops/).
llama: venv
	$(PY) -m ops.build_llama

model: venv
	$(PY) -m ops.fetch_model

# Headless Chromium for the dashboard test: Debian's package, never `playwright install`.
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# The whole suite: lint, types, unit, integration (real Postgres/Redis), e2e (real llama.cpp).
test: venv llama model browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check domain application infrastructure interfaces agent ops tests bench proto/generate.py proto/__init__.py
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

unit: venv
	$(VENV)/bin/pytest tests/unit

demo: venv llama model
	$(PY) -m ops.demo

# Direct llama-server vs through the controller, side by side (results in var/bench/).
bench: venv llama model
	$(PY) -m bench.compare_paths --wait-idle 900

controller: venv
	$(VENV)/bin/dacp controller

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
