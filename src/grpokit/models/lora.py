"""LoRA through PEFT: the policy trains low-rank adapters, and its reference is the same base
model with the adapters switched off (`PeftModel.disable_adapter()`), so no second copy of the
weights exists.

A LoRA checkpoint holds the adapter in PEFT's format (adapter_model.safetensors +
adapter_config.json, loadable with PeftModel.from_pretrained over the base model) and, on
request (model.lora.save_merged), the merged model W + (alpha / r) B A in merged/, which
from_pretrained loads alone. A separate engine (vLLM) receives the merged weights, computed on the
weights' device one layer at a time (lora_merged_weights), never merged into the frozen base in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from grpokit.errors import ConfigError

if TYPE_CHECKING:
    from grpokit.config import LoraConfig

ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"


def parameter_counts(model: torch.nn.Module) -> str:
    """How many parameters the model has and how many train: with LoRA only the adapters do, so the
    total alone would overstate what an optimizer step updates."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == total:
        return f"{total / 1e6:.2f}M parameters, all trainable"
    share = f"{100 * trainable / total:.2f}%" if total else "0%"
    frozen_by = " (LoRA adapters; the base is frozen)" if is_lora(model) else ""
    return f"{trainable / 1e6:.2f}M trainable of {total / 1e6:.2f}M parameters ({share}){frozen_by}"


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name})


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped with fresh LoRA adapters on config.target_modules (B = 0: the policy starts
    exactly at the base model). A target that names no linear layer is an error listing them."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = list(config.target_modules)
    if targets != [ALL_LINEAR]:
        names = linear_module_names(model)
        unmatched = [t for t in targets if t not in names]
        if unmatched:
            raise ConfigError(
                f"model.lora.target_modules {unmatched} match no linear module of this "
                f"{getattr(model.config, 'model_type', type(model).__name__)} model; its linear modules are: "
                f"{', '.join(names)} (or use ['{ALL_LINEAR}'])")
    peft_config = PeftLoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                 target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
                                 task_type="CAUSAL_LM")
    return get_peft_model(model, peft_config)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` as a plain causal LM: LoRA adapters merged into its weights, so it saves whole
    (config.json and every weight, not an adapter over a base that is not saved) and loads like any
    checkpoint. A model without adapters is copied as it is."""
    import copy

    duplicate = copy.deepcopy(model)
    return duplicate.merge_and_unload() if is_lora(duplicate) else duplicate


def load_lora(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """`model` (the base) with the trainable adapter saved in `adapter_dir`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)


class AdapterDisabledReference:
    """pi_ref for a LoRA policy: the policy itself, run with its adapters disabled. Not a module:
    it owns no weights; `active()` yields the model to run as the reference."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    @contextmanager
    def active(self):
        with self.policy.disable_adapter():
            yield self.policy


@contextmanager
def as_module(ref):
    """The module that computes `ref`'s log-probs: a plain (frozen) model as it is, or a LoRA
    policy with its adapters disabled for the duration."""
    if isinstance(ref, AdapterDisabledReference):
        with ref.active() as model:
            yield model
    else:
        yield ref


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's weights from a PEFT model's full state dict: each adapted weight becomes
    W + (alpha / r) B A, and names lose PEFT's prefixes (as the base model names them)."""
    config = model.peft_config[ADAPTER_NAME]
    scale = config.lora_alpha / (config.r ** 0.5 if getattr(config, "use_rslora", False) else config.r)
    prefix = "base_model.model."
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(prefix).replace(".base_layer.", ".")
        stem = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        a, b = (state.get(f"{stem}.lora_{x}.{ADAPTER_NAME}.weight") for x in ("A", "B")) if stem else (None, None)
        if a is not None and b is not None and key.endswith(".base_layer.weight"):
            value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype)
        merged[name] = value
    return merged


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT model's base weights (the adapters left out) under the plain model's names."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in model.get_base_model().state_dict().items()
            if ".lora_" not in name}


def lora_merged_weights(model: torch.nn.Module) -> dict:
    """A PEFT model's weights under the base model's names, each adapted layer's weight as a
    zero-argument function computing W + delta (PEFT's get_delta_weight, on W's device) when
    called; the adapters' own tensors left out."""
    from peft.tuners.lora import LoraLayer

    merged: dict = base_state_dict(model)
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            merged[f"{name}.weight"] = _merged_weight_fn(module)
    return merged


def _merged_weight_fn(module):
    def merged() -> torch.Tensor:
        # in float32, as merged_state_dict: the engine rounds once, to its own dtype
        adapters = [name for name in module.active_adapters if name in module.lora_A]
        base = module.get_base_layer().weight
        if isinstance(base, DTensor):  # FSDP2 shards: gather W, A and B whole on their device, then merge
            return _full(base) + sum(_sharded_delta(module, name) for name in adapters)
        return base.float() + sum(module.get_delta_weight(name).float() for name in adapters)
    # what it makes, known without making it (a sharded layer's merge is a collective)
    merged.shape, merged.dtype = module.get_base_layer().weight.shape, torch.float32
    return merged


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).float()


def _sharded_delta(module, name: str) -> torch.Tensor:
    """PEFT's get_delta_weight (scaling * B A, transposed for fan_in_fan_out layers) from the
    gathered A and B of a sharded layer."""
    delta = _full(module.lora_B[name].weight) @ _full(module.lora_A[name].weight)
    return (delta.T if module.fan_in_fan_out else delta) * module.scaling[name]


def policy_weights(model: torch.nn.Module) -> Mapping[str, object]:
    """What an engine holding the plain model receives from `model`: its state dict, or for a PEFT
    (LoRA) model the merged weights (lora_merged_weights: each adapted layer's W + delta made on
    demand). A sharded model's values are its DTensor shards, gathered when pushed. (Moved here from
    rollout/vllm.py, which rollout workers would otherwise import to send a policy.)"""
    return lora_merged_weights(model) if hasattr(model, "peft_config") else model.state_dict()
