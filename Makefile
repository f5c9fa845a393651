# Two commands: `make demo` and `make test`. Each builds what it needs from the pinned locks.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The compile-only GPU and TPU toolchains (the `aot` extra, about 400 MB) live in their own
# environment: installed beside JAX, they make every CPU run print plugin errors and CUDA
# driver messages. `jaxsched inspect` and the tests that compile for GPU and TPU use it.
AOT_VENV := .venv-aot
AOT_PY := $(AOT_VENV)/bin/python
AOT_STAMP := $(AOT_VENV)/.installed

.PHONY: demo test test-slow docs lint venv aot clean bench

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(AOT_STAMP): requirements.lock requirements-aot.lock pyproject.toml
	test -x $(AOT_PY) || $(PYTHON) -m venv $(AOT_VENV)
	$(AOT_PY) -m pip install --quiet --upgrade pip
	$(AOT_PY) -m pip install --quiet -r requirements.lock -r requirements-aot.lock
	$(AOT_PY) -m pip install --quiet --no-deps -e .
	touch $(AOT_STAMP)

DEV_STAMP := $(VENV)/.installed-dev

$(DEV_STAMP): $(STAMP) requirements-dev.lock requirements-docs.lock
	$(PY) -m pip install --quiet -r requirements-dev.lock -r requirements-docs.lock
	touch $(DEV_STAMP)

venv: $(STAMP)
aot: $(AOT_STAMP)

demo: $(STAMP)
	$(PY) -m jaxsched demo

# `make test`: about 4 minutes on 2 cores (plus a minute to build the environments).
# Everything but multi-process and fresh-interpreter tests (marked slow, run by
# `make test-slow` in CI); the tests that compile for GPU and TPU run in the aot environment.
# Most of the CPU tests' time is XLA:CPU compiling small programs: LLVM's optimisation
# level 0 cuts it by a third (4:22 -> 3:08 on 2 cores, 2026-11-27). It changes how fast the
# code runs, not what it computes, and the plain and the scheduled step of every equivalence
# test are compiled alike; `make test-slow` keeps XLA's default level.
TEST_XLA_FLAGS := --xla_backend_optimization_level=0
test: $(DEV_STAMP) $(AOT_STAMP)
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest -n 2 -q -m "not slow and not aot" tests
	JAXSCHED_REQUIRE_TOOLCHAINS=1 $(AOT_PY) -m pytest -n 2 -q -m "aot and not slow" tests

test-slow: $(STAMP) $(AOT_STAMP)
	$(PY) -m pytest -n 2 -q -m "slow and not aot" tests
	JAXSCHED_REQUIRE_TOOLCHAINS=1 $(AOT_PY) -m pytest -n 2 -q -m "slow and aot" tests

# The documentation site (guides and the API reference from the docstrings), warnings as errors.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# ruff (lint and format) over everything; mypy over every module of the package.
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check jaxsched tests benchmarks examples
	$(VENV)/bin/ruff format --check jaxsched tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/transform_overhead.py --steps 60 --repeats 3

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache site
