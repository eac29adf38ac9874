"""Convert a GGUF checkpoint (llama.cpp's one-file format) into a plain Hugging Face folder.

transformers reads a GGUF file only through `from_pretrained(dir, gguf_file=...)`, dequantizing it
on every load (seconds, and it needs the `gguf` package), and its `save_pretrained` refuses the
quantized model. The converted folder (safetensors, config, tokenizer with its chat template,
generation config) loads like any other model, in under a second, without `gguf`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_SUFFIX = ".gguf"
CONVERT_COMMAND = "grpokit convert-gguf"
# The converted folder holds the same fp32 numbers the GGUF dequantizes to, so its logits match
# exactly; the tolerance only leaves room for a different matmul order between the two loads.
LOGITS_TOLERANCE = 1e-4
# A fixed prompt for the check, through the chat template when there is one.
CHECK_MESSAGES = [{"role": "user", "content": "What is 3 + 2? Reason step by step."}]
CHECK_TEXT = "The sum of 3 and 2 is"


class GgufConversionError(ValueError):
    """A GGUF source that cannot be converted; the message names the file and the fix."""


@dataclass(frozen=True)
class Conversion:
    """What a conversion wrote and how closely the folder reproduces the GGUF's logits."""

    gguf_file: Path
    dest: Path
    parameters: int
    max_abs_logit_diff: float
    tolerance: float
    prompt_tokens: int


def gguf_files(path: str | Path) -> list[Path]:
    """The .gguf files a path names: the file itself, or those directly in a directory."""
    path = Path(path)
    if path.is_file():
        return [path] if path.suffix == GGUF_SUFFIX else []
    return sorted(path.glob(f"*{GGUF_SUFFIX}")) if path.is_dir() else []


def is_gguf_only_dir(path: str | Path) -> bool:
    """A directory that holds a .gguf file but no config.json: not loadable as a plain HF model."""
    path = Path(path)
    return path.is_dir() and not (path / "config.json").is_file() and bool(gguf_files(path))


def convert_command(src: str | Path, dest: str | Path = "DEST_DIR") -> str:
    """The command line that converts `src` into `dest`."""
    return f"{CONVERT_COMMAND} {src} {dest}"


def _single_gguf(src: str | Path) -> Path:
    files = gguf_files(src)
    if not files:
        raise GgufConversionError(f"{src}: no {GGUF_SUFFIX} file there; pass a .gguf file or a directory holding one")
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GgufConversionError(f"{src} holds several {GGUF_SUFFIX} files ({names}); pass the one to convert")
    return files[0]


def _load_gguf(gguf_file: Path):
    """(model in fp32, tokenizer) of a GGUF file, through transformers' GGUF reader."""
    try:
        import gguf  # noqa: F401  (transformers' reader needs it; say so before it fails deep inside)
    except ImportError:
        raise GgufConversionError(f"{gguf_file}: reading GGUF needs the gguf package: pip install 'grpokit[models]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # a damaged or unsupported file: transformers raises many kinds
        raise GgufConversionError(f"{gguf_file} does not load as a GGUF checkpoint ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}); check the file (a download "
                                  "may have been cut short) or that transformers supports its architecture") from None
    return model.eval(), tokenizer


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in a fresh model of the same class whose config has no quantization_config,
    which save_pretrained accepts."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    plain = type(model)(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # lm_head is missing from the state dict only when it is tied to the embeddings
    if unexpected or any(key != "lm_head.weight" for key in missing):
        raise GgufConversionError(f"the GGUF's weights do not fit a fresh {type(model).__name__} "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def _check_ids(tokenizer) -> torch.Tensor:
    """The fixed check prompt's ids: through the chat template when the tokenizer has one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
        return tokenizer(text + CHECK_TEXT, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(CHECK_TEXT, return_tensors="pt").input_ids


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def _set_generation_ids(model: torch.nn.Module, tokenizer) -> None:
    """generation_config's eos and pad: the tokenizer's EOS (for ChatML, <|im_end|>) for both when unset,
    so generation stops at the end of the assistant's turn."""
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def _tidy_tokenizer_config(path: Path, config) -> None:
    """Drop the load-time keys save_pretrained writes (where the GGUF was read from) and bound
    model_max_length by the model's context instead of transformers' "no limit" sentinel."""
    settings = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        settings.pop(key, None)
    context = getattr(config, "max_position_embeddings", None)
    if context:
        settings["model_max_length"] = context
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(src: str | Path, dest: str | Path, tolerance: float = LOGITS_TOLERANCE) -> Conversion:
    """Write the GGUF checkpoint `src` (a .gguf file, or a directory holding one) to `dest` as a plain
    Hugging Face folder, then reload `dest` and check that its logits on a fixed prompt equal the
    GGUF's within `tolerance` (fp32). A mismatch removes nothing but raises GgufConversionError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = _single_gguf(src)
    dest = Path(dest)
    if dest.is_dir() and any(dest.iterdir()):  # stale weight shards there would load beside the new ones
        raise GgufConversionError(f"{dest} already holds files; pass a new or empty directory as the destination")
    model, tokenizer = _load_gguf(gguf_file)
    ids = _check_ids(tokenizer)
    expected = _logits(model, ids)
    plain = _plain_copy(model)
    del model
    _set_generation_ids(plain, tokenizer)
    dest.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _tidy_tokenizer_config(dest / "tokenizer_config.json", plain.config)
    parameters = sum(p.numel() for p in plain.parameters())
    del plain
    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    if not torch.equal(_check_ids(AutoTokenizer.from_pretrained(dest)), ids):
        raise GgufConversionError(f"{dest}: the saved tokenizer encodes the check prompt differently from "
                                  f"{gguf_file.name}'s; the conversion is wrong, delete {dest} and report it")
    diff = (_logits(reloaded, ids) - expected).abs().max().item()
    if not diff <= tolerance:
        raise GgufConversionError(f"{dest}: the converted model's logits differ from {gguf_file.name}'s by {diff:.3g} "
                                  f"(tolerance {tolerance:g}); the conversion is wrong, delete {dest} and report it")
    return Conversion(gguf_file, dest, parameters, diff, tolerance, ids.shape[1])
