"""What wraps a model: a PEFT wrapper around the transformers model, and FSDP2 around that. Read by
precision (a sharded model casts through its own policy) and sharding alike, so it is its own leaf."""

from __future__ import annotations

import torch


def fsdp_root(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward gathers the root's parameters: the model itself, or, inside a PEFT
    wrapper, the transformers model (PEFT's generate calls that model directly, not the wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if hasattr(model, "peft_config") and callable(get_base) else model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (its fsdp_root) was sharded by `shard_model`: every process must then make
    the same forward calls in the same order."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(fsdp_root(model), FSDPModule)
