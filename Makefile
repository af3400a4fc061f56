# Both targets set themselves up on a fresh machine: they create .venv with
# python3.12 and install the package with its test extras, pinned by
# requirements/ci.txt, before running.
PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-jax-next demo setup clean compile-h200 compile-h200-jax-next

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/ci.txt -e '.[test]'
	touch $(STAMP)

# The fast tests run on TEST_WORKERS processes (pytest-xdist; a serial run leaves a core
# of a 2-core machine idle most of the time; worksteal: a worker that runs out takes
# tests queued for the other, so the run does not end on one worker's long tail), then
# the ones marked `timing` alone: they assert on measured times, which a test running
# beside them would skew.
TEST_WORKERS ?= 2
FAST_TESTS = -m pytest -q -m "not slow and not timing" -n $(TEST_WORKERS) --dist worksteal
FAST_TIMING_TESTS = -m pytest -q -m "timing and not slow"

test: $(STAMP)
	$(PY) $(FAST_TESTS)
	$(PY) $(FAST_TIMING_TESTS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(PY) -m stellarax.tools.demo --output demo_out

# The fast tests again on the newest jax (requirements/jax-next.txt), in a virtual
# environment of its own: the project is pinned to the GPU machine's jax, and a new
# release must not break it unnoticed.
NEXT_VENV := .venv-jax-next
NEXT_STAMP := $(NEXT_VENV)/.installed

$(NEXT_STAMP): pyproject.toml requirements/jax-next.txt
	test -x $(NEXT_VENV)/bin/python || $(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEXT_VENV)/bin/python -m pip install --quiet -c requirements/jax-next.txt -e '.[test]'
	touch $(NEXT_STAMP)

test-jax-next: $(NEXT_STAMP)
	$(NEXT_VENV)/bin/python -c "import jax; print('jax', jax.__version__)"
	$(NEXT_VENV)/bin/python $(FAST_TESTS)
	$(NEXT_VENV)/bin/python $(FAST_TIMING_TESTS)

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

# The same compile with the newest jax's Mosaic GPU, Triton and XLA (a kernel that
# compiles on the pinned jax can fail layout inference on the next one). Its spills at a
# speed target are printed, not failed on: the targets hold on the GPU machine's jax.
H200_NEXT_VENV := .venv-h200-jax-next
H200_NEXT_STAMP := $(H200_NEXT_VENV)/.installed

$(H200_NEXT_STAMP): pyproject.toml requirements/jax-next.txt requirements/h200-compile-jax-next.txt
	test -x $(H200_NEXT_VENV)/bin/python || $(PYTHON) -m venv $(H200_NEXT_VENV)
	$(H200_NEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(H200_NEXT_VENV)/bin/python -m pip install --quiet -c requirements/jax-next.txt -e . -r requirements/h200-compile-jax-next.txt
	touch $(H200_NEXT_STAMP)

compile-h200-jax-next: $(H200_NEXT_STAMP)
	$(H200_NEXT_VENV)/bin/python bench/compile_h200.py --out results/compile-h200-jax-next --spills-advisory

clean:
	rm -rf $(VENV) $(H200_VENV) $(NEXT_VENV) $(H200_NEXT_VENV) demo_out
