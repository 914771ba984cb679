# paged_kv: `make demo` runs the demo, `make test` runs the test suite but its long
# tier, `make test-long` the long tier (CI runs both: every test once; a test's tier is
# a mark on the test, `pytest.mark.long` or `slow`), `make test-fast` all but the slow runs
# (the edit-test loop),
# `make compile-tier` compiles the GPU programs for Hopper without a GPU (CI runs it
# after the suite; tests_compile/, its own .venv-cuda: tools/compile_tier/setup.sh).
# demo and test create .venv with a Python >= 3.12 found on this machine (tools/find_python.sh)
# and install the package editable with the extras the tests and examples need; the
# `train` extra (optax, for examples/train_tiny.py) is not among them: `EXTRAS=all`.
VENV    := .venv
PY      := $(VENV)/bin/python
# model: flax; scripts: absl-py, tqdm; test: chex, pytest, xdist, hypothesis;
# metrics: prometheus-client; plots: matplotlib (serve.py and the studies draw PNGs);
# hf: safetensors, tokenizers (Hugging Face checkpoints); server: fastapi, uvicorn, jinja2
# (the OpenAI-compatible server, tested with the openai client of the test extra).
EXTRAS  ?= model,scripts,test,metrics,plots,hf,server
comma   := ,
STAMP   := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
# Parallel test workers (pytest-xdist); CI machines have 2 cores.
WORKERS ?= 2
# Flags for examples/serve.py. The demo uses JAX's persistent compilation cache
# (~/.cache/paged_kv/jax, or $PAGED_KV_COMPILE_CACHE), so a rerun skips the XLA compiles;
# `make demo ARGS=--nocompile_cache` turns it off.
ARGS    ?=
# The compile tier's venv: the CUDA PJRT plugin and compiler wheels, pinned.
CUDA_VENV  := .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.installed

.PHONY: demo test test-long test-fast venv compile-tier clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { PYBIN=$$(tools/find_python.sh) && $$PYBIN -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/serve.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) -m "not long" tests

# The long tier: larger repeats of behaviours `make test` checks, and multi-process runs.
test-long: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) -m long tests

# The edit-test loop: everything but the tests marked `slow` (and `long`, which is slow too).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) -m "not slow" tests

$(CUDA_STAMP): tools/compile_tier/requirements.txt tools/compile_tier/setup.sh pyproject.toml
	tools/compile_tier/setup.sh

compile-tier: $(CUDA_STAMP)
	$(CUDA_VENV)/bin/python -m pytest -q tests_compile

clean:
	rm -rf $(VENV) $(CUDA_VENV) build *.egg-info
