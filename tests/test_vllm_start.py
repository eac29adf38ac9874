"""A vLLM engine built from a policy held in memory (no weights_dir): it starts from placeholder
weights and the policy's own are pushed before the constructor returns, so nothing is re-saved.

Its own module: the engine built here is closed here, and closing one vLLM engine tears down
vLLM's process-wide model-parallel state, which test_vllm_engine.py's module-scoped engine needs.
"""

import copy
import importlib.util

import pytest

from grpokit.rollout import SamplingParams, sample_groups
from test_vllm_engine import PROMPTS, _assert_same_rollout, _policy

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`)"),
]


@pytest.fixture(scope="module")
def policy(tokenizer):
    return _policy(tokenizer)


def test_an_in_memory_policy_reaches_the_engine_without_a_saved_copy(policy, tokenizer):
    """No weights_dir: vLLM starts from placeholder weights and the policy's own are pushed before the
    engine is returned, so its first rollouts are the policy's and no weights file is written."""
    import os

    from grpokit.rollout.vllm import VLLMEngine

    engine = VLLMEngine(copy.deepcopy(policy), tokenizer, max_model_len=128, kv_cache_gb=0.0625, seed=0)
    try:
        written = os.listdir(engine._checkpoint_dir.name)
        assert "config.json" in written and not [f for f in written if f.endswith((".safetensors", ".bin"))]
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        _assert_same_rollout(sample_groups(policy, tokenizer, PROMPTS, 1, params), engine.generate(PROMPTS, 1, params))
        assert engine.check_synced(policy) <= 2e-3
    finally:
        engine.close()
