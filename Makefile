# Both targets set themselves up on a fresh machine: they create .venv with
# python3.12 and install the package with its test extras, pinned by
# requirements/ci.txt, before running.
PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo setup clean compile-h200

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/ci.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(PY) -m stellarax.tools.demo --output demo_out

# Compile every Pallas kernel for an H200 without a GPU (bench/compile_h200.py) in a
# virtual environment of its own: the CUDA plugin must not become the tests' backend.
H200_VENV := .venv-h200
H200_STAMP := $(H200_VENV)/.installed

$(H200_STAMP): pyproject.toml requirements/ci.txt requirements/h200-compile.txt
	test -x $(H200_VENV)/bin/python || $(PYTHON) -m venv $(H200_VENV)
	$(H200_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(H200_VENV)/bin/python -m pip install --quiet -c requirements/ci.txt -e . -r requirements/h200-compile.txt
	touch $(H200_STAMP)

compile-h200: $(H200_STAMP)
	$(H200_VENV)/bin/python bench/compile_h200.py --out results/compile-h200

clean:
	rm -rf $(VENV) $(H200_VENV) demo_out
