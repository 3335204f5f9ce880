# One-command setup: `make demo` and `make test` create .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# PyTorch, pinned. On this project's machines a CPU build of 2.13.0 lies on disk and pip takes it;
# on a stock Linux machine the same pin pulls the CUDA build from PyPI (several GB). A CPU-only
# user runs: make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH  ?= torch==2.13.0

.PHONY: venv demo test bench lint clean

$(VENV)/.installed: pyproject.toml requirements-megatron.txt requirements-torchtitan.txt \
                   requirements-torchtitan-trainer.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
# Megatron-Core (tests/test_megatron.py): --no-deps so that pip never replaces torch
	$(PY) -m pip install -q --no-deps -r requirements-megatron.txt
# TorchTitan (tests/test_torchtitan.py): --no-deps for the same reason
	$(PY) -m pip install -q --no-deps -r requirements-torchtitan.txt
# TorchTitan's Trainer (tests/test_torchtitan_trainer.py): what torchtitan.trainer imports
	$(PY) -m pip install -q --no-deps -r requirements-torchtitan-trainer.txt
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/mc2 demo

# the slowest tests are printed at the end of every run, so the next slow one is seen when it lands;
# two workers (pytest-xdist): most tests wait on their worlds' processes, so two files run at once
# in less time than one after the other (one sitting: 330 s alone, 253 s with two, 2 cores);
# --dist loadfile keeps a file in one worker, so a module fixture's worlds run once
test: venv
	$(PY) -m pytest -q tests -n 2 --dist loadfile --durations=15

lint: venv
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check src tests benchmarks

bench: venv
	$(PY) benchmarks/sweep_micro_batches.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
