# hpctrain — the two set-up commands (see README.md): `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DATA := data/demo

.PHONY: venv demo test lint format clean

venv: $(STAMP)

# torch>=2.6 resolves to the release pip may install here (2.14.1 with torchvision 0.29.1).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

$(DEMO_DATA)/images/.done: tools/make_demo_data.py | $(STAMP)
	$(BIN)/python tools/make_demo_data.py $(DEMO_DATA)/images --num-images 3000 --size 64 --seed 0
	touch $@

$(DEMO_DATA)/shards/train/index.json: $(DEMO_DATA)/images/.done
	rm -rf $(DEMO_DATA)/shards
	$(BIN)/hpctrain convert $(DEMO_DATA)/images $(DEMO_DATA)/shards --val-fraction 0.1 --samples-per-shard 256 --shuffle --seed 0

# Generates the dataset (once), converts it to shards, trains from scratch, plots the curves.
demo: $(DEMO_DATA)/shards/train/index.json
	rm -rf runs/demo
	$(BIN)/hpctrain train configs/demo.yaml
	$(BIN)/hpctrain plot runs/demo

# The whole suite; the SLURM tier runs against a local dev cluster that tools/run-tests starts.
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" tools/run-tests

lint: $(STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests tools
	$(BIN)/ruff check --fix src tests tools

clean:
	rm -rf $(VENV) runs/demo $(DEMO_DATA) .pytest_cache .mypy_cache .ruff_cache
