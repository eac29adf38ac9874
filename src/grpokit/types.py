"""The batch dataclasses that flow between stages. N = prompts x G, groups contiguous."""

from __future__ import annotations

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

    def select(self, index: torch.Tensor) -> "Rollout":
        """Rows `index` as a new rollout (used for minibatches; groups need not stay whole)."""
        idx = index.tolist()
        return Rollout(
            prompts=[self.prompts[i] for i in idx],
            completions=[self.completions[i] for i in idx],
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            completion_mask=self.completion_mask[index],
            truncated=self.truncated[index],
            prompt_length=self.prompt_length,
            group_size=1,
            rows=[self.rows[i] for i in idx] if self.rows else [],
        )
