# ddpflow developer commands. `make demo` and `make test` are the README's two.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.ddpflow-installed

# Prefect and MLflow keep their state inside the project, never in ~.
export PREFECT_HOME ?= $(CURDIR)/.ddpflow/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90

.PHONY: venv demo lint test test-fast bench bench-quick stack-up stack-down stack-status clean

venv: $(STAMP)

# `pip install torch==2.13.0` first: the version the suite passed with, the build pip's index offers for this
# platform (from PyPI on Linux x86_64: the CUDA build, several GB; an index or a local wheel that serves the CPU
# build gives that). Installing the project first would let pip resolve `torch>=2.4` to the newest release.
# constraints.txt: the exact versions the suite passed with (pyproject.toml stays loose for users).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

demo: venv
	$(VENV)/bin/ddpflow run --config configs/demo.yaml

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# In pytest-xdist workers, one per core, a test module per worker at a time (--dist loadfile: its module-scoped
# fixtures are built once); the heaviest modules go first (tests/suite_marks.py).
test: lint
	$(PY) -m pytest -n auto --dist loadfile

# No ranks, no servers, no Slurm (tests/suite_marks.py fails a test that starts one unmarked): about 3 minutes
# on 2 cores, in pytest-xdist workers, one per core (docs/testing.md).
test-fast: venv
	$(PY) -m pytest -m "not torchrun and not server and not slurm" -n auto

bench: venv
	$(PY) -m bench

bench-quick: venv
	$(PY) -m bench --quick

# One repeat of a family under py-spy, every process it starts: bench/profiles/FAMILY.txt and FAMILY.md.
profile-%: venv
	$(PY) -m bench --profile $*

stack-up: venv
	$(VENV)/bin/ddpflow stack up

stack-down: venv
	$(VENV)/bin/ddpflow stack down

stack-status: venv
	$(VENV)/bin/ddpflow stack status

clean:
	rm -rf $(VENV) .ddpflow data/shards runs mlflow.db mlartifacts .pytest_cache
