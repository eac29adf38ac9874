"""Load a causal LM and its tokenizer from a local path or a hub id."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from grpokit.errors import ConfigError
from grpokit.models import checkpoint_dirs
from grpokit.models.checkpoint_dirs import master_weights_dir
from grpokit.models.end_of_turn import use_end_of_turn_eos
from grpokit.models.gguf import convert_command, gguf_files, is_gguf_only_dir
from grpokit.models.model_files import (  # ModelNotFound, DamagedModelFile: raised here, caught by the CLI
    DamagedModelFile,
    ModelNotFound,
    check_loading_info,
    check_model_files,
    describe_load_failure,
)
from grpokit.models.precision import resolve_precision, set_compute_dtype
from grpokit.models.vocabulary import VocabularyMismatch, mask_ghost_rows


class DeviceUnavailable(ConfigError):
    """A configured device this machine does not have."""


def resolve_device(device: str, key: str = "model.device") -> torch.device:
    """`device` as a torch.device (auto: CUDA when there is one, else the CPU). A device this machine
    lacks is a DeviceUnavailable naming the config `key` and what to use instead."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceUnavailable(f"{key}={device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    missing = _missing_device(dev)
    if missing:
        raise DeviceUnavailable(f"{key}={device!r} but {missing}")
    return dev


def _missing_device(dev: torch.device) -> str:
    """Why this machine cannot run on `dev`, and the fix; empty when it can."""
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return "no CUDA device is visible (torch.cuda.is_available() is False): use cpu or auto"
        if dev.index is not None and dev.index >= count:
            return f"only {count} CUDA device(s) are visible: use one of cuda:0 to cuda:{count - 1}, cuda or auto"
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return "MPS (Apple's GPU backend) is not available on this machine: use cpu or auto"
    return ""


def check_model_config(config) -> None:
    """The devices a config names exist on this machine, and model.name_or_path is no directory that
    cannot load: checked before the run starts or any model loads."""
    resolve_device(config.model.device, "model.device")
    if config.reward_model.kind != "none":
        resolve_device(config.reward_model.device, "reward_model.device")
    check_model_directory(config.model.name_or_path)


ADAPTER_CONFIG = "adapter_config.json"
# How to make a LoRA adapter loadable when its base model is not at hand.
ADAPTER_FIX = ("train with model.lora.save_merged=true to get a merged/ model, or set adapter_config.json's "
               "base_model_name_or_path to the model the adapter was trained on")


def is_lora_adapter(path: str | Path) -> bool:
    """A PEFT adapter directory (adapter_config.json) that is not also a full model (no config.json)."""
    return (Path(path) / ADAPTER_CONFIG).is_file() and not (Path(path) / "config.json").is_file()


def check_model_directory(name_or_path: str) -> None:
    """A local directory that holds no model (no config.json) is refused with what it is instead: a
    grpokit run directory (its checkpoints are models) or some other directory. A LoRA adapter
    directory passes: load_model_and_tokenizer loads it with its base."""
    path = Path(name_or_path)
    if name_or_path and (is_gguf_only_dir(path) or gguf_files(path)):
        raise ModelNotFound(_gguf_refusal(name_or_path))
    if not name_or_path or not path.is_dir() or (path / "config.json").is_file() or is_lora_adapter(path):
        return  # empty: the built-in tiny model
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        raise ModelNotFound(f"model.name_or_path {name_or_path!r} is a grpokit run directory, not a model: "
                            f"{_checkpoints_hint(path)}")
    raise ModelNotFound(f"model.name_or_path {name_or_path!r} is a directory without config.json, so not a "
                        "Hugging Face model: point it at a model directory (config.json + weights) or a hub id")


def _gguf_refusal(name_or_path: str) -> str:
    """Why a GGUF file or folder is not loaded, and the command that converts it once."""
    source = Path(name_or_path)
    dest = (source.parent / source.stem if source.is_file() else source.with_name(source.name + "-hf"))
    return (f"model.name_or_path {name_or_path!r} is a GGUF checkpoint ({gguf_files(source)[0].name}), which grpokit "
            f"does not load directly (transformers dequantizes it on every load): convert it once with "
            f"`{convert_command(name_or_path, dest)}` and pass --model.name_or_path={dest}")


def _checkpoints_hint(run_dir: Path) -> str:
    """Which of a run directory's checkpoints to pass instead (by name only: nothing is verified here)."""
    checkpoints = run_dir / "checkpoints"
    latest = checkpoint_dirs.pointed(checkpoints) or next(iter(checkpoint_dirs.step_dirs(checkpoints)), None)
    choices = [f"{latest} (the latest)"] if latest else []
    if (checkpoints / "sft" / "config.json").is_file():
        choices.append(f"{checkpoints / 'sft'} (its pi_SFT)")
    if not choices:
        return f"it holds no checkpoint yet ({checkpoints} is empty or missing); pass a model directory or a hub id"
    return f"pass one of its checkpoints, e.g. --model.name_or_path={' or '.join(choices)}"


def _load_adapter(adapter_dir: str, load) -> tuple:
    """(model, tokenizer) of a LoRA adapter directory: its merged/ model when the run saved one, else
    its base model (adapter_config.json's base_model_name_or_path) with the adapter merged in. `load`
    loads a plain model directory or hub id."""
    path = Path(adapter_dir)
    if (path / "merged" / "config.json").is_file():
        print(f"grpokit: {adapter_dir} is a LoRA adapter; loading its merged model {path / 'merged'}", file=sys.stderr)
        return load(str(path / "merged"))
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelNotFound(f"{adapter_dir} is a LoRA adapter whose adapter_config.json names no base model: "
                            f"{ADAPTER_FIX}")
    try:
        model, tokenizer = load(base)
    except ModelNotFound:
        raise ModelNotFound(f"{adapter_dir} is a LoRA adapter on the base model {base!r} (adapter_config.json's "
                            "base_model_name_or_path), which does not load from here (a relative path counts from "
                            f"the working directory): {ADAPTER_FIX}") from None
    print(f"grpokit: {adapter_dir} is a LoRA adapter; loading its base model {base} with the adapter merged in",
          file=sys.stderr)
    return _merge_adapter(model, adapter_dir), tokenizer


def _merge_adapter(model: torch.nn.Module, adapter_dir: str) -> torch.nn.Module:
    """`model` with the LoRA adapter of `adapter_dir` merged into its weights (W + (alpha / r) B A)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelNotFound(f"{adapter_dir} is a LoRA adapter, which needs peft to load: pip install "
                            "'grpokit[peft]'") from None
    model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.requires_grad_(True)  # PEFT froze the base; a loaded model trains like any other


def load_model_and_tokenizer(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    master_dtype: str = "same",
    eos_token: str = "",
    chat_template: str = "auto",
):
    """(model, tokenizer) through AutoModelForCausalLM / AutoTokenizer.

    `dtype` is the compute dtype; `master_dtype` the dtype the weights are held in: "fp32" for a
    model that trains (models/precision.py; a checkpoint's fp32 master/ weights are read when
    present, so training continues from exactly where it stopped), "same" for one that only runs
    (evaluation, a frozen reference).

    A tokenizer without a pad token reuses its EOS token for padding; padding is always
    masked out, so this never changes what the model learns. EOS is `eos_token` (model.eos_token)
    when set, else the chat template's end-of-turn token when prompts use it (`chat_template`,
    data.chat_template, is not "off"): models/end_of_turn.py.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    check_model_directory(name_or_path)
    if is_lora_adapter(name_or_path):
        return _load_adapter(name_or_path, lambda path: load_model_and_tokenizer(
            path, dtype, device, attn_implementation, trust_remote_code, master_dtype, eos_token, chat_template))
    precision = resolve_precision(dtype, master_dtype, dev)
    local = os.path.isdir(name_or_path)
    if local:
        check_model_files(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers' "Repo id must use alphanumeric chars", offline misses, bad files
        if local:
            raise describe_load_failure(name_or_path, "tokenizer", err) from None
        if not isinstance(err, (OSError, ValueError)):
            raise
        raise ModelNotFound(f"model {name_or_path!r} is neither a local directory nor a hub id reachable "
                            f"{'offline' if os.environ.get('HF_HUB_OFFLINE') else 'from here'} "
                            f"({type(err).__name__}); check model.name_or_path") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": precision.master, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    # fp32 weights come from a checkpoint's fp32 master/ where it has one (its model.safetensors is bf16)
    master = master_weights_dir(name_or_path) if precision.master == torch.float32 else None
    weights_dir = str(master or name_or_path)
    if master:
        check_model_files(master)
    model = _load_weights(AutoModelForCausalLM, weights_dir, local, kwargs).to(dev)
    set_compute_dtype(model, precision.compute)
    use_end_of_turn_eos(model, tokenizer, name_or_path, eos_token, chat_template)
    try:
        mask_ghost_rows(model, tokenizer, name_or_path)  # embedding rows past the tokenizer are never sampled
    except VocabularyMismatch as err:
        raise DamagedModelFile(str(err)) from None
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _load_weights(auto_class, weights_dir: str, local: bool, kwargs: dict):
    """from_pretrained, refusing a local checkpoint whose weights miss some of the model's or have
    other shapes (transformers would initialise those at random); its load report stays quiet,
    the refusal names the file instead."""
    if not local:
        return auto_class.from_pretrained(weights_dir, **kwargs)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto_class.from_pretrained(weights_dir, ignore_mismatched_sizes=True, output_loading_info=True,
                                                 **kwargs)
    except (OSError, ValueError, RuntimeError) as err:
        raise describe_load_failure(weights_dir, "weights", err) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    check_loading_info(weights_dir, info)
    return model


def local_weights_dir(name_or_path: str) -> str | None:
    """The local directory whose *.safetensors hold `name_or_path`'s weights as from_pretrained reads
    them: the directory itself, or a hub id's cached snapshot; None for a LoRA adapter directory (its
    weights are the base's plus the adapter's), .bin-only weights, other safetensors beside the
    model's (vLLM would read them too), or a hub id not in the cache."""
    path = Path(name_or_path)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception:  # not a hub id, or not cached: the engine saves the weights itself
            return None
    files = [file.name for file in path.glob("*.safetensors")]
    if is_lora_adapter(path) or not files or not all(name.startswith("model") for name in files):
        return None
    return str(path)
