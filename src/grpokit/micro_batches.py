"""Micro-batches bounded by a token budget: at most `max_tokens` = rows x the micro-batch's padded width.

A forward with gradients keeps activations in proportion to the tokens it computes, so a fixed
number of rows is too many at long lengths and too few at short ones. Rows are taken in order of
length (each micro-batch is cut to its longest row, so short rows travel with short rows) and
grouped greedily under both the token budget and an optional cap on rows. How a batch is cut
changes only memory, never the result: every loss divides by the whole batch's count.

Packed micro-batches (SFT's and, with grpo.pack_rows, RL's) put several short examples in one
row instead: each example keeps its own positions, restarting at 0, and no attention_mask is
passed, so transformers builds the block-diagonal causal mask from the positions (a model that
ignores them leaks across examples: train/sft.py, packing_matches_padding, checks for that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpokit import distributed
from grpokit.errors import ConfigError


def split_by_tokens(lengths: torch.Tensor, max_tokens: int | None, max_rows: int | None = None,
                    key: str = "max_tokens_per_micro_batch", lockstep: bool = False) -> list[torch.Tensor]:
    """Row indices (into `lengths`, [N] each row's length in tokens) of micro-batches, in order of length.

    Each micro-batch holds at most `max_rows` rows and at most `max_tokens` tokens, counted as its
    rows x its longest row; together they hold every row exactly once. A row longer than
    `max_tokens` is an error naming `key`. With `lockstep` (several processes whose forwards are
    collectives, FSDP2) every process gets the same number of micro-batches: those with fewer
    split their largest. Lengths on the meta device hold no values: then only `max_rows` applies.
    """
    n = lengths.shape[0]
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"{key}={max_tokens} must be a positive number of tokens")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be a positive number of rows")
    rows_cap = max_rows or max(n, 1)
    if lengths.is_meta:
        return list(torch.arange(n).split(rows_cap))  # the same count on every process
    values = lengths.detach().to("cpu", torch.long)
    order = values.argsort(stable=True)
    if max_tokens is not None and n and int(values.max()) > max_tokens:
        longest = int(values.max())
        raise ConfigError(f"{key}={max_tokens} is smaller than the longest row, {longest} tokens: "
                          f"set {key} to at least {longest}")
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order.tolist():
        width = int(values[i])  # ascending order: the row just added is the longest so far
        if current and (len(current) + 1 > rows_cap or
                        (max_tokens is not None and (len(current) + 1) * width > max_tokens)):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    out = [torch.tensor(g, dtype=torch.long) for g in groups]
    return _same_count(out, lockstep) if max_tokens is not None else out


def _same_count(groups: list[torch.Tensor], lockstep: bool) -> list[torch.Tensor]:
    """`groups` split further until every process holds as many as the one with the most."""
    if not lockstep:
        return groups
    return split_until(groups, distributed.all_reduce_max(len(groups)))


def split_until(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`groups` with the one of most rows halved until there are `count`: each part stays within
    the budget its whole kept, and the rows stay in order."""
    groups = list(groups)
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[i]) < 2:
            raise RuntimeError(f"cannot split {sum(len(g) for g in groups)} rows into the {count} micro-batches "
                               "another process needs: every process must hold as many rows")
        half = (len(groups[i]) + 1) // 2
        groups[i : i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def attended_ends(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N] one past each row's last attended column (0 for a row with none)."""
    columns = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * columns).amax(dim=1)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, matching what `generate` uses while sampling."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_rows(lengths: list[int], width: int | None = None) -> list[list[int]]:
    """First-fit decreasing: example indices grouped into rows no longer than `width` (default:
    the longest example).

    Rows come in order of their first (longest) example; within a row, longest first. The
    result depends only on the lengths, so a batch always packs the same way; and packing the
    examples of some of its rows again, at the same width and in the same relative order, gives
    back exactly those rows (each example meets the same rows, equally full, as it did first)."""
    width = max(lengths) if width is None else width
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


def packed_lengths(attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[N] tokens each row contributes to a packed forward: its attended tokens, or 0 for a row
    with no attended completion token (it has nothing to predict, so it is not computed)."""
    has_completion = attention_mask[:, prompt_length:].bool().any(dim=1)
    return attention_mask.bool().sum(dim=1) * has_completion


def packed_micro_batches(lengths: torch.Tensor, max_tokens: int | None, max_rows: int | None = None,
                         key: str = "max_tokens_per_micro_batch", lockstep: bool = False,
                         width: int | None = None) -> list[list[list[int]]]:
    """Micro-batches of packed rows: each a list of rows, each row a list of example indices
    (into `lengths`, [N] tokens per example; examples of length 0 are left out).

    Examples are packed first-fit decreasing into rows of `width` tokens (default: the longest
    example), then the rows are grouped as split_by_tokens groups rows, by their filled length:
    at most `max_rows` packed rows and `max_tokens` tokens (rows x the fullest row) each."""
    values = lengths.detach().to("cpu", torch.long)
    kept = values.nonzero().flatten().tolist()
    if not kept:
        return []
    kept_lengths = [int(values[i]) for i in kept]
    rows = [[kept[j] for j in row] for row in pack_rows(kept_lengths, width)]
    fills = torch.tensor([sum(int(values[i]) for i in row) for row in rows])
    groups = split_by_tokens(fills, max_tokens, max_rows, key, lockstep)
    return [[rows[r] for r in group.tolist()] for group in groups]


@dataclass(frozen=True)
class PackedInputs:
    """One packed forward's inputs and where its outputs go.

    input_ids, position_ids: [R, W] packed rows (positions restart at 0 for each example and
    for the padding that ends a row); select: [R, W - 1] True at the columns whose next token is
    a completion token; targets: [R, W - 1] that next token; destination: [R, W - 1] the flat
    index (row x T + completion column) of the predicted token in the padded [N, T] layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    select: torch.Tensor
    targets: torch.Tensor
    destination: torch.Tensor
    real_tokens: int


def packed_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                  rows: list[list[int]], pad_id: int = 0) -> PackedInputs:
    """The packed forward of `rows` (packed_micro_batches' lists of example indices) of a padded
    batch, input_ids and attention_mask [N, P + T] with completions from column P. Each example
    brings its attended tokens in order, so column c of the packed row sees what the attended
    columns before it saw in the padded row, at the same positions (position_ids_for)."""
    mask = attention_mask.bool().cpu()
    ids_cpu = input_ids.cpu()
    completion_width = input_ids.shape[1] - prompt_length
    columns = [[mask[i].nonzero().flatten() for i in row] for row in rows]
    width = max(sum(len(c) for c in row) for row in columns)
    ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    destination = torch.full((len(rows), width), -1, dtype=torch.long)
    real = 0
    for r, (row, row_columns) in enumerate(zip(rows, columns)):
        offset = 0
        for i, cols in zip(row, row_columns):
            n = len(cols)
            ids[r, offset : offset + n] = ids_cpu[i, cols]
            positions[r, offset : offset + n] = torch.arange(n)
            # the token at packed column offset + k is predicted by column offset + k - 1
            completion = (cols >= prompt_length).nonzero().flatten()
            completion = completion[completion > 0]  # a first token has nothing before it to predict it
            destination[r, offset + completion - 1] = i * completion_width + cols[completion] - prompt_length
            offset += n
        real += offset
        positions[r, offset:] = torch.arange(width - offset)
    destination = destination[:, :-1]
    device = input_ids.device
    return PackedInputs(ids.to(device), positions.to(device), (destination >= 0).to(device),
                        ids[:, 1:].to(device), destination.to(device), real)


@dataclass
class ComputedTokens:
    """Tokens the forward passes computed, and how many of them were real (not padding)."""

    computed: int = 0
    real: int = 0

    def add(self, computed: int, real: int) -> None:
        self.computed += int(computed)
        self.real += int(real)

    @property
    def padding_frac(self) -> float:
        """The share of computed tokens that were padding (0 when nothing was computed)."""
        return 1.0 - self.real / self.computed if self.computed else 0.0


@dataclass(frozen=True)
class Cut:
    """How a forward pass over rows cuts them into micro-batches: at most `micro_batch_size` rows (packed
    rows, when packing) and `max_tokens` tokens each (a longer row is an error naming `budget_key`),
    packed rows of `pack_width` tokens; `counter` adds up the tokens each forward computed."""

    micro_batch_size: int = 32
    max_tokens: int | None = None
    budget_key: str = "max_tokens"
    pack_width: int | None = None
    counter: ComputedTokens | None = None


def packed_forwards(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, cut: Cut,
                    lockstep: bool):
    """Each packed micro-batch's PackedInputs (packed_micro_batches, packed_inputs) in turn, its tokens
    counted in cut.counter. lockstep: as packed_micro_batches' (a sharded model's processes)."""
    lengths = packed_lengths(attention_mask, prompt_length)
    for rows in packed_micro_batches(lengths, cut.max_tokens, cut.micro_batch_size, cut.budget_key, lockstep,
                                     cut.pack_width):
        packed = packed_inputs(input_ids, attention_mask, prompt_length, rows)
        if cut.counter is not None:
            cut.counter.add(packed.input_ids.numel(), packed.real_tokens)
        yield packed


@dataclass
class RowLayout:
    """How one RL step's forward passes lay out its rows, and what they computed.

    pack: rows share packed rows of `width` tokens (the batch's longest row, so packing any
    micro-batch's rows again gives back the same packed rows), else one padded row each.
    computed: the tokens every forward computed and how many were real (perf/padding_frac)."""

    pack: bool = False
    width: int | None = None
    computed: ComputedTokens = field(default_factory=ComputedTokens)

    @classmethod
    def of(cls, pack: bool, attention_mask: torch.Tensor, prompt_length: int) -> RowLayout:
        width = int(packed_lengths(attention_mask, prompt_length).max()) if pack else None
        return cls(pack, width or None)

    def row_lengths(self, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """[N] tokens each row's forward needs: packed, its attended tokens (0: none needed);
        padded, its columns through its last attended token (a micro-batch is cut to its longest)."""
        if self.pack:
            return packed_lengths(attention_mask, prompt_length)
        return attended_ends(attention_mask).clamp(min=prompt_length + 1)

    def micro_batches(self, lengths: torch.Tensor, max_tokens: int | None, max_rows: int | None, key: str,
                      lockstep: bool = False) -> list[torch.Tensor]:
        """Row indices (into `lengths`, row_lengths of some rows) of each micro-batch. Packed: the
        rows of whole packed rows of `width`, at most `max_rows` packed rows and `max_tokens`
        tokens each, in increasing index order (rows needing no tokens are left out); padded:
        split_by_tokens."""
        if not self.pack:
            return split_by_tokens(lengths, max_tokens, max_rows, key, lockstep)
        groups = packed_micro_batches(lengths, max_tokens, max_rows, key, lockstep, self.width)
        return [torch.tensor(sorted(i for row in group for i in row), dtype=torch.long) for group in groups]

    def forward_options(self) -> dict:
        """token_logprobs' and token_values' keyword arguments for this layout."""
        return {"pack": self.pack, "pack_width": self.width, "counter": self.computed}
