# Quick start: `make demo` and `make test`. Both build .venv/ on first use
# (CPU torch, MMEngine, mmcv with compiled ops, MMSegmentation); later runs
# reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 2
# Test workers: the suite runs its files on this many processes at once
# (pytest-xdist); each test file stays on one worker (tests/conftest.py).
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# A TEST_WORKERS that is no count is named, not passed on (pytest-xdist
# takes -n -1 as "no workers" and runs everything in one process).
CHECK_TEST_WORKERS = @case '$(TEST_WORKERS)' in ''|*[!0-9]*) echo "make: TEST_WORKERS should be a number of test workers (0: run the tests in one process), but got '$(TEST_WORKERS)'" >&2; exit 2;; esac

# The environment is judged by what it was installed from, not by file
# times: the stamp's name carries a hash of setup.py and the requirements, so
# a fresh clone beside a current environment neither rebuilds nor re-points
# it, while a changed requirement reinstalls.
INSTALL_FROM := setup.py requirements/runtime.txt requirements/dev.txt \
	requirements/triton.txt
INSTALL_KEY := $(shell cat $(INSTALL_FROM) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(INSTALL_KEY)

# Every target runs this checkout's sources (the editable install may point
# at another clone), subprocesses included; the CPU codec is built in place,
# from this checkout's C source, when that source is newer.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
CODEC := mmcv_custom/.cpu_codec-built

.PHONY: install demo lint format test test-fast clean

install: $(STAMP) $(CODEC)

$(STAMP):
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
	# Beside the venv, not in it (requirements/triton.txt says why).
	$(PIP) install --no-deps --upgrade --target $(VENV)/triton \
		-r requirements/triton.txt
	$(PIP) install --no-build-isolation --no-deps -e .
	rm -f $(VENV)/.installed*
	touch $@

# The C extension beside this checkout's sources (seconds).
$(CODEC): mmcv_custom/csrc/cpu_codec.c | $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace
	touch $@

demo: install
	$(PY) tools/demo.py

# The sources `make lint` checks, with MMEngine's settings (setup.cfg).
LINTED := mmcv_custom tools tests configs setup.py

lint: install
	$(PY) -m flake8 $(LINTED)
	$(PY) -m isort --check-only --diff $(LINTED)
	$(PY) -m yapf --recursive --diff $(LINTED)

# Rewrites the sources in place to pass `make lint`'s isort and yapf.
format: install
	$(PY) -m isort $(LINTED)
	$(PY) -m yapf --recursive --in-place $(LINTED)

test: install
	$(CHECK_TEST_WORKERS)
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=25 tests

test-fast: install
	$(CHECK_TEST_WORKERS)
	$(PY) -m pytest $(PYTEST_PARALLEL) tests -m "not slow"

clean:
	rm -rf work_dirs .pytest_cache
