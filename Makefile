# Two commands: `make demo` and `make test`. Both create .venv and install the project if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: setup blas test lint docs format demo bench bench-quick bench-gpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# Debian's OpenBLAS: without it MLX's CPU matmuls on Linux run ~30x slower (agentkv preloads it,
# see agents/models/blas.py, which also says whether it is installed). No wheel will do: MLX
# imports cblas_sgemm unprefixed, and the scipy-openblas wheels export scipy_cblas_sgemm.
# Installed when this user can (root, or passwordless sudo); otherwise one line says how.
blas:
	@if $(PYTHON) -c "import runpy; blas = runpy.run_path('agents/models/blas.py'); raise SystemExit(not blas['wanted_but_missing']())"; then \
	if [ "$$(id -u)" = 0 ]; then as=""; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then as="sudo -n"; \
	else as=no; fi; \
	if [ "$$as" != no ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's libopenblas0-pthread (MLX's CPU matmuls are ~30x faster with it)"; \
	  if { timeout 300 $$as apt-get update -qq && timeout 300 $$as env \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread; } \
	      >/dev/null 2>&1; then exit 0; fi; \
	fi; \
	echo "*** No OpenBLAS: MLX's CPU matmuls run ~30x slower. Install it: sudo apt-get install libopenblas0-pthread ***"; \
	fi

test: blas setup lint docs
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (docs/, mkdocs.yml): broken links and anchors fail the build. The API
# reference reads the installed package's tree, agentkv/ over the repo's folders, linked here.
docs: setup
	@rm -rf $(VENV)/api && mkdir -p $(VENV)/api/agentkv
	@for f in agents/*; do ln -s "$(CURDIR)/$$f" $(VENV)/api/agentkv/; done
	@for d in engine store server migrations; do ln -s "$(CURDIR)/$$d" $(VENV)/api/agentkv/$$d; done
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir $(VENV)/site

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: blas setup
	$(PY) demo_full_stack.py

bench: setup
	$(PY) -m benchmarks.run

bench-quick: setup
	$(PY) -m benchmarks.run --quick

# For an accelerator machine (docs/benchmarks.md): the standard set on a Gemma 3 12B-shaped
# random model built there, JSON into $(OUT). Installs nothing (such a machine may be offline):
# PY=python3 where agentkv and MLX are installed otherwise.
bench-gpu:
	@test -n "$(OUT)" || { echo "usage: make bench-gpu OUT=dir [PY=python3]"; exit 2; }
	$(PY) -m benchmarks.bench_gpu $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
