"""Mixed precision (models/precision.py): bf16 compute over fp32 master weights, on CPU.

A bf16 run must move its weights as an fp32 run does: small updates land in the fp32 master copy
instead of rounding away in bf16. Frozen models are bf16; checkpoints hold bf16 weights that
transformers loads and the fp32 master weights a resume continues from."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpokit.pipeline.build import load_policy
from grpokit.run.checkpoint import save_checkpoint
from grpokit.checks import load_config
from grpokit.config import ConfigError, GRPOConfig
from grpokit.data import arithmetic
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.models.precision import (Precision, compute_autocast, compute_dtype, resolve_precision,
                                      set_compute_dtype)
from grpokit.models.sharding import mixed_precision_policy
from grpokit.rewards import WeightedReward
from grpokit.models.logprobs import token_logprobs
from grpokit.train.grpo import GRPOTrainer
from grpokit.models.reference import frozen_copy

CPU = torch.device("cpu")
TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--model.device=cpu"]


def policy(*overrides):
    return load_policy(load_config(None, [*TINY, *overrides]))


def test_the_policy_names_compute_and_master_dtypes():
    assert resolve_precision("bf16", "fp32", CPU) == Precision(torch.bfloat16, torch.float32)
    assert resolve_precision("bf16", "same", CPU) == Precision(torch.bfloat16, torch.bfloat16)
    assert resolve_precision("auto", "fp32", CPU) == Precision(torch.float32, torch.float32)  # CPU: fp32
    assert not resolve_precision("fp32", "fp32", CPU).mixed
    assert resolve_precision("bf16", "fp32", CPU).describe() == \
        "bf16 compute, fp32 master weights and optimizer state"
    with pytest.raises(ConfigError, match="model.master_dtype"):
        resolve_precision("bf16", "fp64", CPU)
    with pytest.raises(ConfigError, match="model.master_dtype"):
        load_config(None, ["--model.master_dtype=fp64"])


def test_a_trained_policy_holds_fp32_weights_and_computes_in_bf16():
    model, tokenizer = policy("--model.dtype=bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert compute_dtype(model) == torch.bfloat16
    ids = torch.tensor([tokenizer("Q: 1+2\n")["input_ids"]])
    with compute_autocast(model):
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16  # the matrix products ran in bf16
    # the same numbers as a bf16 copy of the weights, up to bf16 rounding of the activations
    bf16 = AutoModelForCausalLM.from_config(model.config).to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits.float(), bf16(input_ids=ids).logits.float(), atol=0.1, rtol=0.05)
    # log-probs come back in fp32 all the same
    full = torch.cat([ids, ids], 1)
    logp, _ = token_logprobs(model, full, torch.ones_like(full), ids.shape[1])
    assert logp.dtype == torch.float32


def test_same_holds_the_weights_in_the_compute_dtype_and_fp32_is_plain():
    same, _ = policy("--model.dtype=bf16", "--model.master_dtype=same")
    assert {p.dtype for p in same.parameters()} == {torch.bfloat16}
    plain, _ = policy("--model.dtype=fp32")
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    assert isinstance(compute_autocast(plain), type(compute_autocast(same)))  # both no-ops: nothing to cast
    assert not isinstance(compute_autocast(plain), torch.autocast)


def test_a_frozen_reference_holds_bf16_linear_layers_and_computes_what_the_policy_does():
    model, tokenizer = policy("--model.dtype=bf16")
    ref = frozen_copy(model)
    tied = ref.get_input_embeddings().weight
    assert ref.get_output_embeddings().weight is tied  # this model ties its head: that weight stays fp32
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.weight.dtype == (torch.float32 if module.weight is tied else torch.bfloat16), name
    linear = sum(m.weight.numel() for m in ref.modules() if isinstance(m, torch.nn.Linear))
    assert linear > 0.5 * sum(p.numel() for p in ref.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy is untouched
    assert not any(p.requires_grad for p in ref.parameters())
    # the same log-probs as the policy it was copied from: the first step's KL is exactly 0
    ids = torch.tensor([tokenizer("Q: 1+2-3+4\n12-3+4 / 9+4 / A: 13")["input_ids"]])
    args = (ids, torch.ones_like(ids), 8)
    assert torch.equal(token_logprobs(ref, *args)[0], token_logprobs(model, *args)[0])


def grpo_movement(dtype: str, master: str, steps: int = 3, lr: float = 2e-6) -> float:
    """Mean |dw| of `steps` GRPO steps at `lr`, against the start held the same way as the weights."""
    model, tokenizer = policy(f"--model.dtype={dtype}", f"--model.master_dtype={master}")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = arithmetic.make_rows([f"{a}+{b}-{c}" for a, b, c in zip(range(1, 17), range(3, 19), range(2, 18))])
    config = GRPOConfig(num_generations=4, prompts_per_step=4, max_completion_length=12, max_steps=steps,
                        learning_rate=lr, warmup_steps=0, beta=0.04)
    length = WeightedReward("length", lambda prompts, completions, **_: [len(c) / 10 for c in completions])
    trainer = GRPOTrainer(model, tokenizer, [length], rows, config, "/nonexistent-unused", seed=0, progress=False)
    for _ in range(steps):
        trainer.step()
    deltas = [(model.state_dict()[k].double() - w.double()).abs() for k, w in start.items()]
    return float(sum(d.sum() for d in deltas) / sum(d.numel() for d in deltas))


def test_bf16_compute_moves_the_weights_as_fp32_does():
    """lr 2e-6 is far below bf16's spacing near a weight (2^-8 relative): bf16 weights with no master
    copy barely move, the fp32 master weights move as an fp32 run's do (Adam: about lr per step)."""
    fp32 = grpo_movement("fp32", "fp32")
    bf16 = grpo_movement("bf16", "fp32")
    same = grpo_movement("bf16", "same")
    assert fp32 > 1e-6  # three Adam steps of about lr each, on most weights
    assert bf16 == pytest.approx(fp32, rel=0.10)
    assert same < 0.1 * fp32


def test_checkpoints_hold_bf16_weights_and_fp32_master_weights(tmp_path):
    model, tokenizer = policy("--model.dtype=bf16")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-5)  # below bf16's resolution: only the master copy keeps it
    path = save_checkpoint(model, tokenizer, tmp_path / "step-1")
    top, master = load_file(path / "model.safetensors"), load_file(path / "master" / "model.safetensors")
    assert {t.dtype for t in top.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    # what another tool loads: the bf16 weights, in the dtype the config names
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    # a run that trains on continues from the exact fp32 master weights
    again, _ = load_model_and_tokenizer(str(path), "bf16", "cpu", master_dtype="fp32")
    for name, w in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], w), name
    # so does an fp32 run (fp32 compute) given this checkpoint: not the bf16-rounded weights
    fp32, _ = load_model_and_tokenizer(str(path), "fp32", "cpu", master_dtype="fp32")
    assert all(torch.equal(fp32.state_dict()[name], w) for name, w in model.state_dict().items())
    # one that only runs it takes the bf16 weights
    frozen, _ = load_model_and_tokenizer(str(path), "bf16", "cpu")
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}


def test_an_fp32_run_writes_no_master_copy(tmp_path):
    model, tokenizer = policy("--model.dtype=fp32")
    path = save_checkpoint(model, tokenizer, tmp_path / "step-1")
    assert not (path / "master").exists()
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.float32}


def test_fsdp2_gathers_in_the_compute_dtype_and_refuses_fp16():
    model, _ = policy("--model.dtype=bf16")
    mp = mixed_precision_policy(model)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain, _ = policy("--model.dtype=fp32")
    assert mixed_precision_policy(plain).param_dtype is None
    set_compute_dtype(plain, torch.float16)
    with pytest.raises(ConfigError, match="model.dtype=fp16 cannot train under FSDP2.*model.dtype=bf16"):
        mixed_precision_policy(plain)


def test_bf16_on_a_cpu_without_native_bf16_says_once_it_is_slow_and_names_fp32(monkeypatch, capsys):
    from grpokit.models import precision

    monkeypatch.setattr(precision, "_said_bf16_is_slow", False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    for _ in range(2):
        assert precision.resolve_precision("bf16", "fp32", torch.device("cpu")).compute == torch.bfloat16
    lines = [line for line in capsys.readouterr().err.splitlines() if "native bf16" in line]
    assert len(lines) == 1 and "model.dtype=fp32" in lines[0], lines
    precision.resolve_precision("fp32", "fp32", torch.device("cpu"))  # fp32 says nothing
    monkeypatch.setattr(precision, "_said_bf16_is_slow", False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    precision.resolve_precision("bf16", "fp32", torch.device("cpu"))
    assert "native bf16" not in capsys.readouterr().err


def test_cpu_has_native_bf16_reads_the_processor():
    from grpokit.models.precision import cpu_has_native_bf16

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if not flags:
        pytest.skip("no /proc/cpuinfo to compare with")
    assert cpu_has_native_bf16() == any(f" {flag}" in flags for flag in ("amx_tile", "avx512_bf16"))
