# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The first Python here of the versions given (pyenv's included, whose bare `python3.12` shims
# refuse to run), else python3.
find_python = $(shell for v in $(1); do for p in python$$v $$(pyenv root 2>/dev/null)/versions/$$v.*/bin/python$$v; do if "$$p" -c "" 2>/dev/null; then echo "$$p"; exit 0; fi; done; done; echo python3)
# The newest Python that the newest jax supports (jax 0.11+ need 3.12+).
ifndef PYTHON
PYTHON := $(call find_python,3.13 3.12)
endif
VENV ?= .venv
# Extra requirements for this venv's install, e.g. PINS="jax==0.10.2" (the oldest stack job).
PINS ?=
# autoaccum's extras installed (the oldest stack job leaves out tunix: its pages are skipped).
EXTRAS ?= keras,dryrun,tpu,dev,tunix
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export KERAS_BACKEND ?= jax
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: demo test test-fast test-mesh test-bare bench docs clean

$(STAMP): pyproject.toml
	@if [ -x $(PY) ] && [ "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" != \
	  "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  echo "$(VENV) runs another Python than $(PYTHON): making it again"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" $(PINS)
	@$(PY) -c "import sys, jax, keras; print(f'$(VENV): Python {sys.version.split()[0]}, jax {jax.__version__}, keras {keras.__version__}')"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autoaccum_demo

test: $(STAMP)
	$(PY) -m ruff check autoaccum autoaccum_demo tests benchmarks
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10

test-fast: $(STAMP)
	$(PY) -m ruff check autoaccum autoaccum_demo tests benchmarks
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" --durations=10

# Models sharded as JAX and Flax teach them (jax.set_mesh, with mesh:, Explicit axes), on 8
# host devices: slow, so not in test-fast; CI runs it on the oldest stack too.
test-mesh: $(STAMP)
	$(PY) -m pytest -q tests/adapters/flax/test_mesh_guides.py

# A bare GPU box as it is lent (tests/install/bare-box.txt: Python 3.12, jax 0.11.2 and its
# CUDA 13 plugin, flax, optax, numpy, rich, pytest; no keras, tqdm or nvidia-ml-py), with
# autoaccum run from the checkout, not installed.
BARE := .venv-bare
$(BARE)/.installed: tests/install/bare-box.txt
	test -x $(BARE)/bin/python || $(call find_python,3.12) -m venv $(BARE)
	$(BARE)/bin/python -m pip install --quiet -r tests/install/bare-box.txt
	touch $@

test-bare: $(BARE)/.installed
	PYTHONPATH=. $(BARE)/bin/python -m pytest -q -p no:cacheprovider tests/install/test_bare_box.py tests/benchmarks/test_gpu_validation.py

# The docs site (mkdocs.yml, docs/), built strictly: a broken link, anchor or docstring fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

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
	$(PY) benchmarks/loop_saving.py
	$(PY) benchmarks/kernel_cache.py

clean:
	rm -rf $(VENV) $(BARE) .venv-oldest build *.egg-info
