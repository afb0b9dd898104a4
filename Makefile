# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export KERAS_BACKEND ?= jax
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[keras,dryrun,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autoaccum_demo

test: $(STAMP)
	$(PY) -m ruff check autoaccum autoaccum_demo tests benchmarks
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10

test-fast: $(STAMP)
	$(PY) -m ruff check autoaccum autoaccum_demo tests benchmarks
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" --durations=10

bench: $(STAMP)
	$(PY) benchmarks/accumulation.py
	$(PY) benchmarks/planning.py
	$(PY) benchmarks/keras_accumulation.py
	$(PY) benchmarks/backoff.py
	$(PY) benchmarks/remat.py
	$(PY) benchmarks/objective.py
	$(PY) benchmarks/dryrun.py
	$(PY) benchmarks/flax_cnn.py
	$(PY) benchmarks/uneven.py
	$(PY) benchmarks/keras_train_step.py
	$(PY) benchmarks/cpu_compile_flags.py
	$(PY) benchmarks/cpu_conv_in_loop.py
	$(PY) benchmarks/kept_steps.py
	$(PY) benchmarks/kernel_cache.py

clean:
	rm -rf $(VENV) build *.egg-info
