"""Embedding rows past the tokenizer's vocabulary ("ghost tokens") are never sampled and count the same
in every log-prob.

Checkpoints often pad the embedding to a round number of rows: Qwen2.5 and Qwen3 hold 151,936 rows for
151,665-151,669 tokens, DeepSeekMath 102,400 for 100,015. Those rows decode to nothing, yet their logits
take part in the softmax. If the sampler may draw them and the trainer's log-probs count them, a
completion can hold an id no tokenizer can write back; if one side masks them and the other does not,
pi_old and the sampler disagree. So the LM head itself writes GHOST_LOGIT at those rows: `generate`,
the trainer's chunked log-probs (models/logprobs.py calls the head module) and evaluation all read the
same masked logits, and exp(GHOST_LOGIT - logsumexp) is exactly 0 in fp32, bf16 and fp16. vLLM computes
its own logits from its own copy of the weights: its engine writes GHOST_LOGIT at the same columns of
them (mask_logits_past, rollout/vllm.py), so its draws and reported log-probs are the trainer's too.
"""

from __future__ import annotations

import torch

# Finite (an entropy's p * log p stays 0, not NaN) and far below any real logit; fp16 holds it exactly.
GHOST_LOGIT = -1.0e4
_HOOK_FLAG = "_grpokit_ghost_rows_masked"


class VocabularyMismatch(ValueError):
    """A tokenizer that writes ids the model's embedding has no row for; the message names both sizes."""


def embedding_rows(model: torch.nn.Module) -> int:
    """How many token ids the model's output layer scores (its LM head's rows)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None:
        return int(model.config.vocab_size)
    return int(getattr(weight, "shape", (model.config.vocab_size,))[0])


def ghost_rows(model: torch.nn.Module, tokenizer, where: str = "the model") -> int:
    """How many of the model's embedding rows lie past len(tokenizer) and must score GHOST_LOGIT (0: none).
    A tokenizer longer than the embedding, or padded rows under a logit softcap, is a VocabularyMismatch:
    every engine refuses them in the same one line (the vLLM engine masks in its own logits, rollout/vllm.py)."""
    rows, tokens = embedding_rows(model), len(tokenizer)
    if tokens > rows:
        raise VocabularyMismatch(f"{where}: its tokenizer has {tokens:,} tokens but its embedding only {rows:,} rows, "
                                 f"so ids {rows:,}-{tokens - 1:,} have no embedding: use the tokenizer saved with "
                                 "these weights")
    if rows > tokens and getattr(model.config, "final_logit_softcapping", None) is not None:
        # tanh(x / cap) * cap would lift GHOST_LOGIT to -cap, a probability far from 0
        raise VocabularyMismatch(f"{where}: its embedding has {rows:,} rows for {tokens:,} tokens and it softcaps its "
                                 "logits, so grpokit cannot mask the extra rows; resize the embedding to the "
                                 "tokenizer (model.resize_token_embeddings) and save it")
    return rows - tokens


def mask_ghost_rows(model: torch.nn.Module, tokenizer, where: str = "the model") -> int:
    """Make the LM head score ids at or beyond len(tokenizer) GHOST_LOGIT; returns how many rows it
    masks (0: none to mask). A tokenizer longer than the embedding is a VocabularyMismatch (ghost_rows)."""
    extra = ghost_rows(model, tokenizer, where)
    if extra == 0:
        return 0
    head = model.get_output_embeddings()
    if not getattr(head, _HOOK_FLAG, False):
        head.register_forward_hook(_masking_hook(len(tokenizer)))
        setattr(head, _HOOK_FLAG, True)
    return extra


def mask_logits_past(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """`logits` [..., rows] with every column at or past `tokens` set to GHOST_LOGIT, in place."""
    if logits.shape[-1] > tokens:
        logits[..., tokens:] = GHOST_LOGIT
    return logits


def _masking_hook(tokens: int):
    def hook(module, args, logits):
        if logits.shape[-1] <= tokens:
            return logits
        return torch.cat([logits[..., :tokens], logits.new_full((*logits.shape[:-1], logits.shape[-1] - tokens),
                                                                GHOST_LOGIT)], dim=-1)
    return hook
