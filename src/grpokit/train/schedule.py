"""Optimizer and learning-rate schedule shared by the training loops."""

from __future__ import annotations

import math

import torch

from grpokit.models.sharding import reshard


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    # A sharded model's optimizer must hold its shards: a forward without backward (evaluation,
    # generation) leaves the FSDP2 root's parameters swapped for unsharded copies, which no
    # update would then reach.
    reshard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.99))


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, final_fraction: float = 0.1):
    """Linear warm-up, then cosine decay to `final_fraction` of the peak rate."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_constant(optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
