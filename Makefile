# Two commands: `make demo` and `make test`. Each builds .venv from the pinned lock first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AOT_STAMP := $(VENV)/.installed-aot

.PHONY: demo test test-slow venv clean bench

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The `aot` extra (compile-only GPU and TPU toolchains, about 400 MB): the tests compile
# every strategy for GPU and TPU clusters without the hardware.
$(AOT_STAMP): $(STAMP) requirements-aot.lock
	$(PY) -m pip install --quiet -r requirements-aot.lock
	touch $(AOT_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m jaxsched demo

# `make test`: everything but multi-process and fresh-interpreter tests (marked slow), a few
# minutes on 2 cores. CI also runs `make test-slow`.
test: $(AOT_STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow" tests

test-slow: $(AOT_STAMP)
	$(PY) -m pytest -n 2 -q -m slow tests

bench: $(STAMP)
	$(PY) benchmarks/transform_overhead.py --steps 60 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache
