# Two commands: `make demo` and `make test`. Each builds .venv from the pinned lock first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m jaxsched demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

bench: $(STAMP)
	$(PY) benchmarks/transform_overhead.py --steps 60 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache
