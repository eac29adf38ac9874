"""Supervised fine-tuning: next-token loss on the completion only, producing pi_SFT.

Under torchrun each process takes its own share of every batch (sft.batch_size stays the
global batch) and divides its summed token loss by the batch's token count over all
processes, so the summed gradients (FSDP2) are those of the whole batch in one process."""

from __future__ import annotations

import random

import torch
from tqdm.auto import tqdm

from grpokit import distributed
from grpokit.config import SFTConfig
from grpokit.train.schedule import make_optimizer, warmup_cosine


def tokenize_examples(tokenizer, examples: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(prompt, completion) pairs -> (token ids of prompt + completion + EOS, prompt length)."""
    out = []
    for i, (prompt, completion) in enumerate(examples):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if not p or len(c) < 2:
            raise ValueError(f"SFT example {i} has an empty prompt or completion: {prompt!r} -> {completion!r}")
        out.append((p + c, len(p)))
    return out


def collate(batch: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and labels that are -100 on prompt and padding."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, prompt_len) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_train(model, tokenizer, examples: list[tuple[str, str]], config: SFTConfig, seed: int = 0,
              progress: bool = True) -> list[float]:
    """Train `model` in place on (prompt, completion) pairs; returns the loss of every step."""
    world, rank = distributed.world_size(), distributed.rank()
    if config.batch_size % world:
        raise ValueError(f"sft.batch_size={config.batch_size} does not split over {world} processes (the world "
                         f"size): make it a multiple of {world}")
    local = config.batch_size // world
    data = tokenize_examples(tokenizer, examples)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
    scheduler = warmup_cosine(optimizer, config.warmup_steps, config.max_steps)
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    model.train()
    bar = tqdm(range(config.max_steps), desc="sft", disable=not progress or not distributed.is_main(),
               dynamic_ncols=True)
    for _ in bar:
        if len(order) < config.batch_size:
            order += rng.sample(range(len(data)), len(data))  # epochs of shuffled examples
        mine = order[: config.batch_size][rank * local : (rank + 1) * local]  # the same draw everywhere
        batch = collate([data[i] for i in mine], tokenizer.pad_token_id)
        del order[: config.batch_size]
        inputs = {k: v.to(device) for k, v in batch.items()}
        if world > 1:  # sum of this process's token losses / the whole batch's token count
            count = distributed.all_reduce_sum((batch["labels"][:, 1:] != -100).sum())
            inputs["num_items_in_batch"] = count.to(device)
        out = model(**inputs)
        loss = distributed.all_reduce_sum(out.loss.detach())  # the whole batch's mean token loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {len(losses)}; lower sft.learning_rate")
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
