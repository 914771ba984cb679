# paged_kv: `make demo` runs the demo, `make test` runs the test suite.
# Both create .venv with a Python >= 3.12 found on this machine (tools/find_python.sh).
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
EXTRAS  := all
# Parallel test workers (pytest-xdist); CI machines have 2 cores.
WORKERS ?= 2

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { PYBIN=$$(tools/find_python.sh) && $$PYBIN -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/serve.py

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) tests

clean:
	rm -rf $(VENV) build *.egg-info
