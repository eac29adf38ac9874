"""Shared fixtures: a real tiny transformers model and a real char tokenizer, built here."""

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.rollout import Continuation
from grpokit.types import Rollout


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer(arithmetic.ALPHABET)


@pytest.fixture
def tiny_model(tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


class ScriptedEngine:
    """A RolloutEngine that continues each context with reply(context), or, given a dict, with the
    first reply whose key the context ends with; it records the SamplingParams it was given."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.params = tokenizer, []
        self.reply = reply if callable(reply) else (lambda p: next(r for key, r in reply.items() if p.endswith(key)))

    def generate(self, prompts, num_generations, params, rows=None, seeds=None) -> Rollout:
        self.params.append(params)
        texts = [self.reply(p) for p in prompts]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] or [self.tokenizer.eos_token_id]
               for t in texts]
        width = max(map(len, ids))
        completion = torch.tensor([i + [self.tokenizer.pad_token_id] * (width - len(i)) for i in ids])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
        return Rollout(prompts=list(prompts), completions=texts, input_ids=completion, attention_mask=mask,
                       completion_mask=mask, truncated=torch.zeros(len(prompts), dtype=torch.bool), prompt_length=0,
                       group_size=1)

    def continue_ids(self, contexts, budgets, params, seeds=None) -> list[Continuation]:
        """Multi-turn rollouts: the reply to each decoded context, tokenised, cut at its budget;
        "stop" when it ends with one of params.stop, else "eos"."""
        self.params.append(params)
        out = []
        for ids, budget in zip(contexts, budgets, strict=True):
            reply = self.reply(self.tokenizer.decode(ids, skip_special_tokens=True))
            reply_ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            if len(reply_ids) > budget:
                out.append(Continuation(reply_ids[:budget], "length"))
            else:
                out.append(Continuation(reply_ids, "stop" if reply.endswith(tuple(params.stop or ())) else "eos"))
        return out

    def sync_weights(self, model):
        pass


@pytest.fixture(scope="session")
def scripted_engine():
    """The ScriptedEngine class: scripted_engine(tokenizer, reply) builds one."""
    return ScriptedEngine


@pytest.fixture(scope="session")
def chain_rows():
    task = arithmetic.ChainSpec()
    return arithmetic.make_rows(arithmetic.sample_questions(64, 0, task, "train"))


@pytest.fixture(scope="session")
def seed0_demo(tmp_path_factory):
    """The full-size `grpokit demo --seed 0`, run once per session. The slow tests check its
    targets, and the PPO and reward-model demos start RL from its pi_SFT (variants compared on
    one pi_SFT, as the benchmarks do) instead of each training the same pi_SFT again."""
    out = tmp_path_factory.mktemp("demo-seed0")
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--output-dir", str(out), "--seed", "0",
                           "--quiet"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def vllm_demo(tmp_path_factory):
    """`grpokit demo --rollout.engine=vllm --seed 0`, run once per session (about 10 minutes on two
    CPU cores): its summary checks the demo's target, and the LoRA and torchrun vLLM runs start RL
    from its pi_SFT."""
    out = tmp_path_factory.mktemp("vllm-demo-seed0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--rollout.engine=vllm", "--seed", "0",
                           "--quiet", "--output-dir", str(out)], capture_output=True, text=True, timeout=3600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
