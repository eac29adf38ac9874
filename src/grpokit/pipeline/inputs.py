"""What a stage loads and checks before it trains, shared by `grpokit sft`, `train`, `train-rm` and
`label-steps`: the policy through one loader (LoRA, gradient checkpointing, FSDP2), the task's rows
within data.max_prompt_length, what a vLLM engine needs (its max_model_len and the weights' directory),
and the reward-model setups refused before any model loads. (Moved here from pipeline/stages.py.)"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from grpokit.config import Config, ConfigError
from grpokit.data.files import DatasetError, filter_long_prompts
from grpokit.data.sources import heldout_note, long_prompts_note
from grpokit.models.fits import checkpoint_parameters, tiny_llama_parameters, training_does_not_fit
from grpokit.models.loading import local_weights_dir, resolve_device
from grpokit.models.lora import apply_lora, is_lora, load_lora
from grpokit.models.reference import frozen_copy
from grpokit.models.sharding import shard_model, world_sharding
from grpokit.pipeline.build import load_policy
from grpokit.rollout import engine_spec, longest_prompt_tokens, run_max_model_len


def load_trainable_policy(config: Config, checkpoint: Path | None = None, lora: bool | None = None,
                          reference: bool = False):
    """(policy, tokenizer, reference or None), the one loader of a policy that trains (SFT and RL):
    model.name_or_path or the `checkpoint` resumed, gradient checkpointing, and with `lora` (default
    model.lora.r > 0) the base model frozen (compute dtype) under new or resumed adapters; a full
    fine-tune holds model.master_dtype weights. Sharded with FSDP2 when distributed.fsdp asks for it.
    With `reference` (RL), the frozen pi_ref where the trainer cannot make it itself: on resume, and
    before sharding (a sharded model cannot be copied); None = the trainer makes it (or runs the LoRA
    base under the adapters)."""
    lora = config.model.lora.r > 0 if lora is None else lora
    model, tokenizer = load_policy(config, None if lora or checkpoint is None else str(checkpoint), trainable=not lora)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if lora:  # the checkpoint holds the adapter, which loads with its base (model.name_or_path)
        model = apply_lora(model, config.model.lora) if checkpoint is None else load_lora(model, checkpoint)
    elif reference and checkpoint is not None and config.grpo.beta > 0:
        # the resumed policy, and the initial one frozen in place as pi_ref: two copies, not three
        # loaded as the uninterrupted run's policy was, then frozen the same way: the same pi_ref
        ref_model = frozen_copy(load_policy(config)[0])
    if world_sharding(config.distributed.fsdp):
        if reference and ref_model is None and config.grpo.beta > 0 and not is_lora(model):
            ref_model = frozen_copy(model)
        shard_model(model)
        if ref_model is not None:
            shard_model(ref_model)
    return model, tokenizer, ref_model


def limit_prompts(rows: list[dict], config: Config, tokenizer) -> list[dict]:
    """Apply data.max_prompt_length to RL questions or SFT demonstrations, saying in one line how
    many of how many it dropped or cut."""
    d = config.data
    is_sft = bool(rows) and "completion" in rows[0]  # only demonstrations carry their target
    what, key = ("SFT demonstrations", "data.sft_sources") if is_sft else ("RL questions", "data.sources")
    kept, long = filter_long_prompts(rows, tokenizer, d.max_prompt_length, d.long_prompts, key)
    if long:
        print(long_prompts_note(long, len(rows), what, d), file=sys.stderr)
    return kept


def heldout_rows(rows: list[dict], config: Config, tokenizer) -> list[dict]:
    """Held-out rows within data.max_prompt_length, whatever data.long_prompts says: evaluation
    drops a long question, never cuts it (a cut question is another question). What was dropped,
    or why nothing is left to evaluate, is said in one line."""
    try:
        short, long = filter_long_prompts(rows, tokenizer, config.data.max_prompt_length, "skip", "held-out questions")
    except DatasetError:  # no held-out question is short enough
        short, long = [], len(rows)
    note = heldout_note(len(rows), long, config.data)
    if note:
        print(note, file=sys.stderr)
    return short


def labels_from_rollouts(config: Config) -> bool:
    return config.reward_model.kind == "process" and config.reward_model.label.method == "rollouts"


def engine_setup(config: Config, tokenizer, prompts: Callable[[], list[str]], step_prefixes: bool = False,
                 weights: bool = False, checkpoint: Path | None = None) -> tuple[int | None, str | None]:
    """(max_model_len, weights directory) for a rollout engine that holds its own copy of the weights
    (vLLM); (None, None) for one that samples from the policy itself (hf). max_model_len: the longest
    of `prompts()` + grpo.max_completion_length, which bounds a TIR completion too, tool output
    included (rollout/multi_turn.py); twice that completion when step prefixes are continued (process
    labels from rollouts). With `weights`, where the policy just loaded (from `checkpoint`, else
    model.name_or_path; a LoRA policy's base) lies in from_pretrained form, for the engine to load
    without a copy; None for a tiny model built in memory, or weights vLLM cannot read alone."""
    if not engine_spec(config.rollout.engine).copies_weights:
        return None, None
    c = config.grpo.max_completion_length
    room = 2 * c if step_prefixes else c
    longest = longest_prompt_tokens(tokenizer, prompts())
    model_len = run_max_model_len(config.rollout, longest + room,
                                  f"the longest prompt ({longest} tokens) + {room} completion tokens")
    source = str(checkpoint) if checkpoint is not None else config.model.name_or_path
    return model_len, (local_weights_dir(source) if weights and source else None)


def check_reward_model_setup(config: Config) -> None:
    """Setups that could only fail after training has started, refused before any model loads."""
    rm = config.reward_model
    needs_labels = not rm.path or config.iterative.iterations > 1
    if rm.kind == "process" and config.data.sources and needs_labels and rm.label.method == "rule":
        raise ConfigError(
            "process labels for data.sources cannot be made by rule (only the built-in task has a step checker): "
            "set reward_model.label.method=rollouts to label steps from rollouts, or train a PRM with `grpokit "
            "label-steps` + `grpokit train-rm --process --data STEPS.jsonl` and set reward_model.path to it")
    check_reward_model_fits(config)


def check_reward_model_fits(config: Config, trains: bool = False) -> None:
    """A reward model this run trains, of a size its device cannot hold, is a config error naming the
    key that sets its size, before any model loads (the count is a lower bound: the refusal is sure)."""
    rm, spec = config.reward_model, config.reward_model.model
    trains = trains or not rm.path or config.iterative.iterations > 1
    if rm.kind == "none" or not trains or (spec.head == "likelihood" and not rm.path):
        return  # a likelihood head trains two numbers, not its LM
    if rm.path:
        key, parameters = "reward_model.path", checkpoint_parameters(rm.path)
    elif spec.init == "checkpoint":
        key, parameters = "reward_model.model.path", checkpoint_parameters(spec.path)
    elif spec.init == "tiny":
        key = (f"reward_model.model (init=tiny, hidden_size={spec.hidden_size}, num_layers={spec.num_layers}, "
               f"intermediate_size={spec.intermediate_size})")
        parameters = tiny_llama_parameters(spec.hidden_size, spec.num_layers, spec.intermediate_size,
                                           _policy_vocab_size(config))
    else:
        return  # a copy of the policy, which has to fit anyway
    why = training_does_not_fit(parameters or 0, resolve_device(rm.device, "reward_model.device"))
    if why:
        raise ConfigError(f"{key}: the reward model has {why}; make it smaller, or set reward_model.device to a "
                          "device with more memory")


def _policy_vocab_size(config: Config) -> int:
    """The policy's vocabulary size when its config.json is on disk, else 0 (then the tiny reward
    model's count leaves out its embedding and stays a lower bound)."""
    config_file = Path(config.model.name_or_path) / "config.json"
    if not config.model.name_or_path or not config_file.is_file():
        return 0
    return int(json.loads(config_file.read_text()).get("vocab_size") or 0)
