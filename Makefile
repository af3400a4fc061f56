# Both targets set themselves up on a fresh machine: they create .venv with
# python3.12 and install the package with its test extras, pinned by
# requirements/ci.txt, before running.
PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo setup clean

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

clean:
	rm -rf $(VENV) demo_out
