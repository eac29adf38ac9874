"""Load a causal LM and its tokenizer from a local path or a hub id."""

from __future__ import annotations

import os

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


class ModelNotFound(ValueError):
    """model.name_or_path is neither a local model directory nor a hub id that loads here."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} but no CUDA device is visible; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model_and_tokenizer(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    master_dtype: str = "same",
):
    """(model, tokenizer) through AutoModelForCausalLM / AutoTokenizer.

    `dtype` is the compute dtype; `master_dtype` the dtype the weights are held in: "fp32" for a
    model that trains (models/precision.py; a checkpoint's fp32 master/ weights are read when
    present, so training continues from exactly where it stopped), "same" for one that only runs
    (evaluation, a frozen reference).

    A tokenizer without a pad token reuses its EOS token for padding; padding is always
    masked out, so this never changes what the model learns.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.checkpoint import master_weights_dir
    from grpokit.models.precision import resolve_precision, set_compute_dtype

    dev = resolve_device(device)
    precision = resolve_precision(dtype, master_dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # transformers' "Repo id must use alphanumeric chars", offline misses
        if os.path.isdir(name_or_path):
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
    model = AutoModelForCausalLM.from_pretrained(str(master or name_or_path), **kwargs).to(dev)
    set_compute_dtype(model, precision.compute)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
