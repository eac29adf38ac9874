"""Model loading through the Auto classes, on tiny checkpoints the tests write themselves."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpokit.run.checkpoint import save_checkpoint
from grpokit.models import (
    build_char_tokenizer,
    build_tiny_model,
    load_model_and_tokenizer,
    resolve_dtype,
)
from grpokit.rollout import SamplingParams, sample_groups


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tiny_model_round_trips_through_the_hub_loader(architecture, tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, architecture, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    save_checkpoint(model, tokenizer, tmp_path / "m")
    loaded, tok = load_model_and_tokenizer(str(tmp_path / "m"), dtype="fp32", device="cpu")
    assert loaded.config.model_type == architecture
    ids = tok("Q: 1+2\n", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    ro = sample_groups(loaded, tok, ["Q: 1+2\n"], 2, SamplingParams(max_new_tokens=4))
    assert ro.num_samples == 2


def test_tokenizer_without_pad_token_gets_eos(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    # A fresh backend with the same vocabulary and no padding: like many hub checkpoints.
    backend = Tokenizer(models.WordLevel(dict(tokenizer.get_vocab()), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    no_pad = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    assert no_pad.pad_token is None
    model.save_pretrained(tmp_path / "m")
    no_pad.save_pretrained(tmp_path / "m")
    _, tok = load_model_and_tokenizer(str(tmp_path / "m"), device="cpu")
    assert tok.pad_token == "<eos>"
    assert tok.pad_token_id == tok.eos_token_id


def test_char_tokenizer_round_trips_text():
    tok = build_char_tokenizer("0123456789+-=:QA \n")
    text = "Q: 12+3\n12+3=15\nA: 15"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok(text)["input_ids"]) == len(text)


def test_bad_device_and_dtype_are_explained():
    if not torch.cuda.is_available():
        from grpokit.models import resolve_device

        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="model.dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_local_weights_dir_is_where_vllm_can_load_the_weights_alone(tokenizer, tmp_path):
    from grpokit.models.loading import local_weights_dir

    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(tmp_path / "plain")
    assert local_weights_dir(str(tmp_path / "plain")) == str(tmp_path / "plain")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    assert local_weights_dir(str(tmp_path / "adapter")) is None  # base + adapter: not these files alone
    model.save_pretrained(tmp_path / "extra")
    (tmp_path / "extra" / "value_head.safetensors").write_bytes(b"")
    assert local_weights_dir(str(tmp_path / "extra")) is None  # vLLM would read the other file too
    assert local_weights_dir("grpokit-tests/no-such-model") is None  # not cached: the engine saves a copy
