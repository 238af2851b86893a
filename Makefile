# Quick start: `make demo` and `make test`. Both build .venv/ on first use
# (CPU torch, MMEngine, mmcv with compiled ops, MMSegmentation); later runs
# reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Rebuilt when any of these change.
STAMP := $(VENV)/.installed
NPROC ?= 2

.PHONY: install demo lint format test test-fast clean

install: $(STAMP)

$(STAMP): setup.py requirements/runtime.txt requirements/dev.txt \
		mmcv_custom/csrc/cpu_codec.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first: mmcv compiles against it. setuptools<81 still ships the
	# pkg_resources that mmcv's setup.py imports; torch needs >=77.0.3.
	$(PIP) install torch==2.13.0 'setuptools>=77.0.3,<81' wheel numpy
	# MMSegmentation imports mmcv's compiled ops; mmcv 2.1.0 has no wheel for
	# this torch, so it is built from source once (about 20 min on 2 cores;
	# pip caches the wheel for later installs).
	MAX_JOBS=$(NPROC) $(PIP) install --no-build-isolation mmcv==2.1.0
	$(PIP) install -r requirements/dev.txt
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	$(PY) tools/demo.py

# The sources `make lint` checks, with MMEngine's settings (setup.cfg).
LINTED := mmcv_custom tools tests configs setup.py

lint: $(STAMP)
	$(PY) -m flake8 $(LINTED)
	$(PY) -m isort --check-only --diff $(LINTED)
	$(PY) -m yapf --recursive --diff $(LINTED)

# Rewrites the sources in place to pass `make lint`'s isort and yapf.
format: $(STAMP)
	$(PY) -m isort $(LINTED)
	$(PY) -m yapf --recursive --in-place $(LINTED)

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

clean:
	rm -rf work_dirs .pytest_cache
