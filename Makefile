# unmask developer commands. `make install` builds .venv; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-serial test-fast docs bench gpu-check clean

install: $(STAMP)

# Order matters: torch first (the CPU or CUDA build this machine needs), then deepspeed
# without build isolation (its setup.py imports torch), then the project, the dev tools and
# lm-evaluation-harness (`unmask lm-eval`; its tests are in the suite), torchao (`train.float8`: its refusals
# and layer swap are tested on CPU) and the manual's tools.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install --no-build-isolation "deepspeed>=0.19.8,<0.20"
	$(PIP) install -e ".[dev,lm-eval,fp8,docs]"
	touch $(STAMP)

# The whole pipeline (prep -> train -> export -> eval -> report) on CPython's own docs.
demo: install
	$(VENV)/bin/unmask run --run-dir runs/demo

# The suite in two processes (pytest-xdist, -n 2): what CI runs (docs/testing.md has the figures).
test: install
	$(PY) -m pytest -n 2

# The same suite in one process: for a failure to read in order, or a machine with one core.
test-serial: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -n 2 -m "not slow"

# The manual (docs/, mkdocs.yml) into site/, offline and strict: a broken link or anchor, a page
# outside the nav, an undocumented public function of the API pages or a stale config reference
# fails the build (docs/hooks.py).
docs: install
	$(VENV)/bin/mkdocs build --strict  # not --quiet: it hides the warnings that strict mode counts

bench: install
	$(PY) bench/model_cpu.py

# On a GPU machine (the CUDA build of torch in .venv): the whole suite, the CUDA tests
# (marker gpu) included, then the GPU training/evaluation/sampling benchmark.
gpu-check: install
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device (is the CUDA build of torch in .venv?)')"
	$(PY) -m pytest -m gpu -v
	$(PY) -m pytest
	$(PY) bench/train_gpu.py --presets small medium

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
