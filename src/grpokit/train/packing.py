"""Whether a run's forwards pack several samples into one row (grpo.pack_rows): only once the policy
is seen to keep packed samples apart, by SFT's check on the first batch (train/sft.py)."""

from __future__ import annotations

import sys

import torch

from grpokit import distributed
from grpokit.errors import ConfigError
from grpokit.micro_batches import packed_lengths
from grpokit.train.sft import TokenizedExamples, packing_matches_padding
from grpokit.types import Rollout

# Rows of the first batch the packing check runs on: enough to share packed rows, three forwards' worth.
PACKING_CHECK_ROWS = 32


def packs_apart(model: torch.nn.Module, rollout: Rollout, pad_id: int, max_tokens: int, lockstep: bool) -> bool:
    """SFT's packing check (train/sft.py, packing_matches_padding) on up to PACKING_CHECK_ROWS of the
    rollout's samples as examples: their attended tokens, the prompt's unlabelled."""
    mask = rollout.attention_mask.bool().cpu()
    lengths = packed_lengths(mask, rollout.prompt_length)
    rows = lengths.nonzero().flatten().tolist()[:PACKING_CHECK_ROWS]
    if not rows:
        return True  # nothing to compute: nothing can leak
    ids = rollout.input_ids.cpu()
    examples = TokenizedExamples.of([(ids[i][mask[i]].tolist(), int(mask[i, : rollout.prompt_length].sum()))
                                     for i in rows])
    return packing_matches_padding(model, examples, list(range(len(rows))), pad_id, max_tokens, lockstep)


def same_attention(model: torch.nn.Module, policy: torch.nn.Module) -> bool:
    """Whether `model` (the reference, a critic) handles packed rows as the checked policy does: the
    policy itself, or a model of its type and attention implementation."""
    if model is policy:
        return True
    a, b = getattr(model, "config", None), getattr(policy, "config", None)
    return a is not None and b is not None and all(
        getattr(a, key, None) == getattr(b, key, None) is not None for key in ("model_type", "_attn_implementation"))


def decide_packing(mode: str, model: torch.nn.Module, rollout: Rollout, pad_id: int, max_tokens: int,
                   world_size: int) -> bool:
    """grpo.pack_rows on the first batch: off never packs; auto and on pack once the policy is seen to
    keep packed samples apart (packs_apart); a policy that fails it pads under auto and is an error
    under on."""
    if world_size > 1:
        # Packed passes under torchrun deadlocked (ranks made different collective calls in a run with
        # tool rollouts): until that is found, several processes pad, as before packing existed.
        if mode == "on":
            raise ConfigError("grpo.pack_rows=on is not supported with several processes (torchrun) yet: "
                              "set grpo.pack_rows to auto (pads there) or off")
        return False
    attention = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    if mode != "off" and "flash" in attention:
        # transformers' flash-attention path reads packed position_ids as sample boundaries only when the
        # batch holds one row; RL's micro-batches hold several, so their samples would attend to each other.
        if mode == "on":
            raise ConfigError(f"grpo.pack_rows=on with model.attn_implementation={attention}, which keeps packed "
                              "samples apart only one row at a time: set grpo.pack_rows to auto (pads) or off, or use "
                              "sdpa")
        if distributed.is_main():
            print(f"grpokit: {attention} keeps packed samples apart only one row at a time; log-prob passes and "
                  "updates pad one sample per row instead (grpo.pack_rows=auto; sdpa packs)", file=sys.stderr)
        return False
    packs = mode != "off" and distributed.all_agree(packs_apart(model, rollout, pad_id, max_tokens, False))
    if not packs and mode == "on":
        raise ConfigError("grpo.pack_rows=on, but this policy's attention does not keep packed samples "
                          "apart (packed log-probs differ from padded ones): set grpo.pack_rows to auto or off")
    if not packs and mode == "auto" and distributed.is_main():
        print("grpokit: this policy's attention does not keep packed samples apart; log-prob passes and "
              "updates pad one sample per row instead (grpo.pack_rows=auto; slower, same result)",
              file=sys.stderr)
    return packs
