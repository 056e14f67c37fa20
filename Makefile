# hpctrain — the set-up commands (see README.md): `make demo`, `make demo-lm`, `make test`
# and `make test-fast`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs into one venv: what running needs (`make demo`, `make demo-lm`: hpctrain, torch
# and the runtime dependencies) and, on top of it, the dev extra (`make test`, `make lint`: the
# test, lint and tracker stack). A stamp is newer than pyproject.toml once its install is done;
# the dev stamp keeps its old name, so venvs made before the split stay valid.
STAMP := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.runtime-stamp
# pip's own output (no --quiet) is the progress: each package as it is fetched, with a bar in a
# terminal; torch alone is a few GB.
PIP := $(BIN)/pip install --disable-pip-version-check
# pip prints each package as it fetches it, then "Installing collected packages: ..." and nothing
# more while it unpacks them (2-3 minutes on 2 cores for torch's 5 GB): say so before it starts.
# Never name an exported variable PIP_*: pip reads those as its own options (PIP_QUIET=text
# made every install fail).
export INSTALL_WAIT := make: after pip's line "Installing collected packages", expect 2-3 minutes without output while it writes the files
# `make demo TORCH=cpu` (and `make test TORCH=cpu`): torch and torchvision's CPU builds from
# PyTorch's own index first (torch about 0.8 GB installed, against 5.3 GB for the CUDA build with
# its CUDA libraries and triton, which `pip install torch` takes from PyPI on Linux x86_64); pip
# then keeps them for hpctrain. The package index serves no CPU build of torchvision: its
# torchvision needs the CUDA build's libraries (measured: docs/benchmark-log.md).
TORCH ?=
CPU_INDEX := https://download.pytorch.org/whl/cpu
ifeq ($(TORCH),cpu)
TORCH_FIRST = $(PIP) --index-url $(CPU_INDEX) 'torch>=2.6' 'torchvision>=0.21' &&
# Where PyTorch's index cannot be reached, pip may take a CUDA torchvision beside a CPU torch,
# which does not import ("operator torchvision::nms does not exist"): fail here, not in the demo.
CHECK_TORCHVISION = @$(BIN)/python -c "import torchvision" 2>/dev/null || { echo "make: TORCH=cpu: torchvision does not import beside this torch: both must come from $(CPU_INDEX) (was it reachable?); make clean, then make $(or $(MAKECMDGOALS),demo) without TORCH=cpu" >&2; exit 1; }
else ifneq ($(TORCH),)
$(error TORCH=$(TORCH): only TORCH=cpu is known (empty: the package index's build))
endif
NO_DRIVER_HINT = if [ -z "$(TORCH)" ] && [ ! -e /proc/driver/nvidia/version ] && ! command -v nvidia-smi >/dev/null 2>&1; then echo "make: no NVIDIA driver here: make $(or $(MAKECMDGOALS),demo) TORCH=cpu would install torch's CPU build (about 0.8 GB) instead of the CUDA build (5.3 GB)"; fi
DEMO_DATA := data/demo
# The demos' last line: the docs type bare `hpctrain` and `python`, which live in the venv.
export ON_PATH := make: hpctrain and python are in $(BIN), not on your PATH: source $(BIN)/activate (or type $(BIN)/hpctrain)
LM_DATA := data/demo-lm

.PHONY: venv demo demo-lm test test-fast lint format docs clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch>=2.6 resolves to the release pip may install here (2.14.1 with torchvision 0.29.1).
# A venv that already has the dev extra (installed after the last change of pyproject.toml)
# has all that running needs.
$(RUN_STAMP): pyproject.toml | $(BIN)/python
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then \
		echo "make: $(VENV) already has what running needs (the dev extra)"; \
	else \
		$(NO_DRIVER_HINT); \
		echo "make: installing hpctrain, torch and what running needs into $(VENV) (about 5 GB: minutes)"; \
		echo "$$INSTALL_WAIT"; \
		$(TORCH_FIRST) $(PIP) -e . ; \
	fi
	$(CHECK_TORCHVISION)
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "make: installing hpctrain with its dev extra into $(VENV) (torch, tests, lint, trackers: about 6.5 GB: minutes)"
	@$(NO_DRIVER_HINT)
	@echo "$$INSTALL_WAIT"
	$(TORCH_FIRST) $(PIP) -e '.[dev]'
	$(CHECK_TORCHVISION)
	touch $@

$(DEMO_DATA)/images/.done: tools/make_demo_data.py | $(RUN_STAMP)
	$(BIN)/python tools/make_demo_data.py $(DEMO_DATA)/images --num-images 3000 --size 64 --seed 0
	touch $@

$(DEMO_DATA)/shards/train/index.json: $(DEMO_DATA)/images/.done
	rm -rf $(DEMO_DATA)/shards
	$(BIN)/hpctrain convert $(DEMO_DATA)/images $(DEMO_DATA)/shards --val-fraction 0.1 --samples-per-shard 256 --shuffle --seed 0

# Generates the dataset (once), converts it to shards, trains from scratch, plots the curves.
demo: $(RUN_STAMP) $(DEMO_DATA)/shards/train/index.json
	rm -rf runs/demo
	$(BIN)/hpctrain train configs/demo.yaml
	$(BIN)/hpctrain plot runs/demo
	@echo "$$ON_PATH"

# The language-model demo's text: the top-level modules of this Python's standard library.
$(LM_DATA)/text/SOURCES.txt: tools/stdlib_corpus.py | $(RUN_STAMP)
	rm -rf $(LM_DATA)/text
	$(BIN)/python tools/stdlib_corpus.py $(LM_DATA)/text

$(LM_DATA)/shards/train/index.json: $(LM_DATA)/text/SOURCES.txt
	rm -rf $(LM_DATA)/shards
	$(BIN)/hpctrain convert $(LM_DATA)/text $(LM_DATA)/shards --tokenizer bytes --text-glob '*.py' --val-fraction 0.05 --samples-per-shard 16 --shuffle --seed 0

# Converts the stdlib (once), trains a byte-level gpt-tiny, prints bits per byte against the
# unigram baseline (fails if not below it), plots the curves and prints a generated continuation.
demo-lm: $(RUN_STAMP) $(LM_DATA)/shards/train/index.json
	rm -rf runs/demo-lm
	$(BIN)/hpctrain train configs/demo-lm.yaml
	$(BIN)/python tools/lm_report.py runs/demo-lm
	$(BIN)/hpctrain plot runs/demo-lm
	$(BIN)/hpctrain generate runs/demo-lm --prompt 'def __init__(self' --max-new-tokens 200 --temperature 0.8 --top-k 20
	@echo "$$ON_PATH"

# The whole suite; the SLURM tier runs against a local dev cluster that tools/run-tests starts.
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" tools/run-tests

# The unit tier and the docs blocks that do not train: no SLURM, no multi-process, no servers.
test-fast: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" tools/run-tests --fast

lint: $(STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests tools
	$(BIN)/ruff check --fix src tests tools

# Regenerates docs/config-reference.md from the config schema and the strategy table of
# docs/training.md from hpctrain.parallel.comms (tests keep both current).
docs: $(STAMP)
	$(BIN)/python tools/config_reference.py
	$(BIN)/python tools/comms_table.py

clean:
	rm -rf $(VENV) runs/demo runs/demo-lm $(DEMO_DATA) $(LM_DATA) .pytest_cache .mypy_cache .ruff_cache

# Every goal a few minutes here can check, one line each: goal | ratio | met/missed/noisy
# (hpctrain.bench.quick; not in CI). Run it before changing the loop, the loader or checkpoints.
.PHONY: bench-quick
bench-quick: $(STAMP)
	$(BIN)/python -m hpctrain.bench.quick
