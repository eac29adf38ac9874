"""The config tree's sections: one dataclass each, every field with a one-line doc, and each
section's own rules (`problems()`) next to its fields. The rules that span sections are in
grpokit.config.validation; reading YAML and overrides is grpokit.config.loading's."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pydantic

# The chain task's shape, data.arithmetic.ChainSpec's defaults (tests/test_config.py holds them equal): the
# config, a leaf below the tasks and their data, imports nothing of data/.
_CHAIN = types.SimpleNamespace(min_ops=3, max_ops=5, max_start=20, max_operand=9, max_value=20, heldout_percent=10)


def _is_address(text: str) -> bool:
    """HOST:PORT with a port in 0..65535."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = default if callable(default) and not isinstance(default, (list, dict)) else (
            lambda d=default: copy.deepcopy(d))
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def failed(checks: Iterable[tuple[bool, str]]) -> Iterator[str]:
    """The message of every (ok, message) pair that is not ok, in order."""
    return (message for ok, message in checks if not ok)


def _interval_test(interval: str) -> Callable[[float], bool]:
    """The test for membership of an interval written as "[0, 1)", "(0, 1]", ..."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    above = (lambda v: v >= low) if interval[0] == "[" else (lambda v: v > low)
    below = (lambda v: v <= high) if interval[-1] == "]" else (lambda v: v < high)
    return lambda v: above(v) and below(v)


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _bounds(section, key: str, positive: tuple[str, ...] = (), counts: tuple[str, ...] = (),
            non_negative: tuple[str, ...] = (), within: dict[str, str] | None = None) -> list[tuple[bool, str]]:
    """(ok, message) for the fields of `section` (at dotted `key`) that only make sense above 0 (a
    rate, a clipping norm, a sampling temperature), the counts of steps, rows or samples (where 0
    would mean nothing runs), those where 0 is meaningful (no warm-up, no decay) but a negative
    value is not, and those `within` an interval ("[0, 1)"). An unset (None) field passes. A bound
    whose message must say what a value means ("0 = off") is written out beside the call instead."""
    rules = [(name, "be > 0", lambda v: v > 0) for name in positive]
    rules += [(name, "be >= 1", lambda v: v >= 1) for name in counts]
    rules += [(name, "be >= 0", lambda v: v >= 0) for name in non_negative]
    rules += [(name, f"lie in {interval}", _interval_test(interval)) for name, interval in (within or {}).items()]
    defaults = type(section)()
    return [(getattr(section, name) is None or test(getattr(section, name)),
             f"{key}.{name} must {rule}, got {_shown(getattr(section, name))} (the default is "
             f"{_shown(getattr(defaults, name))})") for name, rule, test in rules]


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

    def problems(self) -> Iterator[str]:
        """This section's own rules: a message for each value that cannot work."""
        yield from failed([
            *_bounds(self, "model.lora", within={"dropout": "[0, 1)"}),
            (self.r >= 0, f"model.lora.r must be >= 0 (0 = off), got {self.r}"),  # with what 0 means
            (self.r == 0 or bool(self.target_modules),
             "model.lora.target_modules must name at least one module (or ['all-linear'])"),
        ])
        if self.r > 0 and importlib.util.find_spec("peft") is None:
            yield "model.lora.r > 0 needs peft: pip install 'grpokit[peft]'"


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
    eos_token: str = opt("", "the token that ends a completion; empty = the chat template's end-of-turn token when "
                             "prompts use the template (ChatML: <|im_end|>), else the tokenizer's EOS")

    def problems(self) -> Iterator[str]:
        """This section's own rules (those of model.lora; model.tiny has none)."""
        return self.lora.problems()


@dataclass
class DistributedConfig:
    fsdp: Literal["auto", "on", "off"] = opt(
        "auto", "shard the policy, reference and critic with FSDP2: auto = when torchrun starts more than one "
                "process; on = also with one process under torchrun")
    timeout_s: float = opt(600.0, "seconds a collective waits for the other processes before the run stops "
                                  "with an error (a dead peer never hangs the others)")
    launcher: Literal["torchrun", "ray"] = opt(
        "torchrun", "who places the rollout workers and carries their tasks, results and weights: torchrun = "
                    "processes this trainer spawns (or `grpokit rollout-worker`s) over its TCP store; ray = Ray "
                    "actors in a placement group, over Ray's object store (pip install 'grpokit[ray]'; "
                    "docs/guides/ray.md)")
    ranks: int = opt(
        1, "with launcher=ray: the trainer's processes, each a Ray actor in one placement group (data parallel, "
           "FSDP2 from 2 on; torchrun's --nproc_per_node). 1 = this process trains")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "distributed", positive=("timeout_s",), counts=("ranks",)),
            (self.ranks == 1 or self.launcher == "ray",
             f"distributed.ranks={self.ranks} asks Ray to start the trainer's processes: set distributed.launcher=ray, "
             f"or leave distributed.ranks at 1 and start the processes with torchrun --nproc_per_node={self.ranks}"),
        ])


@dataclass
class TaskConfig:
    # the chain task's shape defaults to data.arithmetic.ChainSpec's (_CHAIN above)
    name: str = opt("auto", "the task: auto (math when data names any sources, else chain), a registered task, "
                            "or your own as 'package.module:ClassName'; the task's own reward (auto's too) replaces "
                            "the default rewards")
    min_ops: int = opt(_CHAIN.min_ops, "fewest operations in a chain question")
    max_ops: int = opt(_CHAIN.max_ops, "most operations in a chain question")
    max_start: int = opt(_CHAIN.max_start, "largest starting number")
    max_operand: int = opt(_CHAIN.max_operand, "largest number added or subtracted")
    max_value: int = opt(_CHAIN.max_value, "intermediate results stay within [0, max_value]")
    heldout_percent: int = opt(_CHAIN.heldout_percent, "share of all questions reserved for evaluation, by a fixed hash")
    validation_percent: int = opt(5, "the next share of all questions, by the same hash, kept out of training to "
                                     "choose settings on (held-out numbers are reported, never chosen on); 0 = none")
    num_sft_examples: int = opt(4000, "demonstrations the SFT stage trains on")
    sft_direct_fraction: float = opt(0.5, "share of SFT demonstrations that give only the answer, no steps")
    num_sft_tir_examples: int = opt(500, "tool-integrated SFT demonstrations (a python program prints the answer), "
                                          "on other questions, in addition to num_sft_examples; 0 = none")
    num_rl_questions: int = opt(20000, "questions (answers only) the GRPO stage samples from")
    num_eval_questions: int = opt(500, "held-out questions for evaluation")
    num_validation_questions: int = opt(200, "validation questions (at most num_eval_questions), evaluated "
                                             "greedily before and after RL (summary.json's validation); 0 = none")
    prompt_modes: dict[str, float] = opt({"cot": 1.0}, "share of RL prompts in each mode, by a fixed hash of the "
                                                       "question: cot (chain-of-thought), tir (the task's "
                                                       "tool-integrated prompts, with rollout.tool), e.g. "
                                                       "{cot: 0.5, tir: 0.5}")

    def resolved_name(self, data: "DataConfig") -> str:
        """task.name with auto resolved: the files' math questions when `data` names any, else chain."""
        if self.name != "auto":
            return self.name
        return "math" if data.sources or data.sft_sources or data.eval_sources else "chain"

    def problems(self) -> Iterator[str]:
        """This section's own rules (task.name is checked with the rewards, in grpokit.checks)."""
        modes = self.prompt_modes
        yield from failed([
            *_bounds(self, "task", non_negative=("num_sft_tir_examples", "validation_percent",
                                                 "num_validation_questions")),
            (self.heldout_percent + self.validation_percent < 100,
             f"task.heldout_percent ({self.heldout_percent}) + task.validation_percent ({self.validation_percent}) "
             f"leave no questions to train on: their sum must stay under 100"),
            (set(modes) <= {"cot", "tir"}, f"task.prompt_modes takes the modes cot and tir, got {sorted(modes)}"),
            (all(share >= 0 for share in modes.values()) and sum(modes.values()) > 0,
             f"task.prompt_modes' shares must be >= 0 and not all 0, got {modes}"),
        ])


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
    validation_fraction: float = opt(0.05, "the next share of the sources' questions, by the same hash, kept out "
                                           "of training to choose settings on and evaluated greedily before and "
                                           "after RL (summary.json's validation); 0 = none")
    template: str = opt("cot", "prompt template: cot (DeepSeekMath's step-by-step + \\boxed instruction), none, "
                               "or a custom string containing {question}")
    chat_template: Literal["auto", "on", "off"] = opt(
        "auto", "wrap the prompt in the tokenizer's chat template: auto (when it has one), on, off")
    chat_template_file: str = opt("", "a Jinja chat template file the tokenizer uses instead of its own (or as its "
                                      "only one: conversational prompts need one); empty = the tokenizer's")
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

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "data", non_negative=("max_prompt_length",),
                     within={"heldout_fraction": "[0, 1)", "validation_fraction": "[0, 1)"}),
            (self.heldout_fraction + self.validation_fraction < 1,
             f"data.heldout_fraction ({self.heldout_fraction}) + data.validation_fraction "
             f"({self.validation_fraction}) leave no questions to train on: their sum must stay under 1"),
        ])


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
    mask_tool_output: bool = opt(True, "leave tool output blocks in tool-integrated demonstrations (after "
                                       "```output, the block of rollout.tool, else python) out of the loss, as ToRA "
                                       "and the RL loss do; false trains on them as text")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "sft", positive=("learning_rate", "max_grad_norm"),
                     counts=("max_steps", "batch_size", "max_tokens_per_micro_batch"),
                     non_negative=("warmup_steps", "weight_decay")),
        ])


@dataclass
class GRPOConfig:
    num_generations: int = opt(8, "G, completions sampled per prompt (>= 2)")
    prompts_per_step: int = opt(16, "B, prompts per step; a step trains on B x G completions")
    max_completion_length: int = opt(96, "max new tokens per completion; a tool-integrated completion's rounds and "
                                         "tool output count together (the built-in task's need about 60)")
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
    process_advantage: str = opt("grpo", "the process advantage estimator (step scores), by registered name: grpo = "
                                         "eq. 6's sum over the steps at or after each token; step = the token's own "
                                         "step only; per_completion = eq. 6 / the completion's steps; "
                                         "process_outcome = eq. 6 + eq. 5 of the last step's reward")
    mask_truncated_completions: bool = opt(False, "leave completions without EOS out of the loss")
    temperature: float = opt(0.7, "sampling temperature of the rollouts (the policy trained is the tempered one)")
    top_p: float = opt(1.0, "nucleus sampling threshold")
    micro_batch_size: int = opt(64, "most rows per forward pass (with max_tokens_per_micro_batch, whichever binds "
                                    "first); trades memory for speed, not results")
    max_tokens_per_micro_batch: int = opt(
        16384, "most tokens (rows x the micro-batch's padded width) per forward pass, log-probs and updates "
               "alike; bounds activation memory, not results. 16384 (16 rows of 1k) fits a 7B policy on an "
               "80 GB GPU with model.gradient_checkpointing; must be >= the longest prompt + completion")
    pack_rows: Literal["auto", "on", "off"] = opt(
        "auto", "log-prob passes and updates pack several samples into one row (each with its own positions) "
                "instead of padding one per row: auto = when the policy keeps packed samples apart (checked on the "
                "first batch), on = always (a policy whose attention leaks is an error), off = pad")
    generation_batch_size: int = opt(512, "completions per generate call")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    warmup_steps: int = opt(20, "linear warm-up steps (lets Adam see the gradient noise before full-size steps)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    save_steps: int = opt(0, "save a checkpoint every N steps; 0 = only at the end")
    save_total_limit: int = opt(3, "keep the newest K step checkpoints; 0 = keep all")
    max_failed_steps: int = opt(3, "stop after this many consecutive steps where a reward function failed on every sample")
    max_nonfinite_steps: int = opt(3, "stop after this many consecutive steps whose loss or gradients were NaN/inf "
                                      "(their updates are skipped)")

    def problems(self) -> Iterator[str]:
        """This section's own rules (that grpo.loss and the advantages name registered pieces, and
        grpo.loss_args suit the loss, is checked above the registries: grpokit.checks)."""
        g = self
        yield from failed([
            *_bounds(self, "grpo", positive=("learning_rate", "max_grad_norm"),
                     counts=("generation_batch_size", "prompts_per_step", "num_iterations", "max_completion_length",
                             "micro_batch_size", "max_failed_steps", "max_nonfinite_steps", "max_generation_rounds"),
                     non_negative=("warmup_steps", "weight_decay", "epsilon_high", "beta", "save_steps",
                                   "save_total_limit"),
                     within={"top_p": "(0, 1]", "epsilon": "[0, 1)"}),
            # bounds that say why, or depend on other fields
            (g.temperature > 0, f"grpo.temperature must be > 0 for sampling, got {g.temperature}"),
            (g.num_generations >= 2, f"grpo.num_generations must be >= 2 to form a group, got {g.num_generations}"),
            (1 <= g.num_minibatches <= g.prompts_per_step * g.num_generations,
             f"grpo.num_minibatches must lie in [1, prompts_per_step x num_generations], got {g.num_minibatches}"),
        ])
        if g.loss != "clip" and g.importance_sampling_level != "token":
            yield (f"grpo.importance_sampling_level={g.importance_sampling_level} applies to grpo.loss=clip; "
                   f"grpo.loss={g.loss} uses per-token ratios: set it to token")


@dataclass
class PPOConfig:
    critic_learning_rate: float = opt(1e-4, "AdamW learning rate of the critic (its own optimizer)")
    critic_init: str = opt("", "checkpoint to initialise the critic from (e.g. a reward model); empty = the policy")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(0.95, "GAE lambda")
    value_clip: float = opt(0.2, "clip range of the value loss around the rollout-time values")
    whiten_advantages: bool = opt(True, "normalise GAE advantages to zero mean, unit std over the batch's tokens")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "ppo", positive=("critic_learning_rate", "value_clip"),
                     within={"gamma": "[0, 1]", "lam": "[0, 1]"}),
        ])


@dataclass
class RewardConfig:
    name: str = opt("chain_accuracy", "built-in reward name or 'package.module:function' (the working directory "
                                      "is searched too)")
    weight: float = opt(1.0, "weight of this reward in the sum")
    timeout_s: Optional[float] = opt(60.0, "seconds a call may take before its samples are masked and counted "
                                           "in rewards/timeouts; null = no limit")
    args: dict[str, Any] = opt({}, "keyword arguments of a reward that is made from settings, e.g. overlong_penalty: "
                                   "{max_length: 1024, soft_cache: 256}")

    def problems(self, index: int) -> Iterator[str]:
        """The rules of rewards[index] (that its name names a function that can be made from its args
        is checked above the registries: grpokit.checks)."""
        if not (self.timeout_s is None or self.timeout_s > 0):
            yield "rewards[].timeout_s must be > 0 or null"


@dataclass
class RewardModelTrainConfig:
    learning_rate: float = opt(2e-4, "AdamW learning rate of reward-model training (the paper: 2e-5 at 7B)")
    max_steps: int = opt(400, "optimizer steps of each reward-model training run")
    batch_size: int = opt(32, "pairs (outcome) or completions (process) per training step")
    warmup_steps: int = opt(20, "linear warm-up steps of reward-model training")
    heldout_fraction: float = opt(0.1, "share of questions kept out of training to measure accuracy")
    balance_step_labels: bool = opt(False, "process RM: weigh right and wrong steps equally in the loss")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "reward_model.train", positive=("learning_rate",), counts=("batch_size", "max_steps"),
                     non_negative=("warmup_steps",), within={"heldout_fraction": "(0, 1)"}),
        ])


@dataclass
class RewardModelDataConfig:
    num_questions: int = opt(1000, "questions whose policy samples become reward-model training data")
    samples_per_question: int = opt(8, "policy samples per question, graded by the verifier")
    temperature: float = opt(1.0, "sampling temperature for reward-model data (diversity gives negatives)")
    max_pairs_per_prompt: int = opt(8, "outcome: at most this many (correct, incorrect) pairs per question")
    hard_negatives: int = opt(0, "built-in task: one-slip twins added per right training solution (one result off "
                                 "by 1-3, the rest carried on from it): outcome pairs (right, twin), or step labels "
                                 "by the rule; held-out data stays real samples")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "reward_model.data", positive=("temperature",),
                     counts=("num_questions", "samples_per_question", "max_pairs_per_prompt"),
                     non_negative=("hard_negatives",)),
        ])


@dataclass
class StepLabelConfig:
    method: Literal["rule", "rollouts"] = opt(
        "rule", "where process labels come from: rule (the task's step checker) or rollouts (Math-Shepherd: a step "
                "is right when one of label.rollouts completions of its prefix reaches the reference answer)")
    rollouts: int = opt(8, "rollouts labels: completions sampled from each step prefix")
    skip_uniform: bool = opt(
        True, "rollouts labels: a question whose samples are all right (or all wrong) gets no rollouts; false "
              "rolls those out too, which labels every step of all-wrong questions at N rollouts per step prefix")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed(_bounds(self, "reward_model.label", counts=("rollouts",)))


@dataclass
class RewardModelBackboneConfig:
    init: Literal["policy", "tiny", "checkpoint"] = opt(
        "policy", "what a new reward model's backbone starts from: policy (pi_SFT's, as DeepSeekMath), tiny (a fresh "
                  "built-in tiny model of the sizes below, on the policy's tokenizer) or checkpoint "
                  "(reward_model.model.path, any causal LM: a larger pi_SFT, say)")
    path: str = opt("", "init: checkpoint: its folder or hub id; its own tokenizer reads the completions")
    hidden_size: int = opt(128, "init: tiny: hidden width")
    num_layers: int = opt(4, "init: tiny: transformer blocks")
    num_heads: int = opt(4, "init: tiny: attention heads")
    intermediate_size: int = opt(512, "init: tiny: MLP width")
    head: Literal["score", "likelihood"] = opt(
        "score", "process RM: score (a trained scalar head at each step's last token, as DeepSeekMath) or "
                 "likelihood (the frozen backbone's step log-probabilities through a fitted a*sum+b; it verifies "
                 "where a score head cannot learn to: docs/results/reward-models.md)")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "reward_model.model", counts=("hidden_size", "num_layers", "num_heads", "intermediate_size")),
            (self.init != "checkpoint" or bool(self.path),
             "reward_model.model.init is checkpoint: set reward_model.model.path to a model folder or hub id"),
            (self.init == "checkpoint" or not self.path,
             f"reward_model.model.path is set but reward_model.model.init is {self.init!r}: set init to checkpoint, "
             "or clear path"),
            (self.init != "tiny" or self.hidden_size % max(2 * self.num_heads, 1) == 0,
             f"reward_model.model.hidden_size ({self.hidden_size}) must be a multiple of 2 x reward_model.model.num_heads "
             f"({self.num_heads}): each head's width must be even for rotary positions"),
        ])


# reward_model.train keys of the score head's optimizer, which the likelihood head has none of
LIKELIHOOD_UNUSED_TRAIN_KEYS = ("learning_rate", "max_steps", "batch_size", "warmup_steps", "balance_step_labels")


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
    train: RewardModelTrainConfig = opt(RewardModelTrainConfig, "training the reward model")
    data: RewardModelDataConfig = opt(RewardModelDataConfig, "its training data from the policy's own graded "
                                                             "samples")
    label: StepLabelConfig = opt(StepLabelConfig, "process reward model: where its step labels come from")
    model: RewardModelBackboneConfig = opt(RewardModelBackboneConfig, "a new reward model's size and initialisation "
                                                                      "(a trained one at reward_model.path keeps its own)")

    def problems(self) -> Iterator[str]:
        """This section's own rules, then those of reward_model.train, .data and .label."""
        yield from failed([
            *_bounds(self, "reward_model", counts=("batch_size",)),
            (self.step_delimiter != "", "reward_model.step_delimiter must not be empty"),
            (self.model.head == "score" or self.kind != "outcome",
             "reward_model.model.head=likelihood scores steps: it needs reward_model.kind=process (or --process)"),
            (not self.path or self.model.init == "policy",
             f"reward_model.model.init is {self.model.init!r}, but reward_model.path loads a trained reward model, "
             "which keeps its own weights: clear one of them"),
            (self.model.head == "score" or self.model.init != "tiny",
             "reward_model.model.head=likelihood verifies with its backbone's own language model, which "
             "init=tiny would leave random and frozen: set reward_model.model.init to policy or checkpoint"),
        ])
        if self.model.head == "likelihood":
            yield from self._unused_by_likelihood()
        for section in (self.train, self.data, self.label, self.model):
            yield from section.problems()

    def _unused_by_likelihood(self) -> Iterator[str]:
        """The likelihood head fits two numbers by logistic regression, with no optimizer: reward_model.train's
        optimizer keys would be ignored, so setting one is an error."""
        defaults = RewardModelTrainConfig()
        for key in LIKELIHOOD_UNUSED_TRAIN_KEYS:
            if getattr(self.train, key) != getattr(defaults, key):
                yield (f"reward_model.train.{key}={getattr(self.train, key)} is not used by reward_model.model.head="
                       f"likelihood (its a and b are fit by logistic regression, no optimizer steps): drop it, or "
                       f"use head=score")


@dataclass
class IterativeConfig:
    iterations: int = opt(1, "iterative GRPO (Algorithm 1): GRPO, then retrain the reward model on fresh policy "
                             "samples with replay, then pi_ref <- pi_theta; grpo.max_steps is split over them")
    replay_fraction: float = opt(0.1, "iterative GRPO: share of historical data kept in the replay buffer")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "iterative", counts=("iterations",), within={"replay_fraction": "[0, 1]"}),
        ])


@dataclass
class RolloutConfig:
    engine: str = opt("hf", "what samples completions, by registered name: hf (transformers' generate), hf_static "
                            "(generate with a static KV cache and a compiled decode step: CUDA graphs; plain "
                            "generate on CPU) or vllm (a colocated vLLM engine, synced after every optimizer step)")
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
    shared_prefill: bool = opt(
        False, "hf and hf_static without a static cache: a group's G completions prefill their prompt once and "
               "copy its KV cache (2.1x faster generation in fp32 on the SmolLM2 example's batch, "
               "docs/results/machine-limit.md); the same distribution, other float rounding, so off by default "
               "until the recorded demo numbers are measured again with it")
    is_correction: str = opt(
        "none", "tis: reweight each token by min(pi_old / pi_sampler, cap) (truncated importance sampling); "
                "icepop: drop the policy term of tokens whose pi_old / pi_sampler leaves [low, high] (is_args); "
                "for an engine whose log-probs differ from the trainer's")
    is_cap: float = opt(2.0, "tis: the cap C of its weight; the older key for rollout.is_args: {cap: C}, which wins")
    is_args: dict[str, Any] = opt({}, "arguments of rollout.is_correction, e.g. tis: {cap: 2.0}, icepop: "
                                      "{low: 0.5, high: 2.0} (the defaults)")
    tool: str = opt("", "a registered tool the policy may call mid-completion in RL rollouts (python: the "
                        "sandbox, DeepSeekMath's TIR), its output masked out of the loss; empty = none")
    max_tool_calls: int = opt(2, "with rollout.tool: tool calls per completion; the output of the last one ends "
                                 "it (as eval.max_tool_calls)")
    tool_args: dict[str, Any] = opt({}, "options of rollout.tool, e.g. python: {timeout_s: 10.0, program: "
                                        "cumulative} (the defaults)")
    mode: Literal["sync", "one_step_off", "async"] = opt(
        "sync", "sync: each step samples from the weights it then updates (the paper's loop); one_step_off: step "
                "t+1's batch is sampled while step t learns, from the weights after step t-1; async: a batch is "
                "sampled from the weights rollout.max_staleness steps older (docs/async.md). Off-policy batches "
                "are corrected by rollout.is_correction (tis unless it names one). Needs rollout.workers >= 1")
    max_staleness: int = opt(2, "async: how many policy versions older than the update a batch is sampled from "
                                "(0 = sync, 1 = one_step_off); the schedule is fixed, so a run is reproducible")
    workers: int = opt(0, "rollout worker processes, each with its own engine, fed prompts and weights by the "
                          "trainer over torch.distributed; 0 = sample in the trainer's process (sync only)")
    worker_launch: Literal["spawn", "external"] = opt(
        "spawn", "spawn: the trainer starts its workers on this machine; external: it waits for rollout.workers "
                 "`grpokit rollout-worker --connect HOST:PORT --index I` processes, started anywhere that "
                 "reaches rollout.worker_address")
    worker_address: str = opt("127.0.0.1:0", "HOST:PORT where the trainer listens for its rollout workers, on that "
                                              "interface alone; beyond loopback it needs GRPOKIT_WORKER_SECRET "
                                              "(docs/guides/security.md); port 0 = a free port, printed at start")
    worker_threads: int = opt(0, "torch threads of each spawned rollout worker; 0 = on CPU an equal share of the "
                                 "cores for each worker and the trainer, else torch's default")
    worker_start_timeout_s: float = opt(600.0, "seconds the rollout workers have to start (import, load the model, "
                                               "connect); distributed.timeout_s bounds every wait after that")

    @property
    def staleness(self) -> int:
        """Policy versions between the weights that sample a batch and the update that learns from it."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    def off_policy_correction(self) -> str | None:
        """The correction the loss applies given the sampler's log-probs: rollout.is_correction, or tis
        when batches are sampled by an older policy (decoupled PPO, docs/algorithm.md); None = none."""
        if self.is_correction != "none":
            return self.is_correction
        return "tis" if self.staleness > 0 else None

    def correction_args(self) -> dict[str, Any]:
        """is_args as rollout.is_correction receives them: for tis, is_cap is its cap unless is_args names one."""
        return {**({"cap": self.is_cap} if self.off_policy_correction() == "tis" else {}), **self.is_args}

    def problems(self) -> Iterator[str]:
        """This section's own rules (that rollout.is_correction, .engine and .tool name registered
        pieces, and the keys that go with them suit them, is checked above the registries: grpokit.checks)."""
        r = self
        yield from failed([
            *_bounds(self, "rollout", positive=("is_cap", "worker_start_timeout_s"),
                     counts=("tensor_parallel_size", "max_tool_calls"), non_negative=("workers", "worker_threads")),
            # bounds that say what the value means
            (r.kv_cache_gb is None or r.kv_cache_gb > 0,
             f"rollout.kv_cache_gb must be > 0 (or unset), got {r.kv_cache_gb}"),
            (0 < r.gpu_memory_utilization < 1,
             f"rollout.gpu_memory_utilization must lie in (0, 1), got {r.gpu_memory_utilization}: it is the "
             f"fraction of GPU memory vLLM takes beside training, e.g. 0.5"),
            (r.max_staleness >= 0, f"rollout.max_staleness must be >= 0 policy versions, got {r.max_staleness}: "
                                   "0 samples each batch from the weights it updates, 2 lets a batch be 2 versions "
                                   "old"),
            (r.mode == "sync" or r.workers >= 1,
             f"rollout.mode={r.mode} samples in rollout worker processes while the trainer learns: set "
             f"rollout.workers to 1 or more (e.g. --rollout.workers=1)"),
            (r.worker_launch == "spawn" or r.workers >= 1,
             "rollout.worker_launch=external waits for rollout workers: set rollout.workers to how many you start"),
            (_is_address(r.worker_address),
             f"rollout.worker_address={r.worker_address!r} is not HOST:PORT (e.g. 127.0.0.1:29600, or port 0 for "
             "any free port)"),
            (bool(r.tool) or not r.tool_args, f"rollout.tool_args={r.tool_args} but no rollout.tool: name the tool "
                                               "they are for, or drop them"),
        ])
        if r.off_policy_correction() is None and r.is_args:
            yield (f"rollout.is_args={r.is_args} but rollout.is_correction=none: name the correction they are for, "
                   f"or drop them")


@dataclass
class EvalConfig:
    before: bool = opt(True, "evaluate the held-out questions before training too (the before/after table)")
    k: int = opt(8, "samples per question for pass@k and maj@k; 0 = greedy accuracy only")
    temperature: float = opt(0.7, "sampling temperature for pass@k / maj@k")
    batch_size: int = opt(512, "completions per generate call")
    tir: bool = opt(True, "also evaluate with tool-integrated reasoning (the built-in task: its programs run in "
                          "grpokit.tools.sandbox), for a CoT/TIR before/after table")
    max_tool_calls: int = opt(2, "TIR: programs a completion may run; the output of the last one ends it "
                                 "(DeepSeekMath: 2)")
    tool_timeout_s: float = opt(10.0, "TIR: wall-clock limit of each program in seconds")
    every_steps: int = opt(0, "also evaluate the held-out questions greedily every this many RL steps (the learning "
                              "curve: heldout/greedy_accuracy in metrics.jsonl and on reward_curve.png); 0 = only "
                              "before and after")

    def problems(self) -> Iterator[str]:
        """This section's own rules."""
        return failed([
            *_bounds(self, "eval", positive=("temperature", "tool_timeout_s"), counts=("batch_size", "max_tool_calls"),
                     non_negative=("every_steps",)),
            (self.k >= 0, f"eval.k must be >= 0 (0 = greedy only), got {self.k}"),  # with what 0 means
        ])


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

    def problems(self) -> Iterator[str]:
        """Every section's own rules, section by section in the tree's order. The rules that span
        sections are grpokit.config.validation's; those that need a registry (names of rewards, losses,
        engines, tools, tasks, the report_to trackers) grpokit.checks'."""
        for section in (self.model, self.task, self.data, self.sft, self.grpo, self.ppo):
            yield from section.problems()
        for i, reward in enumerate(self.rewards):
            yield from reward.problems(i)
        for section in (self.reward_model, self.iterative, self.rollout, self.eval, self.distributed):
            yield from section.problems()


def _forbid_unknown_keys(cls) -> None:
    """Every section of the tree refuses keys it does not define (a typo is an error, never ignored)."""
    cls.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
    for tp in typing.get_type_hints(cls).values():
        for inner in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(inner):
                _forbid_unknown_keys(inner)


_forbid_unknown_keys(Config)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def leaf_paths(cls, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> (field, type) for every leaf of the tree."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(leaf_paths(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (f, tp)
    return out


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def describe(cls=Config, defaults=None, notes: dict[str, str] | None = None) -> str:
    """Every key with its type, default and one-line doc, for --help. `defaults`: a config whose
    values to show as the defaults (a preset's) instead of the dataclasses' own; `notes`: text to
    add to a dotted key's doc (what only the caller knows, e.g. the registered reward names)."""
    lines = []
    defaults = to_dict(cls() if defaults is None else defaults)
    for key, (f, tp) in leaf_paths(cls).items():
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
