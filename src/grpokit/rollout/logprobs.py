"""Per-token log-probs of given tokens under a causal LM, micro-batched.

Only the completion columns are turned into log-softmax, one micro-batch at a time,
so peak memory is micro_batch x T x vocab rather than N x (P + T) x vocab.
"""

from __future__ import annotations

import torch


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, matching what `generate` uses while sampling."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    temperature: float = 1.0,
    micro_batch_size: int = 32,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of input_ids[:, prompt_length:] given everything before them.

    input_ids, attention_mask: [N, P + T]. Returns (logp [N, T], entropy [N, T] or None).
    Logits are divided by `temperature`, so logp is the log-prob under the distribution
    the rollout sampled from. Gradients flow when called outside torch.no_grad().
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    if not 0 < prompt_length < input_ids.shape[1]:
        raise ValueError(f"prompt_length={prompt_length} must lie in (0, {input_ids.shape[1]})")
    device = next(model.parameters()).device
    logps, entropies = [], []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        ids = input_ids[start : start + micro_batch_size].to(device)
        mask = attention_mask[start : start + micro_batch_size].to(device)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False)
        # Logit at column c predicts token c + 1: completion tokens are predicted by P-1 .. L-2.
        logits = out.logits[:, prompt_length - 1 : -1].float() / temperature
        targets = ids[:, prompt_length:]
        log_norm = torch.logsumexp(logits, dim=-1)
        logps.append(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1)
                entropies.append(log_norm - (probs * logits).sum(-1))
    logp = torch.cat(logps)
    return logp, (torch.cat(entropies) if with_entropy else None)
