# Fresh machine: `make demo` or `make test` builds .venv, installs, and runs.
# GPU users: create .venv with your own CUDA torch first (see README); it is kept.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test test-slow test-all clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# Keep a torch that is already there (e.g. a CUDA build); otherwise take the CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grpokit demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
