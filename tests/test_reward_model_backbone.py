"""reward_model.model: a new reward model's backbone from pi_SFT (the paper's), a fresh tiny model of a
chosen size, or a checkpoint with its own tokenizer; and the config errors for each."""

from __future__ import annotations

import pytest
import torch

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.pipeline.build import ASCII_ALPHABET, RunSetup, load_policy, reward_model_backbone, reward_model_stage
from grpokit.rewards.learned import ProcessRewardModel, new_reward_model
from grpokit.tasks import task_for


def _policy(overrides=()):
    config = load_config(overrides=["--model.tiny.hidden_size=32", "--model.tiny.num_layers=1",
                                    "--model.tiny.num_heads=2", "--model.tiny.intermediate_size=64", *overrides])
    policy, tokenizer = load_policy(config)
    return config, policy, tokenizer


def _backbone_params(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("score."))


def test_the_default_copies_the_policys_backbone():
    config, policy, tokenizer = _policy()
    backbone, rm_tokenizer = reward_model_backbone(config, policy, tokenizer)
    assert backbone is policy and rm_tokenizer is tokenizer
    rm = new_reward_model(backbone, rm_tokenizer, "process")
    assert torch.equal(rm.model.embed_tokens.weight, policy.model.embed_tokens.weight)


def test_a_tiny_backbone_has_the_sizes_asked_for_and_leaves_the_runs_random_stream_alone():
    config, policy, tokenizer = _policy(["--reward_model.model.init=tiny", "--reward_model.model.hidden_size=64",
                                         "--reward_model.model.num_layers=2", "--reward_model.model.num_heads=4",
                                         "--reward_model.model.intermediate_size=128"])
    state = torch.get_rng_state()
    backbone, rm_tokenizer = reward_model_backbone(config, policy, tokenizer)
    assert torch.equal(torch.get_rng_state(), state)
    assert rm_tokenizer is tokenizer
    c = backbone.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (64, 2, 4, 128)
    # Hand count, tied embeddings: embedding V*H, per block 4*H*H (attention) + 3*H*I (MLP) + 2*H (norms),
    # the final norm H.
    vocab, h, i = len(tokenizer), 64, 128
    expected = vocab * h + 2 * (4 * h * h + 3 * h * i + 2 * h) + h
    rm = new_reward_model(backbone, rm_tokenizer, "outcome")
    assert _backbone_params(rm) == expected
    assert all(float(p.detach().abs().sum()) == 0 for n, p in rm.named_parameters() if n.startswith("score."))
    # Its own weights, not the policy's, and the same ones for the same run seed.
    again, _ = reward_model_backbone(config, policy, tokenizer)
    assert torch.equal(again.model.embed_tokens.weight, backbone.model.embed_tokens.weight)
    assert backbone.model.embed_tokens.weight.shape != policy.model.embed_tokens.weight.shape


def test_a_checkpoint_backbone_keeps_its_own_tokenizer_and_scores_the_policys_steps(tmp_path, capsys):
    other = build_char_tokenizer(ASCII_ALPHABET)
    build_tiny_model(other, hidden_size=48, num_layers=1, num_heads=2, intermediate_size=96).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    config, policy, tokenizer = _policy(["--reward_model.model.init=checkpoint",
                                         f"--reward_model.model.path={tmp_path}"])
    backbone, rm_tokenizer = reward_model_backbone(config, policy, tokenizer)
    assert backbone.config.hidden_size == 48
    assert rm_tokenizer.get_vocab() == other.get_vocab() != tokenizer.get_vocab()
    assert "has its own tokenizer" in capsys.readouterr().err
    prm = ProcessRewardModel(new_reward_model(backbone, rm_tokenizer, "process"), rm_tokenizer)
    [scores] = prm.score_steps(["2+3*4=?"], ["3*4=12\n2+12=14\nanswer 14"])
    assert scores.char_ends == [7, 15, 24] and scores.rewards == [0.5, 0.5, 0.5]  # zero head: sigmoid(0)


def test_the_reward_model_stage_builds_the_backbone_the_config_names(tmp_path):
    config, policy, tokenizer = _policy(["--reward_model.kind=process", "--reward_model.model.init=tiny",
                                         "--reward_model.model.hidden_size=16", "--reward_model.model.num_heads=2"])
    stage = reward_model_stage(RunSetup(config, tmp_path, task_for(config), policy, tokenizer,
                                        [{"prompt": "1+1=?", "answer": "2"}], progress=False))
    assert stage.kind == "process" and stage.scorer.model.config.hidden_size == 16
    assert stage.scorer.model.config.hidden_size != policy.config.hidden_size


@pytest.mark.parametrize("overrides, message", [
    (["--reward_model.model.init=checkpoint"], "set reward_model.model.path"),
    (["--reward_model.model.path=some/model"], "set init to checkpoint"),
    (["--reward_model.model.init=tiny", "--reward_model.model.hidden_size=30", "--reward_model.model.num_heads=4"],
     "must be a multiple of 2 x reward_model.model.num_heads"),
    (["--reward_model.model.init=tiny", "--reward_model.model.hidden_size=30", "--reward_model.model.num_heads=2"],
     "each head's width must be even"),
    (["--reward_model.kind=process", "--reward_model.path=runs/rm/reward_model", "--reward_model.model.init=tiny"],
     "reward_model.path loads a trained reward model"),
    (["--reward_model.model.num_layers=0"], "reward_model.model.num_layers must be >= 1"),
])
def test_a_backbone_that_cannot_be_built_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


# --------------------------------------------------------------------------- a size the device cannot hold


def test_the_size_estimates_equal_the_models_own_counts(tmp_path):
    from grpokit.models.fits import checkpoint_parameters, tiny_llama_parameters

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=48, num_layers=3, num_heads=2, intermediate_size=96)
    total = sum(p.numel() for p in model.parameters())  # tied: the LM head is the embedding
    assert tiny_llama_parameters(48, 3, 96, len(tokenizer)) == total
    # without the vocabulary the count is a lower bound: the embedding's V*H less
    assert tiny_llama_parameters(48, 3, 96) == total - len(tokenizer) * 48
    model.save_pretrained(tmp_path)
    assert checkpoint_parameters(tmp_path) == total
    assert checkpoint_parameters(tmp_path / "absent") is None


def test_training_fits_or_says_how_much_it_needs(monkeypatch):
    from grpokit.models import fits

    monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 2**30)  # a 1 GiB device
    cpu = torch.device("cpu")
    assert fits.training_does_not_fit(2**26, cpu) == ""  # 64Mi parameters x 16 B = exactly 1 GiB
    why = fits.training_does_not_fit(2**26 + 1, cpu)
    assert "needs at least 1.0 GiB" in why and "cpu's 1.0 GiB" in why


def test_a_reward_model_too_large_for_its_device_stops_the_demo_before_sft(tmp_path, monkeypatch, capsys):
    from grpokit.cli import main
    from grpokit.models import fits

    monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 2**30)
    # 8 blocks of hidden 1024, MLP 4096: 8 x (4 x 1024^2 + 3 x 1024 x 4096 + 2048) + 1024 = 134,235,136
    # parameters, 2.0 GiB to train at 16 B each: more than the 1 GiB device
    code = main(["demo", "--supervision", "process", "--reward_model.model.init=tiny",
                 "--reward_model.model.hidden_size=1024", "--reward_model.model.num_layers=8",
                 "--reward_model.model.intermediate_size=4096", "--output-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "reward_model.model (init=tiny, hidden_size=1024" in err and "about 134.2M parameters" in err
    assert "set reward_model.device" in err
    assert not (tmp_path / "run").exists()  # refused before SFT made the run directory
