"""PPO's critic: a policy-sized transformer with a scalar value per token.

It is `AutoModelForTokenClassification` with num_labels=1: the policy's backbone plus a linear
`score` head, so it saves and loads like any Hugging Face checkpoint. Initialised from the
policy (backbone weights copied, head zero so V starts at 0) or from a reward model's checkpoint.
"""

from __future__ import annotations

import torch

from grpokit.micro_batches import (ComputedTokens, Cut, attended_ends, packed_forwards, packed_lengths,
                                   position_ids_for, split_by_tokens)
from grpokit.models.lora import is_lora, merged_state_dict
from grpokit.models.precision import compute_dtype, in_compute_dtype, set_compute_dtype
from grpokit.models.sharding import full_state_dict
from grpokit.models.wrapping import is_sharded
from grpokit.models.device import model_device


def trained_dtype(policy: torch.nn.Module) -> torch.dtype:
    """The dtype the policy's trained weights are held in (its LoRA adapters', over a frozen base):
    a model trained beside it (critic, reward model) holds its weights the same way."""
    trained = [p for p in policy.parameters() if p.requires_grad]
    return (trained or list(policy.parameters()))[0].dtype


def scalar_head_from_policy(policy: torch.nn.Module, auto_class) -> torch.nn.Module:
    """`auto_class` (AutoModelForTokenClassification or ...SequenceClassification) with one output,
    the policy's backbone weights copied in and a zero `score` head, so it starts at exactly 0."""
    device = model_device(policy)
    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_labels = 1
    config.problem_type = "regression"
    config.classifier_dropout = 0.0  # scores must not be noisy; HF's default would be 0.1
    model = auto_class.from_config(config).to(device=device, dtype=trained_dtype(policy))
    # a sharded policy's weights are gathered (on every process: each builds its own critic);
    # a LoRA policy's are merged into the base model's names
    state = full_state_dict(policy, everywhere=True)
    if is_lora(policy):
        state = merged_state_dict(policy, state)
    missing, _ = model.load_state_dict(state, strict=False)  # the LM head is not carried over
    set_compute_dtype(model, compute_dtype(policy))
    backbone_missing = [k for k in missing if not k.startswith("score.")]
    if backbone_missing:
        raise ValueError(f"cannot initialise a {model.__class__.__name__} from the policy: backbone weights "
                         f"{backbone_missing[:3]} have no counterpart; initialise it from a checkpoint instead")
    with torch.no_grad():
        model.score.weight.zero_()
        if getattr(model.score, "bias", None) is not None:
            model.score.bias.zero_()
    return model


def build_critic(policy: torch.nn.Module, init_from: str = "") -> torch.nn.Module:
    """A value model the policy's size: from `init_from` (a checkpoint path) or the policy's backbone."""
    from transformers import AutoModelForTokenClassification

    if init_from:
        critic = AutoModelForTokenClassification.from_pretrained(init_from, num_labels=1, classifier_dropout=0.0,
                                                                 dtype=trained_dtype(policy))
        return set_compute_dtype(critic.to(model_device(policy)), compute_dtype(policy))
    return scalar_head_from_policy(policy, AutoModelForTokenClassification)


@in_compute_dtype
def token_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    micro_batch_size: int = 32,
    max_tokens: int | None = None,
    budget_key: str = "max_tokens",
    pack: bool = False,
    pack_width: int | None = None,
    counter: ComputedTokens | None = None,
) -> torch.Tensor:
    """V(s_t) for each completion token t: the value of the state just before o_t is chosen,
    read at the same column as the logit that predicts o_t. [N, P + T] -> [N, T], float32.

    Micro-batches as in token_logprobs: rows of similar length, at most `micro_batch_size` of
    them and `max_tokens` tokens, each cut to its longest row; 0 past a row's last attended token.
    With `pack`, packed rows as token_logprobs packs them (0 wherever attention_mask is 0);
    `counter` adds up the tokens computed and how many were real."""
    device = model_device(critic)
    if pack and not attention_mask.is_meta:
        return _packed_token_values(critic, input_ids, attention_mask, prompt_length,
                                    Cut(micro_batch_size, max_tokens, budget_key, pack_width, counter))
    ends = attended_ends(attention_mask).clamp(min=prompt_length + 1)
    groups = split_by_tokens(ends, max_tokens, micro_batch_size, budget_key, lockstep=is_sharded(critic))
    if len(groups) == 1:
        groups = [torch.arange(input_ids.shape[0])]  # one forward: keep the rows as given
    out = []
    for rows in groups:
        width = input_ids.shape[1] if ends.is_meta else int(ends[rows].max())
        ids = input_ids[rows.to(input_ids.device), :width].to(device)
        mask = attention_mask[rows.to(attention_mask.device), :width].to(device)
        if counter is not None and not mask.is_meta:
            counter.add(mask.numel(), packed_lengths(mask, prompt_length).sum())  # tokens a row needs
        logits = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask)).logits
        values = logits[:, prompt_length - 1 : -1, 0].float()
        out.append(torch.nn.functional.pad(values, (0, input_ids.shape[1] - width)))
    values = torch.cat(out)
    if len(groups) > 1:
        values = values[torch.cat(groups).argsort().to(values.device)]
    return values


def _packed_token_values(critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         prompt_length: int, cut: Cut) -> torch.Tensor:
    """token_values over packed rows (micro_batches.packed_inputs), scattered back to [N, T]."""
    device = model_device(critic)
    n, completion_length = input_ids.shape[0], input_ids.shape[1] - prompt_length
    places, parts = [], []
    for packed in packed_forwards(input_ids, attention_mask, prompt_length, cut, is_sharded(critic)):
        select = packed.select.to(device)
        # use_cache=False: with a cache, transformers builds a plain causal mask and packed samples see each other
        logits = critic(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                        use_cache=False).logits
        parts.append(logits[:, :-1, 0][select].float())
        places.append(packed.destination.to(device)[select])
    values = torch.zeros(n * completion_length, device=device)
    if places:
        values = values.index_put((torch.cat(places),), torch.cat(parts))
    return values.view(n, completion_length).masked_fill(~attention_mask[:, prompt_length:].to(device).bool(), 0.0)
