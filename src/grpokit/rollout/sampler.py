"""G samples per prompt from pi_old: batched, left-padded prompts, EOS and stop-string stops,
truncation flags."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from grpokit.models.precision import in_compute_dtype
from grpokit.models.sharding import gathered_for_generation
from grpokit.types import Rollout
from grpokit.models.device import model_device


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. temperature=0 means greedy decoding.

    stop: strings that end a completion as soon as one is written; the stop string stays at
        the end of the text (tool-integrated reasoning stops at "```output" to run a program).
        With transformers (`hf`), a stop string may begin in the prompt's last characters and
        end in the completion; vLLM looks at the completion alone.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 256  # completions per `generate` call; bounds memory, not results
    stop: tuple[str, ...] = ()
    # Rows of one `generate` call that share a prompt (a group's G completions) prefill it once and
    # copy its KV cache; same distribution, same reported log-probs, not the same rounding (rollout.shared_prefill).
    shared_prefill: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)  # a list given by a caller becomes a (hashable) tuple


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model's generation_config names none; set one")
    return ids


# generation_config fields that name tokens, which rollouts keep (EOS ends a completion, pad fills rows);
# and bookkeeping that changes nothing drawn. Every other field a checkpoint sets (temperature, top_p,
# top_k, min_p, repetition and length penalties, n-gram bans, forced or suppressed tokens, lengths) is
# ignored: the run's own SamplingParams are the one source of the distribution the loss assumes.
KEPT_GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
BOOKKEEPING_FIELDS = {"transformers_version", "_from_model_config", "use_cache", "output_attentions",
                      "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
                      "cache_implementation", "cache_config", "_commit_hash"}
_noted_defaults: set[str] = set()


def checkpoint_sampling_defaults(model: torch.nn.Module) -> dict:
    """The values the model's generation_config (a checkpoint's generation_config.json) sets that
    would change what `generate` draws, which rollouts ignore: {field: value}, {} when none."""
    config = getattr(model, "generation_config", None)
    if not isinstance(config, GenerationConfig):
        return {}
    return {key: value for key, value in sorted(config.to_diff_dict().items())
            if key not in KEPT_GENERATION_FIELDS and key not in BOOKKEEPING_FIELDS and value is not None}


def note_ignored_sampling_defaults(model: torch.nn.Module, where: str = "") -> None:
    """Say once, in one line, which of the checkpoint's sampling defaults rollouts ignore."""
    ignored = checkpoint_sampling_defaults(model)
    if not ignored:
        return
    shown = ", ".join(f"{key}={value}" for key, value in ignored.items())
    if shown in _noted_defaults:
        return
    _noted_defaults.add(shown)
    source = where or getattr(getattr(model, "config", None), "_name_or_path", "") or "the model"
    print(f"grpokit: {source}: its generation_config sets {shown}; rollouts ignore them and sample from the "
          "run's own temperature and top_p alone (docs/guides/rollout-engines.md)", file=sys.stderr)


@contextlib.contextmanager
def run_sampling_only(model: torch.nn.Module) -> Iterator[None]:
    """While it is open, `generate` on `model` (or a PEFT/FSDP wrapper of it) sees a generation_config
    holding only the checkpoint's token ids: transformers fills every field a caller leaves unset from
    the model's own generation_config, so without this a checkpoint's top_k, min_p or repetition
    penalty would reshape the distribution sampled, unseen by the log-probs the loss uses."""
    saved = []
    for module in model.modules():
        config = module.__dict__.get("generation_config")
        if isinstance(config, GenerationConfig):
            kept = {key: getattr(config, key, None) for key in KEPT_GENERATION_FIELDS}
            saved.append((module, config))
            module.generation_config = GenerationConfig(**{k: v for k, v in kept.items() if v is not None})
    try:
        yield
    finally:
        for module, config in saved:
            module.generation_config = config


def completion_mask_and_truncation(
    completion_ids: torch.Tensor, eos_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] completion tokens -> (mask [N, T] through the first EOS, truncated [N])."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    t = completion_ids.shape[1]
    first_eos = torch.where(has_eos, is_eos.long().argmax(dim=1), torch.full_like(has_eos, t, dtype=torch.long))
    positions = torch.arange(t, device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~has_eos


def stop_string_cut(tokenizer, prompt_tail: list[int], completion: list[int], stops: tuple[str, ...]) -> int | None:
    """How many leading tokens of `completion` it takes to complete a stop string, or None.

    transformers' stop_strings end generation on the token that completes a stop string, but
    leave the row running on as padding; this finds that token again. `prompt_tail` (the last
    prompt tokens) lets a stop string that began in the prompt count as transformers counts
    it; one lying wholly inside the prompt never does.
    """
    head = len(tokenizer.decode(prompt_tail, skip_special_tokens=True))

    def completed(n: int) -> bool:
        text = tokenizer.decode(prompt_tail + completion[:n], skip_special_tokens=True)
        return any(text.find(s, max(0, head - len(s) + 1)) >= 0 for s in stops)

    if not completion or not completed(len(completion)):
        return None
    low, high = 1, len(completion)  # smallest n with completed(n): it only turns true as n grows
    while low < high:
        middle = (low + high) // 2
        if completed(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _check_stop_strings(tokenizer, stops: tuple[str, ...]) -> None:
    """Fail early, and say why, where transformers cannot map stop strings onto this vocabulary
    (it reads each token's text after the letters "abcdef", which a character vocabulary without
    them cannot write). Its result is cached, so generate does not redo the work."""
    from transformers import StopStringCriteria

    try:
        StopStringCriteria(tokenizer, list(stops))
    except ValueError as err:
        raise ValueError(f"transformers' stop_strings cannot use this tokenizer for {list(stops)!r} ({err}); "
                         "use a tokenizer that can write the letters a-f, or another engine") from err


def sample_groups(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    num_generations: int,
    params: SamplingParams,
    rows: list[dict] | None = None,
    decode: Decode | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each prompt.

    Returns a Rollout of N = len(prompts) x G rows; the G completions of prompt p are
    rows p*G .. p*G+G-1. Prompts are left-padded so all completions start at one column.
    With params.stop, a completion ends right after the first stop string it contains (kept
    in the text, the last token under the mask) and is not counted as truncated.
    decode: how each batch is generated (default: plain `generate`); the Rollout's
    sampling_logp holds the log-probs it reports, where it does.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if not prompts:
        raise ValueError("sample_groups got no prompts")
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = saved_side
    prompt_ids = enc["input_ids"].repeat_interleave(num_generations, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(num_generations, dim=0)
    completion_ids, completion_mask, truncated, logp = sample_ids(model, tokenizer, prompt_ids, prompt_mask, params,
                                                                 decode)
    return assemble_rollout(tokenizer, prompts, num_generations, prompt_ids, prompt_mask, completion_ids,
                            completion_mask, truncated, rows, logp)


@torch.no_grad()
@in_compute_dtype
def sample_ids(model: torch.nn.Module, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               params: SamplingParams, decode: Decode | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One completion per row of the left-padded prompt_ids [N, P] (prompt_mask 1 on real tokens):
    (completion_ids [N, T], completion_mask [N, T] through the first EOS or the token completing
    the first of params.stop, truncated [N] where neither came within params.max_new_tokens,
    logp [N, T]: each sampled token's log-prob as `decode` reports it, float32, or None)."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    eos_ids = _eos_ids(model, tokenizer)
    greedy = params.temperature == 0
    gen_config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else params.temperature,
        top_p=None if greedy else params.top_p,
        # 0, not None: generate fills None with its default of 50, and the log-probs below are
        # taken over the whole vocabulary, so sampling must be too.
        top_k=None if greedy else 0,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        **({"stop_strings": list(params.stop)} if params.stop else {}),
    )
    # stop_strings need the tokenizer to map text to tokens; without them generate stays as it was.
    stop_kwargs = {"tokenizer": tokenizer} if params.stop else {}
    if params.stop:
        _check_stop_strings(tokenizer, params.stop)
    decode = decode or plain_generate
    shares = params.shared_prefill and getattr(decode, "takes_prefilled_cache", False)
    chunks, logps = [], []
    # A sharded (FSDP2) policy is gathered once for the whole call (each process must make the
    # same number of calls), so the decoding forwards run no collectives: transformers' synced_gpus
    # (on by default for FSDP, one all_reduce per token) is off, and each process decodes alone.
    with gathered_for_generation(model) as gathered, run_sampling_only(model):
        for start in range(0, prompt_ids.shape[0], params.batch_size):
            ids = prompt_ids[start : start + params.batch_size].to(device)
            mask = prompt_mask[start : start + params.batch_size].to(device)
            # Not on a gathered (FSDP2) policy: its forwards outside generate would need the same lockstep.
            prefilled = shared_prefix_cache(model, ids, mask) if shares and not gathered else {}
            new_ids, logp = decode(model, ids, mask, gen_config,
                                   **({"synced_gpus": False} if gathered else {}), **stop_kwargs, **prefilled)
            chunks.append(new_ids.cpu())
            logps.append(None if logp is None else logp.float().cpu())
    if was_training:
        model.train()
    if not chunks:  # no rows here: the process took part in the gather only (multi-turn lockstep)
        empty = torch.zeros((0, 0), dtype=torch.long)
        return empty, empty.clone(), torch.zeros(0, dtype=torch.bool), None
    width = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat(
        [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=tokenizer.pad_token_id) for c in chunks]
    )
    logp = None if any(part is None for part in logps) else torch.cat(
        [torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in logps])
    completion_mask, truncated = completion_mask_and_truncation(completion_ids, eos_ids)
    if params.stop:
        longest = max(len(s) for s in params.stop)  # tokens other than special ones hold a character or more
        for row in range(completion_ids.shape[0]):
            tail = prompt_ids[row][prompt_mask[row].bool()][-longest:].tolist()
            kept = completion_ids[row][completion_mask[row].bool()].tolist()
            cut = stop_string_cut(tokenizer, tail, kept, params.stop)
            if cut is not None:
                completion_mask[row, cut:] = 0
                truncated[row] = False
    return completion_ids, completion_mask, truncated, None if logp is None else logp * completion_mask


# How a batch of left-padded prompts is generated: decode(model, ids [n, P], mask [n, P], generation_config,
# **generate_kwargs) -> (the new ids [n, T], each one's log-prob under the distribution it was drawn from [n, T]
# or None). The default is plain `generate`; rollout/hf_static.py decodes with a static KV cache.
Decode = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def plain_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, gen_config: GenerationConfig,
                   **generate_kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `generate` as it comes (a dynamic KV cache); it reports no log-probs."""
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config, **generate_kwargs)
    return out[:, ids.shape[1] :], None


plain_generate.takes_prefilled_cache = True  # generate continues from the cache shared_prefix_cache gives


def cache_argument(model: torch.nn.Module) -> str:
    """The name `generate` and `forward` take a Cache under: `cache` in recent transformers, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def shared_prefix_cache(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """{cache argument: a DynamicCache of every row's prompt but its last token} for `generate` to continue
    from, where rows repeat (a group's G copies of one prompt); {} where none does, or the model's cache
    is not one `generate` can resume (linear-attention layers).

    Each distinct row is prefilled once, with the position ids `generate` would give it (from the
    mask), and its keys and values are copied to its repeats. `generate` then feeds each row only its
    last prompt token, so the first sampled token comes from the same logits, up to float rounding of
    the smaller products, and the tokens are drawn exactly as from the expanded batch."""
    from transformers import DynamicCache

    n, width = ids.shape
    if n < 2 or width < 2:
        return {}
    distinct, inverse = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
    if distinct.shape[0] == n:
        return {}
    first = torch.full((distinct.shape[0],), n, dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
    prefix_ids, prefix_mask = ids[first, :-1], mask[first, :-1]
    positions = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)  # as generate computes them
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions, use_cache=True, **keep)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if not isinstance(cache, DynamicCache) or any(getattr(cache, "is_linear", None) or ()):
        return {}
    cache.batch_select_indices(inverse)
    return {cache_argument(model): cache}


@dataclass(frozen=True)
class Continuation:
    """What one context's sampling added: the sampled token ids, and why it ended: "eos" (the
    last id is an EOS), "stop" (the last id completes one of params.stop) or "length" (its budget).
    logp: each sampled id's log-prob under the engine that sampled it, where the engine reports it."""

    ids: list[int]
    finish: str
    logp: list[float] | None = None


def left_padded(contexts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as (ids [N, P], mask [N, P]), left-padded to the longest."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        if context:
            ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = 1
    return ids, mask


def continue_ids(model: torch.nn.Module, tokenizer, contexts: list[list[int]], budgets: list[int],
                 params: SamplingParams, decode: Decode | None = None) -> list[Continuation]:
    """One continuation of each token-id context, sampled on the ids as they are (never
    re-tokenised), of at most budgets[i] tokens (params.max_new_tokens is not read); with the
    sampled ids' log-probs where `decode` reports them."""
    if len(budgets) != len(contexts) or min(budgets, default=1) < 1:
        raise ValueError(f"continue_ids needs one budget >= 1 per context, got {budgets} for {len(contexts)} contexts")
    if not contexts:  # a sharded policy is still gathered: every process makes the same calls
        sample_ids(model, tokenizer, torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.long),
                   params, decode)
        return []
    ids, mask = left_padded(contexts, tokenizer.pad_token_id)
    completion_ids, completion_mask, truncated, logp = sample_ids(
        model, tokenizer, ids, mask, dataclasses.replace(params, max_new_tokens=max(budgets)), decode)
    eos_ids = set(_eos_ids(model, tokenizer))
    out = []
    for row, budget in enumerate(budgets):
        kept = completion_mask[row].bool()
        sampled = completion_ids[row][kept].tolist()
        row_logp = None if logp is None else logp[row][kept].tolist()
        if len(sampled) > budget or truncated[row]:
            out.append(Continuation(sampled[:budget], "length", None if row_logp is None else row_logp[:budget]))
        else:
            out.append(Continuation(sampled, "eos" if sampled and sampled[-1] in eos_ids else "stop", row_logp))
    return out


def assemble_rollout(tokenizer, prompts: list[str], num_generations: int, prompt_ids: torch.Tensor,
                     prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     truncated: torch.Tensor, rows: list[dict] | None, sampling_logp: torch.Tensor | None = None,
                     sampled_mask: torch.Tensor | None = None) -> Rollout:
    """The Rollout every engine returns: left-padded prompts [N, P] then completions [N, T], padded
    after their mask, decoded without special tokens; rows and prompts repeated G times.
    sampled_mask [N, T]: 1 on the tokens the policy sampled, 0 on inserted tool output (None: all)."""
    completion_ids = torch.where(completion_mask.bool(), completion_ids, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(
        [ids[m.bool()] for ids, m in zip(completion_ids, completion_mask)], skip_special_tokens=True
    )
    return Rollout(
        prompts=[p for p in prompts for _ in range(num_generations)],
        completions=texts,
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        truncated=truncated,
        prompt_length=prompt_ids.shape[1],
        group_size=num_generations,
        rows=[r for r in rows for _ in range(num_generations)] if rows else [],
        sampling_logp=None if sampling_logp is None else sampling_logp * completion_mask,
        sampled_mask=None if sampled_mask is None else sampled_mask * completion_mask,
    )
