"""The run config is the one source of the sampling distribution: a checkpoint's generation_config.json
changes nothing sampled (said once at start), sampling options the log-probs cannot follow are refused
before any model loads, and embedding rows past the tokenizer are never drawn. The conformance suite
(tests/test_conformance.py) checks the same on real checkpoints; these run on the tiny model in `make test`."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.config.schema import RolloutConfig
from grpokit.models import build_tiny_model
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.models.model_files import DamagedModelFile
from grpokit.models.tiny import build_char_tokenizer
from grpokit.models.vocabulary import GHOST_LOGIT, VocabularyMismatch, mask_ghost_rows
from grpokit.rollout import sampler
from grpokit.rollout.engine import make_engine
from grpokit.rollout.sampler import SamplingParams, checkpoint_sampling_defaults

# What Qwen2.5-Instruct's generation_config.json sets, with harsher cut-offs a checkpoint may also ship.
CHECKPOINT_DEFAULTS = dict(do_sample=True, temperature=0.25, top_p=0.5, top_k=1, min_p=0.3, repetition_penalty=1.8,
                           no_repeat_ngram_size=1, suppress_tokens=[5, 6, 7])


@pytest.fixture
def flat_model():
    """Near-equal logits over the 99-token ASCII vocabulary: honest draws of 400 tokens hit ~98 distinct
    ids, and any cut (top_k, min_p, top_p) or penalty shows as far fewer."""
    from grpokit.pipeline.build import ASCII_ALPHABET

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 1e-3)
    model.generation_config.update(**CHECKPOINT_DEFAULTS)
    return model, tokenizer


@pytest.mark.parametrize("engine", ["hf", "hf_static"])
def test_a_checkpoints_generation_config_changes_nothing_sampled(flat_model, engine, capsys):
    model, tokenizer = flat_model
    before = model.generation_config
    torch.manual_seed(0)
    rollout = make_engine(RolloutConfig(engine=engine), model, tokenizer).generate(
        ["Q"], 400, SamplingParams(max_new_tokens=2, temperature=1.0, top_p=1.0))
    first = rollout.completion_ids[:, 0]
    assert len(set(first.tolist())) > 80  # top_k=1, min_p and top_p would leave one or a few
    assert set(first.tolist()) & {5, 6, 7}  # suppress_tokens ignored too
    # no_repeat_ngram_size=1 would forbid a second token equal to the first
    assert bool((rollout.completion_ids[:, 1] == first).any())
    assert model.generation_config is before and model.generation_config.top_k == 1  # restored as it was
    err = capsys.readouterr().err
    assert err.count("its generation_config sets") <= 1
    if engine == "hf_static":  # the reported log-probs are those of the full distribution at T = 1
        with torch.no_grad():
            logits = model(input_ids=rollout.input_ids[:, : rollout.prompt_length]).logits[:, -1].float()
        expected = (logits - torch.logsumexp(logits, -1, keepdim=True)).gather(1, first.unsqueeze(1)).squeeze(1)
        assert torch.allclose(rollout.sampling_logp[:, 0], expected, atol=1e-5)


def test_the_ignored_defaults_are_named_once_in_one_line(flat_model, capsys):
    model, tokenizer = flat_model
    sampler._noted_defaults.clear()
    assert checkpoint_sampling_defaults(model) == {
        "do_sample": True, "min_p": 0.3, "no_repeat_ngram_size": 1, "repetition_penalty": 1.8,
        "suppress_tokens": [5, 6, 7], "temperature": 0.25, "top_k": 1, "top_p": 0.5}
    for _ in range(2):
        make_engine(RolloutConfig(engine="hf"), model, tokenizer)
    lines = [line for line in capsys.readouterr().err.splitlines() if "generation_config" in line]
    assert len(lines) == 1
    assert "min_p=0.3" in lines[0] and "top_k=1" in lines[0] and "rollouts ignore them" in lines[0]


def test_a_plain_checkpoint_says_nothing(tokenizer, tiny_model, capsys):
    sampler._noted_defaults.clear()
    assert checkpoint_sampling_defaults(tiny_model) == {}
    make_engine(RolloutConfig(engine="hf"), tiny_model, tokenizer)
    assert "generation_config" not in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["--grpo.top_p=0.9"], r"^grpo.top_p=0.9 samples from the nucleus, while the loss's pi_old log-probs cover the "
                           r"whole vocabulary .*set grpo.top_p=1, or correct for it with rollout.engine=hf_static"),
    (["--grpo.top_p=0.9", "--rollout.engine=hf_static"], r"^grpo.top_p=0.9 samples from the nucleus"),
    (["--grpo.num_generations=8", "--grpo.generation_batch_size=4"],
     r"^grpo.generation_batch_size=4 cannot hold one group of grpo.num_generations=8 completions: raise it to at "
     r"least 8"),
])
def test_sampling_the_log_probs_cannot_follow_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_top_p_with_a_correction_over_the_samplers_log_probs_is_accepted():
    config = load_config(overrides=["--grpo.top_p=0.9", "--rollout.engine=hf_static", "--rollout.is_correction=tis"])
    assert config.grpo.top_p == 0.9


def test_rows_past_the_tokenizer_score_ghost_logit_in_generate_and_in_the_head(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    model.resize_token_embeddings(len(tokenizer) + 7)
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer):] = 5.0  # unmasked they would dominate
    assert mask_ghost_rows(model, tokenizer) == 7
    assert mask_ghost_rows(model, tokenizer) == 7  # a second call adds no second hook
    ids = torch.tensor([[3, 4, 5]])
    logits = model(input_ids=ids).logits
    assert torch.all(logits[..., len(tokenizer):] == GHOST_LOGIT)
    assert torch.all(logits[..., : len(tokenizer)].abs() < 1e3)
    torch.manual_seed(0)
    rollout = make_engine(RolloutConfig(engine="hf"), model, tokenizer).generate(
        ["7+"], 64, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert int(rollout.completion_ids.max()) < len(tokenizer)


def test_a_tokenizer_longer_than_the_embedding_is_one_line_naming_both_sizes(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    model.resize_token_embeddings(len(tokenizer) - 3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(DamagedModelFile, match=rf"{tmp_path}: its tokenizer has {len(tokenizer)} tokens but its "
                                               rf"embedding only {len(tokenizer) - 3} rows"):
        load_model_and_tokenizer(str(tmp_path), dtype="fp32", device="cpu")


def test_softcapped_logits_with_padded_rows_are_refused(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    model.resize_token_embeddings(len(tokenizer) + 2)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(VocabularyMismatch, match="softcaps its logits"):
        mask_ghost_rows(model, tokenizer)


def test_generate_sees_only_the_token_ids_while_sampling(flat_model):
    model, tokenizer = flat_model
    seen = []
    original = type(model).generate

    def spy(self, *args, **kwargs):
        seen.append(self.generation_config)
        return original(self, *args, **kwargs)

    type(model).generate = spy
    try:
        sampler.sample_groups(model, tokenizer, ["Q"], 2, SamplingParams(max_new_tokens=1))
    finally:
        type(model).generate = original
    config = seen[0]
    assert isinstance(config, GenerationConfig) and config is not model.generation_config
    assert config.top_k is None and config.min_p is None and config.repetition_penalty is None
    assert config.eos_token_id == model.generation_config.eos_token_id
