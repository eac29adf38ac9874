"""Supervised fine-tuning: next-token loss on the completion only, producing pi_SFT.

Each step's examples are packed into as few rows as hold its longest example: several short
examples share a row, each with its own positions and attending only to itself (transformers
builds that block-diagonal mask from position_ids that restart at 0). The loss is the mean over
the same completion tokens as in right-padded rows, so what is learned is the same, to float
rounding, while the padding a step computes shrinks (about 45% of a padded batch in the demo).

A step's rows go through the model in micro-batches of at most sft.max_tokens_per_micro_batch
tokens (rows x the micro-batch's widest row), each back-propagating its summed token loss over
the whole batch's token count, so gradients accumulate to the one-forward gradient. The loss
never builds [rows, L, vocab] float32 logits: only labelled positions reach the LM head, in tiles
(models/logprobs.py, labelled_logprobs).

Under torchrun each process takes its own share of every batch (sft.batch_size stays the
global batch) and divides its summed token loss by the batch's token count over all
processes, so the summed gradients (FSDP2) are those of the whole batch in one process.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

import torch

from grpokit import distributed
from grpokit.config import ConfigError, SFTConfig
from grpokit.errors import renamed_names
from grpokit.micro_batches import pack_rows, split_by_tokens
from grpokit.models.precision import compute_dtype
from grpokit.models.sharding import grad_norm_value
from grpokit.run.progress import progress as progress_bar
from grpokit.models.logprobs import attended_ends, labelled_logprobs
from grpokit.train.schedule import make_optimizer, warmup_cosine
from grpokit.models.device import model_device

IGNORE = -100  # label of prompt and padding tokens: no loss there


def tokenize_examples(tokenizer, examples: list[tuple[str, str]], tool_spans=None) -> list[tuple]:
    """(prompt, completion) pairs -> (token ids of prompt + completion + EOS, prompt length). With
    `tool_spans(completion) -> [(start, end), ...]` (a tool's output_spans), those character spans
    of a completion are the tool's output: a third element, one flag per token, is 0 on the tokens
    that start inside one, so the loss leaves them out (ToRA; the RL loss's policy mask). The ids
    are the completion's as one text either way: a token the text before a span runs into (the
    newline after "```output") stays the policy's, as in a rollout."""
    out = []
    for i, (prompt, completion) in enumerate(examples):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        spans = tool_spans(completion) if tool_spans is not None else []
        if spans:
            encoded = tokenizer(completion, add_special_tokens=False, return_offsets_mapping=True)
            c = list(encoded["input_ids"])
            trained = [int(not any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
        else:
            c, trained = tokenizer(completion, add_special_tokens=False)["input_ids"], []
        c = c + [tokenizer.eos_token_id]
        if not p or len(c) < 2:
            raise ValueError(f"SFT example {i} has an empty prompt or completion: {prompt!r} -> {completion!r}")
        out.append((p + c, len(p), [1] * len(p) + trained + [1]) if spans else (p + c, len(p)))
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
    def of(cls, data: list[tuple]) -> TokenizedExamples:
        """From (ids, prompt length) or (ids, prompt length, per-token 0/1: trained on) examples."""
        lengths = [len(item[0]) for item in data]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        ids = torch.tensor([t for item in data for t in item[0]])
        labels = torch.tensor([IGNORE if i < item[1] or (len(item) > 2 and not item[2][i]) else t
                               for item in data for i, t in enumerate(item[0])])
        return cls(ids, labels, starts, lengths, [item[1] for item in data])

    def __len__(self) -> int:
        return len(self.lengths)


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
    """The same examples right-padded one per row, as `collate` lays them out, with their labels."""
    batch = collate([(examples.ids[examples.starts[i] : examples.starts[i] + examples.lengths[i]].tolist(),
                      examples.prompt_lengths[i]) for i in indices], pad_id)
    for row, i in enumerate(indices):  # tool output is unlabelled too (tokenize_examples)
        batch["labels"][row, : examples.lengths[i]] = examples.labels[examples.starts[i] : examples.starts[i] + examples.lengths[i]]
    return batch


def row_widths(labels: torch.Tensor) -> torch.Tensor:
    """[rows] columns a row needs: through its last labelled token. Columns after it carry no loss
    and change nothing before them (attention is causal), so a micro-batch is cut to its widest row."""
    return attended_ends(labels != IGNORE)


def sft_micro_batches(batch: dict[str, torch.Tensor], max_tokens: int, lockstep: bool = False):
    """(rows, inputs, labels) of each micro-batch of `batch`'s rows, on the CPU: rows in order of width, at
    most `max_tokens` tokens (rows x the widest) each, cut to the widest; every row exactly once."""
    labels = batch["labels"]
    widths = row_widths(labels)
    for rows in split_by_tokens(widths, max_tokens, None, "sft.max_tokens_per_micro_batch", lockstep):
        width = int(widths[rows].max())
        inputs = {k: v[rows, :width] for k, v in batch.items() if k != "labels"}
        yield rows, inputs, labels[rows, :width]


def accumulate_gradients(model, batch: dict[str, torch.Tensor], max_tokens: int, lockstep: bool = False) -> torch.Tensor:
    """Backward of the batch's mean next-token loss over its labelled tokens, in micro-batches of at
    most `max_tokens` tokens: each back-propagates its summed token losses divided by the whole
    batch's token count (over all processes), so the accumulated gradient is the one-forward
    gradient whatever the budget. The head's logits exist one tile at a time (labelled_logprobs).
    Returns the batch's mean loss, detached, the same on every process."""
    device = model_device(model)
    count = distributed.all_reduce_sum((batch["labels"][:, 1:] != IGNORE).sum()).to(device)
    total = torch.zeros((), device=device)
    for _, inputs, labels in sft_micro_batches(batch, max_tokens, lockstep):
        inputs = {k: v.to(device) for k, v in inputs.items()}
        logp = labelled_logprobs(model, {**inputs, "use_cache": False}, labels.to(device), IGNORE)
        loss = -logp.sum() / count
        loss.backward()
        total += loss.detach()
    return distributed.all_reduce_sum(total)


# How far packed and padded log-probs may differ: float rounding of the same function computed
# in other shapes. bf16 keeps about 3 significant digits, so there the two layouts agree to about
# 0.01 in log-prob, which also lets through the small leaks of a barely trained model: the
# isolation check below catches those in any dtype.
PACKING_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.05}
# Changing one packed example must leave the others' log-probs as they were: their rows compute
# the same numbers in the same shapes (masked keys weigh exactly 0), so this is tight in any dtype.
ISOLATION_TOLERANCE = 1e-3


def forward_dtype(model) -> torch.dtype:
    """The dtype `model`'s matrix products round to: its compute dtype (models/precision.py) where one
    is recorded, since fp32 master weights under bf16 autocast round as bf16 does, else its weights'."""
    return compute_dtype(model) or next(model.parameters()).dtype


@torch.no_grad()
def target_logprobs(model, batch: dict[str, torch.Tensor], max_tokens: int, lockstep: bool = False) -> torch.Tensor:
    """[rows, width - 1] float32 log-prob of each labelled next token (0 elsewhere), on the CPU."""
    device = model_device(model)
    labels = batch["labels"]
    out = torch.zeros(labels.shape[0], labels.shape[1] - 1)
    for rows, inputs, micro_labels in sft_micro_batches(batch, max_tokens, lockstep):
        inputs = {k: v.to(device) for k, v in inputs.items()}
        logp = labelled_logprobs(model, {**inputs, "use_cache": False}, micro_labels.to(device), IGNORE)
        block = torch.zeros(len(rows), micro_labels.shape[1] - 1)
        block[micro_labels[:, 1:] != IGNORE] = logp.float().cpu()
        out[rows, : block.shape[1]] = block
    return out


def packing_matches_padding(model, examples: TokenizedExamples, indices: list[int], pad_id: int,
                            max_tokens: int = 16384, lockstep: bool = False) -> bool:
    """Whether `model` keeps packed examples apart, checked on a real batch before training relies on it.

    Two checks, in the dtype the model computes in: (1) packed examples get the log-probs they get
    one per row, within PACKING_TOLERANCE of that dtype (bf16 compute over fp32 master weights
    rounds as bf16 does, so rounding alone never turns packing off); (2) reversing the first example
    of every packed row leaves every other example's log-probs unchanged (ISOLATION_TOLERANCE). A model whose
    attention ignores packed position_ids lets examples see each other: (2) catches that even
    where the leak is smaller than bf16's rounding in (1)."""
    tolerance = PACKING_TOLERANCE.get(forward_dtype(model), 0.1)
    lengths = [examples.lengths[i] for i in indices]
    layout = pack_rows(lengths)
    was_training = model.training
    model.eval()  # no dropout, so every forward computes the same function
    try:
        packed_inputs = packed_batch(examples, indices, pad_id)
        padded = target_logprobs(model, padded_batch(examples, indices, pad_id), max_tokens, lockstep)
        # Two packed rows or more share each forward, as in RL's micro-batches: an attention that reads
        # packed positions only for a batch of one row (flash-attention 2 in transformers) shows here.
        max_tokens = max(max_tokens, 2 * packed_inputs["input_ids"].shape[1])
        packed = target_logprobs(model, packed_inputs, max_tokens, lockstep)
        for r, row in enumerate(layout):
            offset = 0
            for j in row:
                n = lengths[j]  # positions offset .. offset + n - 2 predict the example's tokens 1 .. n - 1
                if not torch.allclose(packed[r, offset : offset + n - 1], padded[j, : n - 1],
                                      rtol=tolerance, atol=tolerance):
                    return False
                offset += n
        shared = [r for r, row in enumerate(layout) if len(row) > 1]
        if not shared:
            return True
        altered = {k: v.clone() for k, v in packed_inputs.items()}
        for r in shared:
            n = lengths[layout[r][0]]
            altered["input_ids"][r, :n] = altered["input_ids"][r, :n].flip(0)
        changed = target_logprobs(model, altered, max_tokens, lockstep)
        return all(torch.allclose(changed[r, lengths[layout[r][0]] :], packed[r, lengths[layout[r][0]] :],
                                  rtol=0, atol=ISOLATION_TOLERANCE) for r in shared)
    finally:
        model.train(was_training)


def sft_train(model, tokenizer, examples: list[tuple[str, str]], config: SFTConfig, seed: int = 0,
              progress: bool = True, on_step=None, tool_spans=None) -> list[float]:
    """Train `model` in place on (prompt, completion) pairs; returns the loss of every step.
    `on_step(row)` gets each step's step, loss, grad_norm, lr, tokens and step_time_s. `tool_spans`:
    a tool's output_spans, whose text the loss leaves out (tokenize_examples)."""
    data = TokenizedExamples.of(tokenize_examples(tokenizer, examples, tool_spans))
    return train_on_examples(model, data, tokenizer.pad_token_id, config, seed, progress, on_step)


def train_on_examples(model, data: TokenizedExamples, pad_id: int, config: SFTConfig, seed: int = 0,
                      progress: bool = True, on_step=None) -> list[float]:
    """sft_train on tokenized examples; returns the loss of every step."""
    world, rank = distributed.world_size(), distributed.rank()
    if config.batch_size % world:
        raise ValueError(f"sft.batch_size={config.batch_size} does not split over {world} processes (the world "
                         f"size): make it a multiple of {world}")
    longest = max(data.lengths)
    if longest > config.max_tokens_per_micro_batch:
        raise ConfigError(f"sft.max_tokens_per_micro_batch={config.max_tokens_per_micro_batch} is smaller than the "
                          f"longest example, {longest} tokens: set it to at least {longest}")
    local = config.batch_size // world
    budget, lockstep = config.max_tokens_per_micro_batch, world > 1
    optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
    scheduler = warmup_cosine(optimizer, config.warmup_steps, config.max_steps)
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    pack = None  # decided on the first batch
    model.train()
    bar = progress_bar(range(config.max_steps), desc="sft", unit="step", enabled=progress and distributed.is_main())
    for _ in bar:
        if len(order) < config.batch_size:
            order += rng.sample(range(len(data)), len(data))  # epochs of shuffled examples
        mine = order[: config.batch_size][rank * local : (rank + 1) * local]  # the same draw everywhere
        del order[: config.batch_size]
        if pack is None:
            pack = distributed.all_agree(packing_matches_padding(model, data, mine, pad_id, budget, lockstep))
            if not pack:
                print("grpokit: this model's attention does not keep packed examples apart; "
                      "SFT pads one example per row instead (slower, same result)", file=sys.stderr)
        batch = (packed_batch if pack else padded_batch)(data, mine, pad_id)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batch, budget, lockstep)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {len(losses)}; lower sft.learning_rate")
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            tokens = distributed.all_reduce_sum((batch["labels"][:, 1:] != IGNORE).sum())
            on_step({"step": len(losses), "loss": losses[-1], "grad_norm": float(grad_norm), "lr": lr,
                     "tokens": int(tokens), "step_time_s": time.perf_counter() - started})
    model.eval()
    return losses



# micro_batches, this module's old name (grpokit.micro_batches is the module of that name)
__getattr__ = renamed_names(__name__, {"micro_batches": (sft_micro_batches, "sft_micro_batches")})
