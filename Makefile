# Two commands: `make demo` and `make test`. Both create .venv and install the project if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: setup test lint format demo bench bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

test: setup lint
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	$(PY) demo_full_stack.py

bench: setup
	$(PY) -m benchmarks.run

bench-quick: setup
	$(PY) -m benchmarks.run --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
