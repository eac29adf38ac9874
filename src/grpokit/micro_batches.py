"""Micro-batches bounded by a token budget: at most `max_tokens` = rows x the micro-batch's padded width.

A forward with gradients keeps activations in proportion to the tokens it computes, so a fixed
number of rows is too many at long lengths and too few at short ones. Rows are taken in order of
length (each micro-batch is cut to its longest row, so short rows travel with short rows) and
grouped greedily under both the token budget and an optional cap on rows. How a batch is cut
changes only memory, never the result: every loss divides by the whole batch's count.
"""

from __future__ import annotations

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
