"""The batch dataclasses that flow between stages. N = prompts x G, groups contiguous."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    failed:          [N] True where the rollout itself failed (a tool raised in the harness): the sample
                     gets no reward and stays out of the loss; None = none failed
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
    failed: torch.Tensor | None = None

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
    def policy_mask(self) -> torch.Tensor:
        """[N, T] the completion tokens the policy sampled: completion_mask * sampled_mask, or
        completion_mask when sampled_mask is None. The one mask every loss term, KL, entropy,
        importance weight and length normalisation reads; tool output (sampled_mask 0) is
        context only (docs/algorithm.md, "Tool output in the loss")."""
        if self.sampled_mask is None:
            return self.completion_mask
        return self.completion_mask * self.sampled_mask.to(self.completion_mask.dtype)

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens, EOS included."""
        return self.completion_mask.sum(dim=1)

    def to(self, device: torch.device | str) -> "Rollout":
        """The same rollout with every tensor on `device` (the policy's): moved once, explicitly."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def take(self, rows: torch.Tensor) -> "Rollout":
        """The rollout's `rows` (whole groups, so group_size stays)."""
        idx = rows.tolist()
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v[rows.to(v.device)] if isinstance(v, torch.Tensor)
                                            else [v[i] for i in idx] for k, v in fields.items()
                                            if isinstance(v, torch.Tensor) or (isinstance(v, list) and v)})

    @staticmethod
    def cat(parts: list["Rollout"], pad_id: int) -> "Rollout":
        """One rollout of `parts`' rows: prompts re-left-padded, completions re-right-padded."""
        p, t = max(r.prompt_length for r in parts), max(r.completion_ids.shape[1] for r in parts)

        def widen(x: torch.Tensor | None, prompt_width: int, value) -> torch.Tensor | None:
            if x is None:
                return None
            prompt, completion = x[:, :prompt_width], x[:, prompt_width:]
            return torch.cat([F.pad(prompt, (p - prompt.shape[1], 0), value=value),
                              F.pad(completion, (0, t - completion.shape[1]), value=value)], dim=1)

        def completion_part(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else F.pad(x, (0, t - x.shape[1]))

        return Rollout(
            prompts=[x for r in parts for x in r.prompts], completions=[x for r in parts for x in r.completions],
            input_ids=torch.cat([widen(r.input_ids, r.prompt_length, pad_id) for r in parts]),
            attention_mask=torch.cat([widen(r.attention_mask, r.prompt_length, 0) for r in parts]),
            completion_mask=torch.cat([completion_part(r.completion_mask) for r in parts]),
            truncated=torch.cat([r.truncated for r in parts]), prompt_length=p, group_size=parts[0].group_size,
            rows=[x for r in parts for x in r.rows],
            sampled_mask=None if any(r.sampled_mask is None for r in parts) else
            torch.cat([completion_part(r.sampled_mask) for r in parts]),
            sampling_logp=None if any(r.sampling_logp is None for r in parts) else
            torch.cat([completion_part(r.sampling_logp) for r in parts]),
            failed=None if all(r.failed is None for r in parts) else
            torch.cat([torch.zeros(r.num_samples, dtype=torch.bool) if r.failed is None else r.failed.cpu()
                       for r in parts]))
