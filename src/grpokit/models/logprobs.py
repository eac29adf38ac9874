"""Per-token log-probs of given tokens under a causal LM, micro-batched and chunked.

For the common transformers causal LMs the backbone runs on its own, its hidden states are
kept only at the positions that predict completion tokens, and the LM head is applied to
tiles of at most `chunk_size` positions (rows x sequence positions) at a time. Each tile is
reduced at once to the target's logit minus the log-sum-exp over the vocabulary, so a tile's
float32 logits and one working copy are the only vocabulary-sized tensors alive, instead of
N x (P + T) x vocab logits. When gradients are on, each tile runs under activation
checkpointing: backward recomputes that tile's logits rather than every tile keeping its own,
and builds the tile's gradient, onehot(target) - softmax, in a single buffer.

A model sharded with FSDP2 must run its root's own forward, which gathers the embeddings and
the head: for the same model types its head is swapped, for that one forward, for a module
that applies the real head in the same tiles, so no vocabulary-sized tensor of the whole
batch exists there either.

Other models run their own forward (asking for the last T + 1 logits only, where the forward
accepts `logits_to_keep`) and their logits go through the same tiles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from grpokit.micro_batches import (ComputedTokens, Cut, attended_ends, packed_forwards, packed_lengths,
                                   position_ids_for, split_by_tokens)
from grpokit.models.precision import in_compute_dtype
from grpokit.models.wrapping import fsdp_root, is_sharded
from grpokit.models.device import model_device

# transformers model types whose causal-LM forward is exactly `lm_head(decoder(...)[0])`,
# optionally followed by `final_logit_softcapping` (applied here the same way). Others, such
# as Cohere (logit_scale) or Granite (logits_scaling), rescale logits in their own forward,
# so they take the model's forward path. tests/test_logprobs.py checks each entry against
# the model's own logits.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3_text",
        "llama",
        "mistral",
        "mixtral",
        "olmo2",
        "phi",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "starcoder2",
    }
)


@in_compute_dtype
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    temperature: float = 1.0,
    micro_batch_size: int = 32,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    max_tokens: int | None = None,
    budget_key: str = "max_tokens",
    pack: bool = False,
    pack_width: int | None = None,
    counter: ComputedTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of input_ids[:, prompt_length:] given everything before them.

    input_ids, attention_mask: [N, P + T]. Returns (logp [N, T], entropy [N, T] or None) on
    the model's device. Logits are divided by `temperature`, so logp is the log-prob under
    the distribution the rollout sampled from. Gradients flow when called outside
    torch.no_grad(); entropy never carries gradients. `chunk_size` bounds how many positions
    (rows x sequence positions together) get vocabulary-sized logits at once.

    Rows go through the model in micro-batches of similar length (sorted by attended length),
    each cut to its longest row: columns past every row's last attended token change nothing
    before them (attention is causal), so they are not computed. A micro-batch holds at most
    `micro_batch_size` rows and, with `max_tokens`, at most that many tokens (rows x its width;
    a longer row is an error naming `budget_key`). logp and entropy are 0 wherever
    attention_mask is 0.

    With `pack`, rows are packed instead (micro_batches.packed_micro_batches): each row's attended
    tokens, with their own positions, share packed rows of `pack_width` tokens (default: the
    longest row) with other rows', and a micro-batch holds at most `micro_batch_size` packed rows
    and `max_tokens` tokens. The model must keep packed examples apart (train/sft.py,
    packing_matches_padding); then the result equals the padded one to float rounding. `counter`
    adds up the tokens each forward computed and how many were real (perf/padding_frac).
    """
    _check_logprob_arguments(input_ids, attention_mask, prompt_length, chunk_size, micro_batch_size)
    device = model_device(model)
    completion_length = input_ids.shape[1] - prompt_length
    attended = attention_mask[:, prompt_length:].to(device).bool()  # padding gets 0, in every row alike
    if pack and not attention_mask.is_meta:
        logp, entropy = _packed_token_logprobs(model, input_ids, attention_mask, prompt_length,
                                               Cut(micro_batch_size, max_tokens, budget_key, pack_width, counter),
                                               _Tiles(temperature, with_entropy, chunk_size))
        logp = logp.view(-1, completion_length).masked_fill(~attended, 0.0)
        return logp, entropy.view(-1, completion_length).masked_fill(~attended, 0.0) if with_entropy else None
    split = backbone_and_head(model)
    tiled_root = _sharded_root_with_plain_head(model) if split is None else None
    # Length of each row up to its last attended token; rows are grouped in order of it.
    # Meta tensors hold no values to sort or cut by: every column is computed.
    ends = attended_ends(attention_mask).clamp(min=prompt_length + 1)
    groups = split_by_tokens(ends, max_tokens, micro_batch_size, budget_key, lockstep=is_sharded(model))
    if len(groups) == 1:
        groups = [torch.arange(input_ids.shape[0])]  # one forward: keep the rows as given
    logps, entropies = [], []
    for rows in groups:
        width = input_ids.shape[1] if ends.is_meta else int(ends[rows].max())
        ids = input_ids[rows.to(input_ids.device), :width].to(device)
        mask = attention_mask[rows.to(attention_mask.device), :width].to(device)
        if counter is not None and not mask.is_meta:
            counter.add(mask.numel(), packed_lengths(mask, prompt_length).sum())  # tokens a row needs
        inputs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False)
        targets = ids[:, prompt_length:]
        if tiled_root is not None:  # sharded: the root's own forward, with its head applied in tiles
            logp, entropy = _tiled_forward(model, tiled_root, inputs, targets,
                                           _Tiles(temperature, with_entropy, chunk_size))
        else:
            head, softcap, features = _completion_features(model, split, inputs, prompt_length, width)
            logp, entropy = _chunked_stats(head, softcap, features, targets, temperature, with_entropy, chunk_size)
        logps.append(logp)
        entropies.append(entropy)
    order = torch.cat(groups) if len(groups) > 1 else None
    logp = _restore_rows(logps, order, completion_length).masked_fill(~attended, 0.0)
    entropy = _restore_rows(entropies, order, completion_length).masked_fill(~attended, 0.0) if with_entropy else None
    return logp, entropy


def _check_logprob_arguments(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                             chunk_size: int, micro_batch_size: int) -> None:
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    if not 0 < prompt_length < input_ids.shape[1]:
        raise ValueError(f"prompt_length={prompt_length} must lie in (0, {input_ids.shape[1]})")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of positions")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be a positive number of rows")


def _completion_features(model: torch.nn.Module, split, inputs: dict, prompt_length: int, width: int):
    """(head, softcap, features) of one padded micro-batch's completion columns: the backbone's hidden
    states, which the LM head then meets in tiles, or (a model whose forward computes its own logits)
    its logits, through the identity head. Column c predicts token c + 1: completion tokens are
    predicted by columns P-1 .. L-2."""
    if split is not None:
        decoder, head, softcap = split
        return head, softcap, decoder(**inputs)[0][:, prompt_length - 1 : -1]
    kept = width - prompt_length  # completion columns of this micro-batch
    if _accepts_logits_to_keep(model):
        inputs["logits_to_keep"] = kept + 1
    return _identity, None, model(**inputs).logits[:, -(kept + 1) : -1]  # the forward already applied its head


@in_compute_dtype
def labelled_logprobs(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, ignore_index: int = -100,
                      chunk_size: int = 1024) -> torch.Tensor:
    """[n] log-probs of every labelled next token, in row-major order: column c predicts
    labels[:, c + 1] wherever that is not `ignore_index` (SFT's loss is minus their mean).

    `inputs` go to the forward as given (input_ids with an attention_mask, or packed rows with
    position_ids). Only the labelled positions reach the LM head, in tiles of at most
    `chunk_size`, as in token_logprobs: no [rows, L, vocab] logits of the whole micro-batch, and
    no float32 copy of them. Gradients flow when called outside torch.no_grad()."""
    targets = labels[:, 1:]
    return _selected_stats(model, inputs, targets, targets != ignore_index, 1.0, False, chunk_size)[0]


def _selected_stats(model: torch.nn.Module, inputs: dict, targets: torch.Tensor, select: torch.Tensor,
                    temperature: float, with_entropy: bool,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n] log-prob, [n] entropy or None) of targets[select], in row-major order: column c of the
    forward predicts targets[:, c] (targets, select: [rows, L - 1]). Only the selected positions
    reach the LM head, in tiles (labelled_logprobs, and token_logprobs' packed rows)."""
    flat_targets = targets[select].unsqueeze(0)
    split = backbone_and_head(model)
    if split is not None:
        decoder, head, softcap = split
        features = decoder(**inputs)[0][:, :-1][select].unsqueeze(0)
        logp, entropy = _chunked_stats(head, softcap, features, flat_targets, temperature, with_entropy, chunk_size)
    else:
        root = _sharded_root_with_plain_head(model)
        if root is not None:  # sharded: the root's own forward, with its head applied in tiles
            logp, entropy = _tiled_forward(model, root, inputs, flat_targets, _Tiles(temperature, with_entropy,
                                                                                     chunk_size),
                                           select=select, keep=targets.shape[1] + 1)
        else:  # any other model computes its own logits; only the selected ones go through the tiles
            logits = model(**inputs).logits[:, :-1][select].unsqueeze(0)
            logp, entropy = _chunked_stats(_identity, None, logits, flat_targets, temperature, with_entropy,
                                           chunk_size)
    return logp[0], (entropy[0] if entropy is not None else None)


@dataclass(frozen=True)
class _Tiles:
    """What the LM head's tiles compute: log-probs at `temperature`, entropies when asked, at most
    `chunk_size` positions a tile."""

    temperature: float
    with_entropy: bool
    chunk_size: int


def _packed_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           prompt_length: int, cut: Cut, tiles: _Tiles) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs with the rows packed (micro_batches.packed_micro_batches): flat [N x T] log-probs
    (and entropies), scattered from each packed forward to the places padded rows would give them."""
    temperature, with_entropy, chunk_size = tiles.temperature, tiles.with_entropy, tiles.chunk_size
    device = model_device(model)
    n, completion_length = input_ids.shape[0], input_ids.shape[1] - prompt_length
    places, logps, entropies = [], [], []
    for packed in packed_forwards(input_ids, attention_mask, prompt_length, cut, is_sharded(model)):
        inputs = dict(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                      use_cache=False)
        select = packed.select.to(device)
        logp, entropy = _selected_stats(model, inputs, packed.targets.to(device), select, temperature,
                                        with_entropy, chunk_size)
        places.append(packed.destination.to(device)[select])
        logps.append(logp)
        entropies.append(entropy)
    size = n * completion_length
    if not places:
        empty = torch.zeros(size, device=device)
        return empty, (empty.clone() if with_entropy else None)
    where = torch.cat(places)
    logp = torch.zeros(size, device=device, dtype=logps[0].dtype).index_put((where,), torch.cat(logps))
    entropy = torch.zeros(size, device=device).index_put((where,), torch.cat(entropies)) if with_entropy else None
    return logp, entropy


def _restore_rows(parts: list[torch.Tensor], order: torch.Tensor | None, width: int) -> torch.Tensor:
    """Micro-batch results, each cut to its own width, as one [N, width] tensor in input row order."""
    out = torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])
    if order is None:
        return out
    return out[order.argsort().to(out.device)]


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, float | None] | None:
    """(decoder, LM head, final logit softcap) for models the chunked path knows, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if is_sharded(model):  # its root gathers the embeddings and head in its own forward only
        return None
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return None
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is model or not isinstance(head, torch.nn.Module):
        return None
    return decoder, head, getattr(config, "final_logit_softcapping", None)


def _sharded_root_with_plain_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP2 root whose head can be tiled inside its own forward, or None: a sharded model of a
    known plain-head type without logit softcapping (its forward would softcap what the head returns)."""
    config = getattr(model, "config", None)
    if not is_sharded(model) or getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None
    root = fsdp_root(model)
    if not (hasattr(root, "get_output_embeddings") and hasattr(root, "set_output_embeddings")
            and _accepts_logits_to_keep(root)):
        return None
    return root if isinstance(root.get_output_embeddings(), torch.nn.Module) else None


class _TiledHead(torch.nn.Module):
    """Stands in for the LM head during one forward: the real head applied in tiles to the
    features that predict `targets`, returning their log-probs [rows, T] (entropy kept aside)."""

    def __init__(self, head: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool,
                 chunk_size: int, select: torch.Tensor | None = None):
        super().__init__()
        self.select = select  # [rows, L - 1] positions kept (labelled_logprobs), or None for all
        object.__setattr__(self, "head", head)  # not registered: the head stays where FSDP2 placed it
        self.targets, self.temperature = targets, temperature
        self.with_entropy, self.chunk_size = with_entropy, chunk_size
        self.entropy: torch.Tensor | None = None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: the last T + 1 positions; position c predicts token c + 1
        features = features[:, :-1] if self.select is None else features[:, :-1][self.select].unsqueeze(0)
        logp, self.entropy = _chunked_stats(self.head, None, features, self.targets, self.temperature,
                                            self.with_entropy, self.chunk_size)
        return logp


def _tiled_forward(model: torch.nn.Module, root: torch.nn.Module, inputs: dict, targets: torch.Tensor, tiles: _Tiles,
                   select: torch.Tensor | None = None, keep: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp, entropy) of `targets` through the model's own forward with its head tiled: the last
    `keep` positions (default: targets' length + 1), or, with `select`, the selected ones of them. The root
    keeps its gathered parameters from forward through backward (FSDP2 does not reshard the root
    after forward), so each tile's recomputation in backward sees the same head."""
    head = root.get_output_embeddings()
    tiled = _TiledHead(head, targets, tiles.temperature, tiles.with_entropy, tiles.chunk_size, select)
    root.set_output_embeddings(tiled)
    try:
        logp = model(**inputs, logits_to_keep=keep or targets.shape[1] + 1).logits
    finally:
        root.set_output_embeddings(head)
    return logp, tiled.entropy


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in parameters


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _chunked_stats(
    head: Callable[[torch.Tensor], torch.Tensor],
    softcap: float | None,
    features: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position (logp, entropy) over tiles of `features` [rows, T, D] of at most chunk_size positions."""
    rows, length = targets.shape
    # Whole rows per tile when a row fits, else slices of one row; tiles are views, never copies.
    rows_per_tile = max(1, chunk_size // length)
    positions_per_tile = min(length, chunk_size)
    parameters = head.parameters() if isinstance(head, torch.nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (features.requires_grad or any(p.requires_grad for p in parameters))
    logp_rows, entropy_rows = [], []
    for r in range(0, rows, rows_per_tile):
        logp_tiles, entropy_tiles = [], []
        for c in range(0, length, positions_per_tile):
            args = (head, softcap, temperature, [with_entropy],
                    features[r : r + rows_per_tile, c : c + positions_per_tile],
                    targets[r : r + rows_per_tile, c : c + positions_per_tile])
            if needs_grad:
                # Backward recomputes this tile's logits instead of every tile keeping its own.
                # RNG state is kept so a head with dropout (e.g. LoRA on lm_head) recomputes the same mask.
                logp, entropy = checkpoint(_tile_stats, *args, use_reentrant=False)
            else:
                logp, entropy = _tile_stats(*args)
            logp_tiles.append(logp)
            entropy_tiles.append(entropy)
        logp_rows.append(torch.cat(logp_tiles, dim=1))
        if with_entropy:
            entropy_rows.append(torch.cat(entropy_tiles, dim=1))
    return torch.cat(logp_rows), (torch.cat(entropy_rows) if with_entropy else None)


def _tile_stats(
    head: Callable[[torch.Tensor], torch.Tensor],
    softcap: float | None,
    temperature: float,
    entropy_pending: list[bool],
    features: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and, without gradients, the entropy, for one tile.

    Each step rebinds `logits`, so at most two vocabulary-sized tiles are alive at once.
    """
    logits = head(features)
    if softcap is not None:
        # In the head's dtype, in the same order as the transformers forward.
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = _TargetLogSoftmax.apply(logits, targets)
    entropy = None
    if entropy_pending[0]:
        entropy_pending[0] = False  # computed once: backward's recomputation of the tile skips it
        with torch.no_grad():
            log_norm = torch.logsumexp(logits, dim=-1)
            probs = (logits - log_norm.unsqueeze(-1)).exp_()
            entropy = log_norm - probs.mul_(logits).sum(-1)
    return logp, entropy


class _TargetLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[..., targets] that keeps only `logits` and the log-normaliser for backward.

    Its backward builds the gradient onehot(target) - softmax(logits) in one tile, where the
    composed logsumexp and gather backwards allocate several.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_norm = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, log_norm, targets)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, log_norm, targets = ctx.saved_tensors
        grad_logp = grad_logp.unsqueeze(-1)
        grad = (logits - log_norm.unsqueeze(-1)).exp_().mul_(-grad_logp)
        return grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp), None
