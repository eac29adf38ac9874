"""One config tree of dataclasses: YAML in, `--key=value` overrides, validated before any model loads.

Every field carries a one-line doc, the single source for `--help`, YAML keys and the
config.yaml saved in each run directory. Names follow TRL's GRPOConfig where the concept
is the same (num_generations, max_completion_length, learning_rate, beta, epsilon, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pydantic
import yaml

from grpokit.errors import ConfigError
from grpokit.loggers import TrackerError, check_trackers
from grpokit.math import registry
from grpokit.rewards.registry import reward_function
from grpokit.rollout.registry import ENGINES, engine_spec  # the package import registers every engine


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = default if callable(default) and not isinstance(default, (list, dict)) else (lambda d=default: _copy(d))
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _copy(value):
    import copy

    return copy.deepcopy(value)


@dataclass
class TinyModelConfig:
    architecture: Literal["llama", "qwen2"] = opt("llama", "transformers architecture of the built-in tiny model")
    hidden_size: int = opt(128, "hidden width of the tiny model")
    num_layers: int = opt(4, "transformer blocks of the tiny model")
    num_heads: int = opt(4, "attention heads of the tiny model")
    intermediate_size: int = opt(512, "MLP width of the tiny model")
    alphabet: Literal["arithmetic-tir", "arithmetic", "ascii"] = opt(
        "arithmetic-tir", "characters of its tokenizer: the built-in task's with those of its python programs, "
                          "the built-in task's alone (no TIR), or printable ASCII for text datasets")


@dataclass
class LoraConfig:
    r: int = opt(0, "LoRA rank; 0 = off (full fine-tune)")
    alpha: float = opt(16.0, "LoRA scaling numerator: the update is (alpha / r) B A")
    dropout: float = opt(0.0, "dropout on the LoRA branch's input")
    target_modules: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj"],
                                    "names (last part) of the linear modules that get adapters, e.g. q_proj, "
                                    "gate_proj; ['all-linear'] = every linear layer but the LM head")
    save_merged: bool = opt(False, "also save the merged model (base + adapter) in each checkpoint's merged/")


@dataclass
class ModelConfig:
    name_or_path: str = opt("", "local path or hub id of the policy; empty builds the built-in tiny model")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = opt("auto", "compute dtype (matrix products); auto = bf16 on "
                                                                 "CUDA, fp32 on CPU")
    master_dtype: Literal["fp32", "same"] = opt("fp32", "dtype of trained weights and optimizer state: fp32 (a master "
                                                        "copy; updates below bf16's resolution still land) or same "
                                                        "(= model.dtype, no master copy: less memory, small "
                                                        "updates round away)")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N")
    attn_implementation: Optional[str] = opt(None, "passed to from_pretrained, e.g. sdpa or flash_attention_2")
    trust_remote_code: bool = opt(False, "allow model code from the checkpoint (off unless you trust it)")
    tiny: TinyModelConfig = opt(TinyModelConfig, "the built-in tiny model, used when name_or_path is empty")
    lora: LoraConfig = opt(LoraConfig, "LoRA adapters through PEFT (r > 0); the reference is the base model with "
                                       "the adapters disabled, no second copy")
    gradient_checkpointing: bool = opt(False, "recompute each layer's activations in backward instead of keeping "
                                              "them: less memory, about a third more compute")


@dataclass
class DistributedConfig:
    fsdp: Literal["auto", "on", "off"] = opt(
        "auto", "shard the policy, reference and critic with FSDP2: auto = when torchrun starts more than one "
                "process; on = also with one process under torchrun")
    timeout_s: float = opt(600.0, "seconds a collective waits for the other processes before the run stops "
                                  "with an error (a dead peer never hangs the others)")


@dataclass
class TaskConfig:
    name: str = opt("auto", "the task: auto (math when data names any sources, else chain), a registered task, "
                            "or your own as 'package.module:ClassName'; a named task's own reward replaces the "
                            "default rewards")
    min_ops: int = opt(3, "fewest operations in a chain question")
    max_ops: int = opt(5, "most operations in a chain question")
    max_start: int = opt(20, "largest starting number")
    max_operand: int = opt(9, "largest number added or subtracted")
    max_value: int = opt(20, "intermediate results stay within [0, max_value]")
    heldout_percent: int = opt(10, "share of all questions reserved for evaluation, by a fixed hash")
    num_sft_examples: int = opt(4000, "demonstrations the SFT stage trains on")
    sft_direct_fraction: float = opt(0.5, "share of SFT demonstrations that give only the answer, no steps")
    num_sft_tir_examples: int = opt(500, "tool-integrated SFT demonstrations (a python program prints the answer), "
                                          "on other questions, in addition to num_sft_examples; 0 = none")
    num_rl_questions: int = opt(20000, "questions (answers only) the GRPO stage samples from")
    num_eval_questions: int = opt(500, "held-out questions for evaluation")


@dataclass
class DataSource:
    path: str = opt("", "local JSONL, JSON or Parquet file")
    name: str = opt("", "a Hugging Face datasets name instead of a file (needs grpokit[datasets])")
    subset: str = opt("", "datasets config name, e.g. 'main' for openai/gsm8k")
    split: str = opt("train", "datasets split")
    format: Literal["auto", "gsm8k", "math", "plain"] = opt(
        "auto", "where question and reference live: gsm8k (#### answer), math (boxed / answer field), plain")
    prompt_column: str = opt("", "column holding the question; empty = the format's (question, problem, prompt)")
    answer_column: str = opt("", "column holding the reference; empty = the format's (answer, solution, answer)")
    completion_column: str = opt("completion", "plain format, SFT only: column holding the target completion")
    max_rows: int = opt(0, "use at most this many rows of the source; 0 = all")


@dataclass
class DataConfig:
    sources: list[DataSource] = opt([], "RL prompt sources (files or datasets names); empty = the built-in task")
    sft_sources: list[DataSource] = opt([], "SFT sources with worked solutions; empty = the built-in task")
    eval_sources: list[DataSource] = opt([], "held-out evaluation sources (e.g. a test split); empty = a "
                                             "heldout_fraction of the sources' questions")
    heldout_fraction: float = opt(0.05, "share of the sources' questions held out for evaluation when "
                                        "eval_sources is empty (split by a hash of the question)")
    template: str = opt("cot", "prompt template: cot (DeepSeekMath's step-by-step + \\boxed instruction), none, "
                               "or a custom string containing {question}")
    chat_template: Literal["auto", "on", "off"] = opt(
        "auto", "wrap the prompt in the tokenizer's chat template: auto (when it has one), on, off")
    system_prompt: str = opt("", "optional system message")
    plain_layout: Literal["bare", "user-assistant"] = opt(
        "bare", "a prompt's layout without a chat template: bare (the instruction and a newline) or user-assistant "
                "(DeepSeekMath's \"User: ...\\n\\nAssistant:\")")
    skip_malformed_lines: bool = opt(False, "skip and count malformed lines, missing columns and empty prompts "
                                            "instead of stopping with an error")
    max_prompt_length: int = opt(0, "longest prompt in tokens; 0 = no limit")
    long_prompts: Literal["skip", "truncate", "error"] = opt(
        "skip", "what happens to prompts over max_prompt_length: skip (and count), truncate (keep the end), error"
    )


@dataclass
class SFTConfig:
    learning_rate: float = opt(3e-3, "AdamW learning rate")
    max_steps: int = opt(1500, "optimizer steps")
    batch_size: int = opt(64, "examples per step")
    warmup_steps: int = opt(30, "linear warm-up steps")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    max_tokens_per_micro_batch: int = opt(
        16384, "most tokens (rows x the micro-batch's padded width) per forward/backward; a step accumulates "
               "gradients over micro-batches, so this bounds memory, not results; must be >= the longest example")
    checkpoint: str = opt("", "demo: start RL from this saved pi_SFT instead of training one (compare variants "
                              "on one pi_SFT)")


@dataclass
class GRPOConfig:
    num_generations: int = opt(8, "G, completions sampled per prompt (>= 2)")
    prompts_per_step: int = opt(16, "B, prompts per step; a step trains on B x G completions")
    max_completion_length: int = opt(48, "max new tokens per completion")
    max_steps: int = opt(150, "GRPO steps (each: sample, score, update)")
    learning_rate: float = opt(3e-5, "AdamW learning rate of the policy (1e-4 drifts off and loses reward here)")
    beta: float = opt(0.04, "KL coefficient toward the frozen reference")
    epsilon: float = opt(0.2, "clip range: rho is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = opt(None, "upper clip range (DAPO's clip-higher); None = epsilon")
    num_iterations: int = opt(1, "mu, policy updates per batch of samples; 1 = the paper")
    num_minibatches: int = opt(1, "optimizer steps per policy update; the B x G samples are split into these")
    loss_aggregation: Literal["sequence", "token", "constant"] = opt(
        "sequence", "sequence = eq. 3's per-output mean (TRL loss_type grpo); token = DAPO; constant = Dr. GRPO "
                    "(sum over tokens / (N x max_completion_length))"
    )
    importance_sampling_level: Literal["token", "sequence"] = opt(
        "token", "token = eq. 3's per-token ratio; sequence = GSPO's length-normalised sequence ratio")
    loss: str = opt("clip", "the policy loss, by registered name: clip = eq. 3's clipped surrogate; cispo = "
                            "MiniMax-M1's clipped detached weight x A x logp (every token keeps a gradient)")
    loss_args: dict[str, Any] = opt({}, "arguments of grpo.loss, e.g. cispo: {eps_low: 1.0, eps_high: 0.28} "
                                        "(the defaults: no lower bound)")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and sample fresh questions "
                                        "until the step holds prompts_per_step groups with a spread")
    max_generation_rounds: int = opt(4, "dynamic sampling: most sampling rounds per step; then it trains on what it has")
    scale_rewards: bool = opt(True, "divide advantages by the group std (False = Dr. GRPO)")
    advantage: str = opt("grpo", "the outcome advantage estimator, by registered name: grpo = eq. 5's group-normalised "
                                 "reward; rloo = r minus the mean of the group's other rewards")
    mask_truncated_completions: bool = opt(False, "leave completions without EOS out of the loss")
    temperature: float = opt(0.7, "sampling temperature of the rollouts (the policy trained is the tempered one)")
    top_p: float = opt(1.0, "nucleus sampling threshold")
    micro_batch_size: int = opt(64, "most rows per forward pass (with max_tokens_per_micro_batch, whichever binds "
                                    "first); trades memory for speed, not results")
    max_tokens_per_micro_batch: int = opt(
        16384, "most tokens (rows x the micro-batch's padded width) per forward pass, log-probs and updates "
               "alike; bounds activation memory, not results. 16384 (16 rows of 1k) fits a 7B policy on an "
               "80 GB GPU with model.gradient_checkpointing; must be >= the longest prompt + completion")
    generation_batch_size: int = opt(512, "completions per generate call")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    warmup_steps: int = opt(20, "linear warm-up steps (lets Adam see the gradient noise before full-size steps)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    save_steps: int = opt(0, "save a checkpoint every N steps; 0 = only at the end")
    save_total_limit: int = opt(3, "keep the newest K step checkpoints; 0 = keep all")
    max_failed_steps: int = opt(3, "stop after this many consecutive steps where a reward function failed on every sample")
    max_nonfinite_steps: int = opt(3, "stop after this many consecutive steps whose loss or gradients were NaN/inf "
                                      "(their updates are skipped)")


@dataclass
class PPOConfig:
    critic_learning_rate: float = opt(1e-4, "AdamW learning rate of the critic (its own optimizer)")
    critic_init: str = opt("", "checkpoint to initialise the critic from (e.g. a reward model); empty = the policy")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(0.95, "GAE lambda")
    value_clip: float = opt(0.2, "clip range of the value loss around the rollout-time values")
    whiten_advantages: bool = opt(True, "normalise GAE advantages to zero mean, unit std over the batch's tokens")


@dataclass
class RewardConfig:
    name: str = opt("chain_accuracy", "built-in reward name or 'package.module:function' (the working directory "
                                      "is searched too)")
    weight: float = opt(1.0, "weight of this reward in the sum")
    timeout_s: Optional[float] = opt(60.0, "seconds a call may take before its samples are masked and counted "
                                           "in rewards/timeouts; null = no limit")
    args: dict[str, Any] = opt({}, "keyword arguments of a reward that is made from settings, e.g. overlong_penalty: "
                                   "{max_length: 1024, soft_cache: 256}")


@dataclass
class RewardModelConfig:
    kind: Literal["none", "outcome", "process"] = opt(
        "none", "learned reward: none, outcome (a scalar per completion; outcome supervision) or process "
                "(a score per step; process supervision, eq. 6)")
    path: str = opt("", "trained reward model (from grpokit train-rm); the demo trains one when empty")
    weight: float = opt(1.0, "weight of an outcome reward model's score beside the rule-based rewards")
    step_delimiter: str = opt("\n", "what ends a reasoning step for a process reward model (e.g. \\n\\n, or a tag)")
    device: str = opt("auto", "where the reward model runs: auto, cpu, cuda or cuda:N (may differ from the policy)")
    batch_size: int = opt(64, "completions per reward-model forward pass when scoring")
    learning_rate: float = opt(2e-4, "AdamW learning rate of reward-model training (the paper: 2e-5 at 7B)")
    max_steps: int = opt(400, "optimizer steps of each reward-model training run")
    train_batch_size: int = opt(32, "pairs (outcome) or completions (process) per training step")
    warmup_steps: int = opt(20, "linear warm-up steps of reward-model training")
    heldout_fraction: float = opt(0.1, "share of questions kept out of training to measure accuracy")
    num_questions: int = opt(1000, "questions whose policy samples become reward-model training data")
    samples_per_question: int = opt(8, "policy samples per question, graded by the verifier")
    sample_temperature: float = opt(1.0, "sampling temperature for reward-model data (diversity gives negatives)")
    max_pairs_per_prompt: int = opt(8, "outcome: at most this many (correct, incorrect) pairs per question")
    replay_fraction: float = opt(0.1, "iterative GRPO: share of historical data kept in the replay buffer")
    label: Literal["rule", "rollouts"] = opt(
        "rule", "where process labels come from: rule (the task's step checker) or rollouts (Math-Shepherd: a step "
                "is right when one of label_rollouts completions of its prefix reaches the reference answer)")
    label_rollouts: int = opt(8, "rollouts labels: completions sampled from each step prefix")
    hard_negatives: int = opt(0, "built-in task: one-slip twins added per right training solution (one result off "
                                 "by 1-3, the rest carried on from it): outcome pairs (right, twin), or step labels "
                                 "by the rule; held-out data stays real samples")
    balance_step_labels: bool = opt(False, "process RM: weigh right and wrong steps equally in the loss")
    label_skip_uniform: bool = opt(
        True, "rollouts labels: a question whose samples are all right (or all wrong) gets no rollouts; false "
              "rolls those out too, which labels every step of all-wrong questions at N rollouts per step prefix")


@dataclass
class IterativeConfig:
    iterations: int = opt(1, "iterative GRPO (Algorithm 1): GRPO, then retrain the reward model on fresh policy "
                             "samples with replay, then pi_ref <- pi_theta; grpo.max_steps is split over them")


@dataclass
class RolloutConfig:
    engine: str = opt("hf", "what samples completions, by registered name: hf (transformers' generate) or vllm "
                                              "(a colocated vLLM engine, synced after every optimizer step)")
    kv_cache_gb: Optional[float] = opt(None, "vllm: memory its KV cache may take, in GiB; unset = on CUDA what "
                                             "gpu_memory_utilization leaves after the weights, on CPU 1 GiB")
    gpu_memory_utilization: float = opt(0.5, "vllm on CUDA: the fraction of GPU memory vLLM may take (weights + KV "
                                             "cache), colocated with training; in (0, 1)")
    enforce_eager: Literal["auto", "true", "false"] = opt(
        "auto", "vllm: no CUDA graphs or compilation (faster start, slower decoding); auto = false on CUDA, "
                "true on CPU")
    sleep_mode: bool = opt(True, "vllm on CUDA: free the KV cache during the update (enable_sleep_mode)")
    max_model_len: int = opt(0, "vllm: longest prompt + completion in tokens; 0 = the run's longest prompt + "
                                "grpo.max_completion_length")
    tensor_parallel_size: int = opt(1, "vllm under torchrun: processes (GPUs) that share one engine's weights; "
                                       "must divide the processes per node (torchrun's --nproc_per_node)")
    is_correction: str = opt(
        "none", "tis: reweight each token by min(pi_old / pi_sampler, cap) (truncated importance sampling); "
                "icepop: drop the policy term of tokens whose pi_old / pi_sampler leaves [low, high] (is_args); "
                "for an engine whose log-probs differ from the trainer's")
    is_cap: float = opt(2.0, "tis: the cap C of its weight; the older key for rollout.is_args: {cap: C}, which wins")
    is_args: dict[str, Any] = opt({}, "arguments of rollout.is_correction, e.g. tis: {cap: 2.0}, icepop: "
                                      "{low: 0.5, high: 2.0} (the defaults)")

    def correction_args(self) -> dict[str, Any]:
        """is_args as rollout.is_correction receives them: for tis, is_cap is its cap unless is_args names one."""
        return {**({"cap": self.is_cap} if self.is_correction == "tis" else {}), **self.is_args}


@dataclass
class EvalConfig:
    before: bool = opt(True, "evaluate the held-out questions before training too (the before/after table)")
    k: int = opt(8, "samples per question for pass@k and maj@k")
    temperature: float = opt(0.7, "sampling temperature for pass@k / maj@k")
    batch_size: int = opt(512, "completions per generate call")
    tir: bool = opt(True, "also evaluate with tool-integrated reasoning (the built-in task: its programs run in "
                          "grpokit.sandbox), for a CoT/TIR before/after table")
    max_tool_calls: int = opt(2, "TIR: rounds of generation, each may end in a program (DeepSeekMath: 2)")
    tool_timeout_s: float = opt(10.0, "TIR: wall-clock limit of each program in seconds")


@dataclass
class Config:
    output_dir: str = opt("", "run directory: config.yaml, metrics.jsonl, checkpoints, plots. Default: "
                              "runs/<command>, or runs/<command>-N when that holds a run")
    seed: int = opt(0, "seed for data, initialisation and sampling")
    algo: Literal["grpo", "ppo"] = opt("grpo", "grpo, or the ppo baseline (critic + GAE, KL in the reward; "
                                               "shares sampling, lr, epsilon and beta with the grpo section)")
    model: ModelConfig = opt(ModelConfig, "the policy (and frozen reference) model")
    task: TaskConfig = opt(TaskConfig, "which task, and the shape of the built-in chain-arithmetic task")
    data: DataConfig = opt(DataConfig, "RL prompts from a file instead of the built-in task")
    sft: SFTConfig = opt(SFTConfig, "supervised fine-tuning that produces pi_SFT")
    grpo: GRPOConfig = opt(GRPOConfig, "the GRPO stage")
    ppo: PPOConfig = opt(PPOConfig, "PPO-only settings, used when algo=ppo")
    rewards: list[RewardConfig] = opt([RewardConfig()], "rule-based reward functions and their weights "
                                                          "(may be [] when a reward model gives the reward)")
    reward_model: RewardModelConfig = opt(RewardModelConfig, "a learned outcome or process reward model")
    iterative: IterativeConfig = opt(IterativeConfig, "iterative GRPO: refresh the reward model between iterations")
    rollout: RolloutConfig = opt(RolloutConfig, "the rollout engine that samples completions")
    eval: EvalConfig = opt(EvalConfig, "evaluation before and after RL")
    distributed: DistributedConfig = opt(DistributedConfig, "several processes under torchrun (data parallel, "
                                                            "FSDP2); ignored in one process")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = opt(
        [], "experiment trackers to log every step to, beside metrics.jsonl (each an extra: pip install "
            "'grpokit[wandb]' ...)")
    stages: list[Literal["sft", "train"]] = opt(["train"], "what `grpokit demo` runs: sft (train pi_SFT on the "
                                                           "task's demonstrations), then train (RL from it)")


def _forbid_unknown_keys(cls) -> None:
    """Every section of the tree refuses keys it does not define (a typo is an error, never ignored)."""
    cls.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
    for tp in typing.get_type_hints(cls).values():
        for inner in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(inner):
                _forbid_unknown_keys(inner)


_forbid_unknown_keys(Config)

# --------------------------------------------------------------------------- loading
# pydantic validates the dataclass tree (types, Literals, nested sections, unknown keys); its
# errors are re-worded here so a message names the dotted key and says what was expected.

_EXPECTED = {"int": "expected an integer", "float": "expected a number", "bool": "expected true or false",
             "string": "expected a string", "list": "expected a list", "dataclass": "expected a mapping of keys",
             "dict": "expected a mapping of keys", "none": "expected null"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _dotted(loc: tuple) -> str:
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif not part[:1].isupper() and part not in ("function-after", "tagged-union"):  # skip pydantic's type tags
            key += f".{part}" if key else part
    return key


def _config_error(err: pydantic.ValidationError, cls) -> ConfigError:
    """The first validation error, named by its dotted key, with a 'did you mean' for unknown keys."""
    first = err.errors(include_url=False)[0]
    key, kind, value = _dotted(first["loc"]), first["type"], first.get("input")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent, _, leaf = key.rpartition(".")
        section = cls
        for part in filter(None, parent.split(".")):  # down to the section (a list's item type for [i])
            tp = typing.get_type_hints(section)[part.split("[")[0]]
            section = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        names = [f.name for f in dataclasses.fields(section)]
        close = difflib.get_close_matches(leaf, names, n=1)
        hint = f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else \
            f"; valid keys: {', '.join(names)}"
        return ConfigError(f"unknown config key '{key}'{hint}")
    if kind == "literal_error":  # pydantic says "'a', 'b' or 'c'"
        choices = re.findall(r"'([^']*)'", first["ctx"]["expected"])
        return ConfigError(f"{key}: {value!r} is not one of {choices}")
    expected = next((text for name, text in _EXPECTED.items() if kind.startswith(name)), first["msg"])
    return ConfigError(f"{key}: {expected}, got {type(value).__name__} {value!r}")


def from_dict(cls, data: dict):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {data!r}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(_yaml_switches(cls, data))
    except pydantic.ValidationError as err:
        error = _config_error(err, cls)
        error.key = _dotted(err.errors(include_url=False)[0]["loc"])
        raise error from None


def _yaml_switches(cls, data):
    """`data` with the booleans YAML makes of on/off (and yes/no) turned back into "on"/"off" where
    the key takes those words: `distributed.fsdp: on` and `--distributed.fsdp=on` mean "on". A
    single name where a list of names goes is that list: `report_to: tensorboard` = [tensorboard]."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return data
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        tp = hints.get(key)
        if isinstance(value, bool) and typing.get_origin(tp) is Literal and {"on", "off"} <= set(typing.get_args(tp)):
            value = "on" if value else "off"
        elif isinstance(value, str) and value and _is_list_of_names(tp):
            value = [value]
        elif dataclasses.is_dataclass(tp):
            value = _yaml_switches(tp, value)
        out[key] = value
    return out


def _is_list_of_names(tp) -> bool:
    """list[str] or list[Literal[...]]: a list whose items are plain words."""
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
    return item is str or typing.get_origin(item) is Literal


def _leaf_paths(cls, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> (field, type) for every leaf of the tree."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_paths(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (f, tp)
    return out


def resolve_key(key: str, cls=Config) -> str:
    """A dotted key, or a bare leaf name when it is unique in the tree (`beta` -> `grpo.beta`)."""
    paths = _leaf_paths(cls)
    if key in paths:
        return key
    matches = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"override --{key} is ambiguous: write one of {', '.join('--' + m for m in matches)}")
    leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
    close = difflib.get_close_matches(key, list(paths), n=1) or [
        leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1)
    ]
    raise ConfigError(f"unknown config key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))


def apply_overrides(data: dict, overrides: list[str], cls=Config) -> dict:
    """Apply `--key=value` (or `key=value`) overrides to a raw mapping; values are YAML scalars."""
    data = _copy(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} must look like --key=value")
        key, raw = text.split("=", 1)
        path = resolve_key(key.strip(), cls).split(".")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
        node[path[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None, cls=Config):
    """Config from optional YAML files (later files override earlier ones, key by key) plus
    overrides, fully validated."""
    data: dict = {}
    paths = [p for p in (path if isinstance(path, list) else [path]) if p is not None]
    for p in map(Path, paths):
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            layer = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML ({err})") from err
        if not isinstance(layer, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of config keys")
        data = _merge(data, layer)
    data = apply_overrides(data, overrides or [], cls)
    try:
        config = from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(_with_source(err, paths, overrides or [], cls)) from None
    validate(config)
    return config


def _with_source(err: ConfigError, paths: list, overrides: list[str], cls) -> str:
    """The error with where the bad value came from: the command-line override that set its key
    (the last one wins, as in apply_overrides), else the YAML file."""
    key = err.key
    for item in reversed(overrides):
        try:
            dotted = resolve_key(item.removeprefix("--").split("=", 1)[0].strip(), cls)
        except ConfigError:
            continue
        if key == dotted or key.startswith((dotted + ".", dotted + "[")):
            return f"{err} (from the command-line override {item})"
    return f"{paths[-1]}: {err}" if paths else str(err)


def _merge(base: dict, layer: dict) -> dict:
    out = dict(base)
    for key, value in layer.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# Values that only make sense above 0 (a rate, a clipping norm, a sampling temperature) ...
POSITIVE_KEYS = ("sft.learning_rate", "grpo.learning_rate", "ppo.critic_learning_rate", "reward_model.learning_rate",
                 "sft.max_grad_norm", "grpo.max_grad_norm", "eval.temperature", "reward_model.sample_temperature")
# ... counts of steps, rows or samples, where 0 would mean nothing runs ...
COUNT_KEYS = ("sft.max_steps", "sft.batch_size", "grpo.generation_batch_size", "eval.batch_size",
              "reward_model.batch_size", "reward_model.train_batch_size", "reward_model.max_steps",
              "reward_model.num_questions", "reward_model.samples_per_question", "reward_model.max_pairs_per_prompt")
# ... and values where 0 is meaningful (no warm-up, no decay) but a negative one is not.
NON_NEGATIVE_KEYS = ("sft.warmup_steps", "grpo.warmup_steps", "reward_model.warmup_steps", "sft.weight_decay",
                     "grpo.weight_decay")


def _value(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _bound_checks(config: Config) -> list[tuple[bool, str]]:
    """(ok, message) for every key of POSITIVE_KEYS, COUNT_KEYS and NON_NEGATIVE_KEYS."""
    bounds = [(POSITIVE_KEYS, "> 0", lambda v: v > 0), (COUNT_KEYS, ">= 1", lambda v: v >= 1),
              (NON_NEGATIVE_KEYS, ">= 0", lambda v: v >= 0)]
    defaults = Config()
    return [(test(_value(config, key)), f"{key} must be {bound}, got {_value(config, key):g} (the default is "
                                        f"{_value(defaults, key):g})")
            for keys, bound, test in bounds for key in keys]


def validate(config: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    g = config.grpo
    checks = [*_bound_checks(config),
        (g.num_generations >= 2, f"grpo.num_generations must be >= 2 to form a group, got {g.num_generations}"),
        (g.prompts_per_step >= 1, f"grpo.prompts_per_step must be >= 1, got {g.prompts_per_step}"),
        (g.num_iterations >= 1, f"grpo.num_iterations must be >= 1, got {g.num_iterations}"),
        (1 <= g.num_minibatches <= g.prompts_per_step * g.num_generations,
         f"grpo.num_minibatches must lie in [1, prompts_per_step x num_generations], got {g.num_minibatches}"),
        (g.temperature > 0, f"grpo.temperature must be > 0 for sampling, got {g.temperature}"),
        (0 < g.top_p <= 1, f"grpo.top_p must lie in (0, 1], got {g.top_p}"),
        (0 <= g.epsilon < 1, f"grpo.epsilon must lie in [0, 1), got {g.epsilon}"),
        (g.epsilon_high is None or g.epsilon_high >= 0, f"grpo.epsilon_high must be >= 0, got {g.epsilon_high}"),
        (g.beta >= 0, f"grpo.beta must be >= 0, got {g.beta}"),
        (0 <= config.ppo.lam <= 1 and 0 <= config.ppo.gamma <= 1, "ppo.gamma and ppo.lam must lie in [0, 1]"),
        (config.ppo.value_clip > 0, f"ppo.value_clip must be > 0, got {config.ppo.value_clip}"),
        (g.max_completion_length >= 1, f"grpo.max_completion_length must be >= 1, got {g.max_completion_length}"),
        (g.micro_batch_size >= 1, f"grpo.micro_batch_size must be >= 1, got {g.micro_batch_size}"),
        (g.max_tokens_per_micro_batch >= g.max_completion_length + max(1, config.data.max_prompt_length),
         f"grpo.max_tokens_per_micro_batch={g.max_tokens_per_micro_batch} is smaller than the longest row, "
         f"{g.max_completion_length + max(1, config.data.max_prompt_length)} tokens (grpo.max_completion_length "
         f"+ data.max_prompt_length, or 1 prompt token when that is 0): raise it to at least that"),
        (config.sft.max_tokens_per_micro_batch >= 1,
         f"sft.max_tokens_per_micro_batch must be >= 1, got {config.sft.max_tokens_per_micro_batch}"),
        (g.max_failed_steps >= 1, f"grpo.max_failed_steps must be >= 1, got {g.max_failed_steps}"),
        (g.max_nonfinite_steps >= 1, f"grpo.max_nonfinite_steps must be >= 1, got {g.max_nonfinite_steps}"),
        (g.save_steps >= 0, f"grpo.save_steps must be >= 0, got {g.save_steps}"),
        (g.save_total_limit >= 0, f"grpo.save_total_limit must be >= 0, got {g.save_total_limit}"),
        (bool(config.rewards) or config.reward_model.kind != "none",
         "rewards must name at least one reward function, or reward_model.kind must name a reward model"),
        (config.reward_model.kind != "process" or config.algo == "grpo",
         "process supervision (reward_model.kind=process) needs algo=grpo: PPO's critic takes one scalar reward"),
        (config.reward_model.step_delimiter != "", "reward_model.step_delimiter must not be empty"),
        (config.reward_model.kind != "process" or g.scale_rewards,
         "grpo.scale_rewards=false is not defined for process supervision: eq. 6 normalises step rewards by "
         "their group std"),
        (0 <= config.reward_model.replay_fraction <= 1, "reward_model.replay_fraction must lie in [0, 1]"),
        (0 < config.reward_model.heldout_fraction < 1, "reward_model.heldout_fraction must lie in (0, 1)"),
        (config.reward_model.label_rollouts >= 1, "reward_model.label_rollouts must be >= 1"),
        (config.reward_model.hard_negatives >= 0, "reward_model.hard_negatives must be >= 0"),
        (config.reward_model.hard_negatives == 0 or not (config.data.sources or config.data.sft_sources),
         "reward_model.hard_negatives needs the built-in task, whose rule makes and labels the one-slip twins: "
         "set it to 0 for data.sources"),
        (config.iterative.iterations >= 1, f"iterative.iterations must be >= 1, got {config.iterative.iterations}"),
        (config.iterative.iterations == 1 or config.reward_model.kind != "none",
         "iterative.iterations > 1 refreshes a reward model: set reward_model.kind to outcome or process"),
        (config.grpo.max_steps >= config.iterative.iterations,
         "grpo.max_steps must be at least iterative.iterations (the steps are split over the iterations)"),
        (all(r.timeout_s is None or r.timeout_s > 0 for r in config.rewards), "rewards[].timeout_s must be > 0 or null"),
        (config.data.max_prompt_length >= 0, f"data.max_prompt_length must be >= 0, got {config.data.max_prompt_length}"),
        (config.eval.k >= 1, f"eval.k must be >= 1, got {config.eval.k}"),
        (config.eval.max_tool_calls >= 1, f"eval.max_tool_calls must be >= 1, got {config.eval.max_tool_calls}"),
        (config.eval.tool_timeout_s > 0, f"eval.tool_timeout_s must be > 0, got {config.eval.tool_timeout_s}"),
        (config.task.num_sft_tir_examples >= 0,
         f"task.num_sft_tir_examples must be >= 0, got {config.task.num_sft_tir_examples}"),
        (config.task.num_sft_tir_examples == 0 or config.model.name_or_path or config.model.tiny.alphabet != "arithmetic",
         "task.num_sft_tir_examples > 0 writes python programs, which model.tiny.alphabet=arithmetic cannot spell: "
         "use model.tiny.alphabet=arithmetic-tir, or task.num_sft_tir_examples=0"),
        (0 <= config.data.heldout_fraction < 1, "data.heldout_fraction must lie in [0, 1)"),
        (g.max_generation_rounds >= 1, f"grpo.max_generation_rounds must be >= 1, got {g.max_generation_rounds}"),
        (config.rollout.is_cap > 0, f"rollout.is_cap must be > 0, got {config.rollout.is_cap}"),
        (config.rollout.kv_cache_gb is None or config.rollout.kv_cache_gb > 0,
         f"rollout.kv_cache_gb must be > 0 (or unset), got {config.rollout.kv_cache_gb}"),
        (0 < config.rollout.gpu_memory_utilization < 1,
         f"rollout.gpu_memory_utilization must lie in (0, 1), got {config.rollout.gpu_memory_utilization}: it is the "
         f"fraction of GPU memory vLLM takes beside training, e.g. 0.5"),
        (config.rollout.max_model_len == 0 or config.rollout.max_model_len > g.max_completion_length,
         f"rollout.max_model_len={config.rollout.max_model_len} leaves no room for a prompt before "
         f"grpo.max_completion_length={g.max_completion_length} tokens: raise it, or set 0 for the run's longest "
         f"prompt + grpo.max_completion_length"),
        (config.model.lora.r >= 0, f"model.lora.r must be >= 0 (0 = off), got {config.model.lora.r}"),
        (0 <= config.model.lora.dropout < 1, f"model.lora.dropout must lie in [0, 1), got {config.model.lora.dropout}"),
        (config.model.lora.r == 0 or bool(config.model.lora.target_modules),
         "model.lora.target_modules must name at least one module (or ['all-linear'])"),
        (config.model.lora.r == 0 or config.iterative.iterations == 1,
         "iterative.iterations > 1 resets pi_ref to pi_theta, which LoRA's reference (the base model under the "
         "adapters) cannot follow: use model.lora.r=0"),
        (config.distributed.timeout_s > 0, f"distributed.timeout_s must be > 0, got {config.distributed.timeout_s}"),
        (config.rollout.tensor_parallel_size >= 1,
         f"rollout.tensor_parallel_size must be >= 1, got {config.rollout.tensor_parallel_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_loss_pieces(config)
    _check_engine(config.rollout)
    if config.model.lora.r > 0 and importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora.r > 0 needs peft: pip install 'grpokit[peft]'")
    try:
        check_trackers(config.report_to)  # a missing tracker package, before any model loads
    except TrackerError as err:
        raise ConfigError(str(err)) from None
    _check_task(config)
    _check_rewards(config)


def _check_task(config: Config) -> None:
    """task.name names a task, before any model loads. A named task's own reward replaces the
    default rewards (chain_accuracy, which would score its answers by chain's rule), and naming
    another task's reward is refused."""
    # tasks sit above config (they import it, through eval): the one import against the layers,
    # listed in pyproject.toml's ignore_imports; in here so that importing config does not cycle
    from grpokit.tasks.registry import TASKS, task_class

    name = config.task.name
    if name == "auto":
        return
    try:
        cls = task_class(name)
    except ValueError as err:
        raise ConfigError(f"task.name: {err}") from None
    if cls.reward and config.rewards == [RewardConfig()]:
        config.rewards = [RewardConfig(name=cls.reward)]
    graders = {t.reward: t.name for t in TASKS.values() if t is not cls and t.reward and t.reward != cls.reward}
    for i, reward in enumerate(config.rewards):
        if reward.name in graders:
            fix = f"--rewards='[{{name: {cls.reward}}}]'" if cls.reward else "a reward that grades it"
            raise ConfigError(f"rewards[{i}]: {reward.name} grades the {graders[reward.name]} task, not "
                              f"task.name={name}: use {fix}")


def _check_engine(rollout: RolloutConfig) -> None:
    """rollout.engine names a registered engine whose package is installed, and the engine keys suit it."""
    try:
        spec = engine_spec(rollout.engine)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if spec.package and importlib.util.find_spec(spec.package) is None:
        raise ConfigError(f"rollout.engine={spec.name} but {spec.package} is not installed: {spec.install} "
                          f"(or use rollout.engine=hf)")
    if rollout.tensor_parallel_size > 1 and not spec.tensor_parallel:
        tp_engines = sorted(name for name, other in ENGINES.items() if other.tensor_parallel)
        raise ConfigError(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} applies to rollout.engine="
                          f"{' or '.join(tp_engines)} only (rollout.engine={rollout.engine}): set it to 1, or use "
                          f"the {' or '.join(tp_engines)} engine")


def _check_loss_pieces(config: Config) -> None:
    """grpo.loss and rollout.is_correction name registered pieces, and their arguments suit them."""
    try:
        registry.check_args(registry.policy_loss(config.grpo.loss), config.grpo.loss_args, "grpo.loss_args")
        registry.advantage(config.grpo.advantage)
        if config.grpo.loss != "clip" and config.grpo.importance_sampling_level != "token":
            raise ValueError(f"grpo.importance_sampling_level={config.grpo.importance_sampling_level} applies to "
                             f"grpo.loss=clip; grpo.loss={config.grpo.loss} uses per-token ratios: set it to token")
        r = config.rollout
        if r.is_correction != "none":
            registry.check_args(registry.is_correction(r.is_correction), r.correction_args(), "rollout.is_args")
        elif r.is_args:
            raise ValueError(f"rollout.is_args={r.is_args} but rollout.is_correction=none: name the correction "
                             f"they are for, or drop them")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_rewards(config: Config) -> None:
    """Every reward names a function that exists and can be made, before any model loads (a typo
    would otherwise surface only after the policy has loaded, minutes in for a 7B model)."""
    for i, reward in enumerate(config.rewards):
        try:
            reward_function(reward.name, reward.args)
        except ValueError as err:
            raise ConfigError(f"rewards[{i}]: {err}") from None


def check_world_size(config: Config, world_size: int, per_node: int | None = None) -> None:
    """Multi-process runs (torchrun): checks that need the world size (and `per_node`, the processes
    on each machine, torchrun's LOCAL_WORLD_SIZE; default all of them), before any model loads."""
    tp, per_node = config.rollout.tensor_parallel_size, per_node or world_size
    if tp > 1 and (world_size <= 1 or per_node % tp):
        raise ConfigError(
            f"rollout.tensor_parallel_size={tp} does not divide the {per_node if world_size > 1 else 1} "
            f"process(es) per node of this run: one vLLM engine spans {tp} processes (GPUs) of one machine, so "
            f"start torchrun with --nproc_per_node a multiple of {tp}, or lower rollout.tensor_parallel_size")
    if world_size <= 1:
        return
    g = config.grpo
    if g.prompts_per_step % world_size:
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} does not split into whole groups over {world_size} "
            f"processes (the world size): set grpo.prompts_per_step to a multiple of {world_size}, or start "
            f"torchrun with a --nproc_per_node that divides {g.prompts_per_step}")
    if config.distributed.fsdp == "off":
        raise ConfigError(f"distributed.fsdp=off with {world_size} processes would train {world_size} separate "
                          "models (nothing sums their gradients): set distributed.fsdp to auto or on")
    unsupported = [
        (g.dynamic_sampling, "grpo.dynamic_sampling"),
        (config.reward_model.kind != "none", "reward_model.kind (learned reward models)"),
        (config.iterative.iterations > 1, "iterative.iterations > 1"),
    ]
    for on, key in unsupported:
        if on:
            raise ConfigError(f"{key} is not supported under torchrun with {world_size} processes yet; "
                              "run it in one process")


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def describe(cls=Config, defaults=None, notes: dict[str, str] | None = None) -> str:
    """Every key with its type, default and one-line doc, for --help. `defaults`: a config whose
    values to show as the defaults (a preset's) instead of the dataclasses' own; `notes`: text to
    add to a dotted key's doc (what only the caller knows, e.g. the registered reward names)."""
    lines = []
    defaults = to_dict(cls() if defaults is None else defaults)
    for key, (f, tp) in _leaf_paths(cls).items():
        node = defaults
        for part in key.split("."):
            node = node[part]
        doc = " ".join(filter(None, [f.metadata.get("help", ""), (notes or {}).get(key, "")]))
        lines.append(f"  --{key}={node!r}  [{_type_name(tp)}]\n      {doc}")
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):  # document each item's keys too
            for sub in dataclasses.fields(item):
                lines.append(f"        {sub.name}: {getattr(item(), sub.name)!r}  {sub.metadata.get('help', '')}")
    return "\n".join(lines)


# Keys a resumed run may change without changing what it computes; any other difference is refused.
RESUME_SAFE_KEYS = (
    "output_dir", "grpo.max_steps", "grpo.save_steps", "grpo.save_total_limit", "grpo.micro_batch_size",
    "grpo.max_tokens_per_micro_batch", "grpo.generation_batch_size", "grpo.max_failed_steps",
    "grpo.max_nonfinite_steps", "sft.max_tokens_per_micro_batch", "model.device",
    "model.attn_implementation", "eval.", "reward_model.device", "reward_model.batch_size", "stages", "report_to",
    "rollout.kv_cache_gb", "rollout.gpu_memory_utilization", "rollout.enforce_eager", "distributed.timeout_s",
    "model.gradient_checkpointing",
)


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}


def resume_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every key that differs and matters for an exact resume. A key
    added to grpokit after the run was saved compares as its default (a run from an older version
    still resumes), whenever the saved config still reads as one."""
    try:
        saved = to_dict(from_dict(Config, saved))
    except ConfigError:  # a key since removed or renamed: compare the files as written
        pass
    a, b = _flatten(saved), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>") and not any(
            key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in RESUME_SAFE_KEYS
        ):
            out.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out
