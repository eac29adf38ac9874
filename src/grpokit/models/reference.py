"""The frozen reference pi_ref: a copy of the policy that is never updated."""

from __future__ import annotations

import copy

import torch

from grpokit.models.precision import as_frozen
from grpokit.models.wrapping import is_sharded


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` in eval mode, without gradients, held in its compute dtype."""
    if is_sharded(model):
        raise ValueError("a sharded (FSDP2) policy cannot be copied into a reference: make the frozen copy "
                         "before sharding and pass it as ref_model, sharded the same way")
    ref = as_frozen(copy.deepcopy(model)).eval()  # held in the compute dtype: it is never updated
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
