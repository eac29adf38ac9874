"""The batch dataclasses that flow between stages. N = prompts x G, groups contiguous."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    """G completions for each of a batch of prompts, sampled from pi_old.

    input_ids:       [N, P + T] left-padded prompt, then the completion (right-padded)
    attention_mask:  [N, P + T] 1 on real prompt and completion tokens
    completion_mask: [N, T] 1 on completion tokens up to and including the first EOS
    truncated:       [N] True where the completion hit max_new_tokens without an EOS
    prompt_length:   P, the padded prompt width; completions start at column P
    sampled_mask:    [N, T] 1 on tokens the policy sampled (0 on injected tool output); None = completion_mask
    sampling_logp:   [N, T] each sampled token's log-prob under the engine that sampled it, or None
    """

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    prompt_length: int
    group_size: int
    rows: list[dict] = field(default_factory=list)  # dataset row of each sample, repeated G times
    sampled_mask: torch.Tensor | None = None
    sampling_logp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        if n % self.group_size:
            raise ValueError(f"rollout has {n} rows, not divisible by group_size={self.group_size}")
        if self.completion_mask.shape != (n, self.input_ids.shape[1] - self.prompt_length):
            raise ValueError(
                f"completion_mask {tuple(self.completion_mask.shape)} does not match input_ids "
                f"{tuple(self.input_ids.shape)} with prompt_length {self.prompt_length}"
            )

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        """[N, T] sampled completion tokens (padding after EOS)."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens, EOS included."""
        return self.completion_mask.sum(dim=1)

    def to(self, device: torch.device | str) -> "Rollout":
        """The same rollout with every tensor on `device` (the policy's): moved once, explicitly."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})
