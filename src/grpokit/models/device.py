"""Where a model's weights live."""

from __future__ import annotations

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter: where its inputs go."""
    return next(model.parameters()).device
