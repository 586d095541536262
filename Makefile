# One-command set-up: a virtual environment in .venv with torch (TORCH_INDEX: where from), then the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup demo test lint bench-staging bench-recovery bench-sifting bench-carbon clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	# torch first, pinned, so that torch>=2.7 is already met. On Linux, PyPI's torch is the CUDA build (GBs of
	# nvidia wheels): TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build instead. Empty, pip's
	# configured index decides (a CI machine's own index may hold the CPU build).
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/trainyard demo

# Two pytest-xdist workers, each taking whole test files (a module's servers and workers start once; flows/ as
# one), longest first (tests/conftest.py): the suite waits on servers, workers and replicas as much as it computes.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# ruff (lint and format) over everything; mypy over the package (pyproject.toml's [tool.mypy]).
lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

# Trainyard staging vs aws s3 sync on a local S3 endpoint (see benchmarks/README.md); a few minutes.
bench-staging: setup
	$(BIN)/python benchmarks/staging.py

# Recovery from a killed group vs a torchrun-style restart from S3 checkpoints; about 10 minutes.
bench-recovery: setup
	$(BIN)/python benchmarks/recovery.py

# Online sifting and the prefilter vs a tuned baseline, FLOPs and wall time to the same accuracy.
bench-sifting: setup
	$(BIN)/python benchmarks/sifting.py

# What carbon metering costs in training wall time, and its energy against RAPL or the TDP model.
bench-carbon: setup
	$(BIN)/python benchmarks/carbon.py

clean:
	rm -rf $(VENV) .pytest_cache
