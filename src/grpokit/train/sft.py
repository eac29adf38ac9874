"""Supervised fine-tuning: next-token loss on the completion only, producing pi_SFT.

Each step's examples are packed into as few rows as hold its longest example: several short
examples share a row, each with its own positions and attending only to itself (transformers
builds that block-diagonal mask from position_ids that restart at 0). The loss is the mean over
the same completion tokens as in right-padded rows, so what is learned is the same, to float
rounding, while the padding a step computes shrinks (about 45% of a padded batch in the demo).

Under torchrun each process takes its own share of every batch (sft.batch_size stays the
global batch) and divides its summed token loss by the batch's token count over all
processes, so the summed gradients (FSDP2) are those of the whole batch in one process.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from grpokit import distributed
from grpokit.config import SFTConfig
from grpokit.models.precision import compute_autocast
from grpokit.train.schedule import make_optimizer, warmup_cosine

IGNORE = -100  # label of prompt and padding tokens: no loss there


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
    labels = torch.full((len(batch), width), IGNORE)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, prompt_len) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class TokenizedExamples:
    """All examples as flat tensors, so a step slices instead of converting Python lists."""

    ids: torch.Tensor  # [total tokens], every example's ids end to end
    labels: torch.Tensor  # [total tokens], -100 on prompt tokens
    starts: list[int]
    lengths: list[int]
    prompt_lengths: list[int]

    @classmethod
    def of(cls, data: list[tuple[list[int], int]]) -> TokenizedExamples:
        lengths = [len(seq) for seq, _ in data]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        ids = torch.tensor([t for seq, _ in data for t in seq])
        labels = torch.tensor([IGNORE if i < prompt_len else t for seq, prompt_len in data for i, t in enumerate(seq)])
        return cls(ids, labels, starts, lengths, [prompt_len for _, prompt_len in data])

    def __len__(self) -> int:
        return len(self.lengths)


def pack_rows(lengths: list[int]) -> list[list[int]]:
    """First-fit decreasing: example indices grouped into rows no longer than the longest one.

    Rows come in order of their first (longest) example; within a row, longest first. The
    result depends only on the lengths, so a batch always packs the same way."""
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def packed_batch(examples: TokenizedExamples, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, labels and position_ids [rows, width] of examples[indices], packed.

    Positions restart at 0 for each example, and for the padding that fills a row's end,
    so every example is its own sequence; no attention_mask, so transformers derives the
    block-diagonal causal mask from the positions. The first token of every example is a
    prompt token (label -100), so no loss term predicts across an example boundary."""
    lengths = [examples.lengths[i] for i in indices]
    rows = pack_rows(lengths)
    width = max(lengths)
    ids, labels, positions = [], [], []
    for row in rows:
        row_ids, row_labels, row_positions = [], [], []
        for j in row:
            start, n = examples.starts[indices[j]], lengths[j]
            row_ids.append(examples.ids[start : start + n])
            row_labels.append(examples.labels[start : start + n])
            row_positions.append(torch.arange(n))
        free = width - sum(lengths[j] for j in row)
        if free:
            row_ids.append(torch.full((free,), pad_id))
            row_labels.append(torch.full((free,), IGNORE))
            row_positions.append(torch.arange(free))
        ids.append(torch.cat(row_ids))
        labels.append(torch.cat(row_labels))
        positions.append(torch.cat(row_positions))
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels), "position_ids": torch.stack(positions)}


def padded_batch(examples: TokenizedExamples, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """The same examples right-padded one per row, as `collate` lays them out."""
    return collate([(examples.ids[examples.starts[i] : examples.starts[i] + examples.lengths[i]].tolist(),
                     examples.prompt_lengths[i]) for i in indices], pad_id)


@torch.no_grad()
def packing_matches_padding(model, examples: TokenizedExamples, indices: list[int], pad_id: int,
                            tolerance: float = 1e-4) -> bool:
    """Whether `model` gives packed examples the logits it gives them one per row.

    A model whose attention ignores packed position_ids would let examples see each other;
    this catches that on a real batch before training relies on it. Only full-precision
    models can be checked this tightly; lower precisions report False (pad them instead)."""
    if next(model.parameters()).dtype not in (torch.float32, torch.float64):
        return False
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout, so both forwards compute the same function
    try:
        padded = padded_batch(examples, indices, pad_id)
        packed = packed_batch(examples, indices, pad_id)
        lengths = [examples.lengths[i] for i in indices]
        padded_logits = model(input_ids=padded["input_ids"].to(device),
                              attention_mask=padded["attention_mask"].to(device), use_cache=False).logits
        packed_logits = model(input_ids=packed["input_ids"].to(device),
                              position_ids=packed["position_ids"].to(device), use_cache=False).logits
        for r, row in enumerate(pack_rows(lengths)):
            offset = 0
            for j in row:
                n = lengths[j]
                if not torch.allclose(packed_logits[r, offset : offset + n], padded_logits[j, :n],
                                      rtol=tolerance, atol=tolerance):
                    return False
                offset += n
        return True
    finally:
        model.train(was_training)


def sft_train(model, tokenizer, examples: list[tuple[str, str]], config: SFTConfig, seed: int = 0,
              progress: bool = True) -> list[float]:
    """Train `model` in place on (prompt, completion) pairs; returns the loss of every step."""
    world, rank = distributed.world_size(), distributed.rank()
    if config.batch_size % world:
        raise ValueError(f"sft.batch_size={config.batch_size} does not split over {world} processes (the world "
                         f"size): make it a multiple of {world}")
    local = config.batch_size // world
    data = TokenizedExamples.of(tokenize_examples(tokenizer, examples))
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
    scheduler = warmup_cosine(optimizer, config.warmup_steps, config.max_steps)
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    pack = None  # decided on the first batch
    model.train()
    bar = tqdm(range(config.max_steps), desc="sft", disable=not progress or not distributed.is_main(),
               dynamic_ncols=True)
    for _ in bar:
        if len(order) < config.batch_size:
            order += rng.sample(range(len(data)), len(data))  # epochs of shuffled examples
        mine = order[: config.batch_size][rank * local : (rank + 1) * local]  # the same draw everywhere
        del order[: config.batch_size]
        if pack is None:
            pack = distributed.all_agree(packing_matches_padding(model, data, mine, tokenizer.pad_token_id))
            if not pack and next(model.parameters()).dtype in (torch.float32, torch.float64):
                print("grpokit: this model's attention does not keep packed examples apart; "
                      "SFT pads one example per row instead (slower, same result)", file=sys.stderr)
        batch = (packed_batch if pack else padded_batch)(data, mine, tokenizer.pad_token_id)
        inputs = {k: v.to(device) for k, v in batch.items()}
        if world > 1:  # sum of this process's token losses / the whole batch's token count
            count = distributed.all_reduce_sum((batch["labels"][:, 1:] != IGNORE).sum())
            inputs["num_items_in_batch"] = count.to(device)
        with compute_autocast(model):
            out = model(**inputs, use_cache=False)
        loss = distributed.all_reduce_sum(out.loss.detach())  # the whole batch's mean token loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {len(losses)}; lower sft.learning_rate")
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses
