"""G samples per prompt from pi_old: batched, left-padded prompts, EOS stop, truncation flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from grpokit.types import Rollout


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. temperature=0 means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 256  # completions per `generate` call; bounds memory, not results


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model's generation_config names none; set one")
    return ids


def completion_mask_and_truncation(
    completion_ids: torch.Tensor, eos_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] completion tokens -> (mask [N, T] through the first EOS, truncated [N])."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    t = completion_ids.shape[1]
    first_eos = torch.where(has_eos, is_eos.long().argmax(dim=1), torch.full_like(has_eos, t, dtype=torch.long))
    positions = torch.arange(t, device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~has_eos


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    num_generations: int,
    params: SamplingParams,
    rows: list[dict] | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each prompt.

    Returns a Rollout of N = len(prompts) x G rows; the G completions of prompt p are
    rows p*G .. p*G+G-1. Prompts are left-padded so all completions start at one column.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if not prompts:
        raise ValueError("sample_groups got no prompts")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = saved_side
    prompt_ids = enc["input_ids"].repeat_interleave(num_generations, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(num_generations, dim=0)
    eos_ids = _eos_ids(model, tokenizer)
    greedy = params.temperature == 0
    gen_config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else params.temperature,
        top_p=None if greedy else params.top_p,
        top_k=None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    chunks = []
    for start in range(0, prompt_ids.shape[0], params.batch_size):
        ids = prompt_ids[start : start + params.batch_size].to(device)
        mask = prompt_mask[start : start + params.batch_size].to(device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        chunks.append(out[:, ids.shape[1] :].cpu())
    width = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat(
        [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=tokenizer.pad_token_id) for c in chunks]
    )
    if was_training:
        model.train()
    completion_mask, truncated = completion_mask_and_truncation(completion_ids, eos_ids)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(
        [ids[m.bool()] for ids, m in zip(completion_ids, completion_mask)], skip_special_tokens=True
    )
    repeated_rows = [r for r in rows for _ in range(num_generations)] if rows else []
    return Rollout(
        prompts=[p for p in prompts for _ in range(num_generations)],
        completions=texts,
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        truncated=truncated,
        prompt_length=prompt_ids.shape[1],
        group_size=num_generations,
        rows=repeated_rows,
    )
