"""grpokit vs TRL's GRPOTrainer: step time and reward on the same tiny model and task, on CPU.

    pip install -e ".[bench]"         # grpokit + trl
    python benchmarks/vs_trl.py                          # both configs, 40 steps, 2 alternating pairs
    python benchmarks/vs_trl.py --configs tiny --steps 30 --json results.json
    # 113M parameters, 128-token completions: TRL vs grpokit with generate vs grpokit with vLLM
    # (in .venv-vllm with trl added: .venv-vllm/bin/pip install trl==1.16.0 datasets -c .venv-vllm/vllm-pins.txt;
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 is set for the workers)
    python benchmarks/vs_trl.py --configs 113m --frameworks trl,grpokit,grpokit-vllm --steps 3 --warmup 1 --pairs 1
    # a real checkpoint: SmolLM2-135M-Instruct (`make models`) with LoRA, chat-templated prompts
    python benchmarks/vs_trl.py --configs smollm2 --steps 4 --warmup 1 --pairs 1 --threads 2 --profile

What runs
---------
1. For each config a tiny Llama is built with grpokit's `build_tiny_model` and
   `build_char_tokenizer(arithmetic.ALPHABET)`, briefly SFT-ed with grpokit's `sft_train` on the
   built-in chain-arithmetic task (so rewards are non-trivial), and saved once with
   `save_pretrained` (model + tokenizer). Both trainers load that one checkpoint in fp32.
2. Measured runs alternate, each in its own subprocess: TRL, grpokit, TRL, grpokit, ...
   (`--pairs` pairs). Every subprocess pins the same thread count (`torch.set_num_threads`
   plus OMP/MKL variables) and checks that the policy is fp32 and that a separate frozen
   reference model exists.
3. Both use grpokit's `chain_accuracy` reward, whose signature is TRL's
   `fn(prompts, completions, **columns)`; the dataset has `prompt` and `answer` columns.

The real checkpoint (config `smollm2`) skips step 1: both load `models/smollm2-135m-instruct/` (built by
`make models`) and wrap it in the same fresh LoRA adapters (grpokit's `apply_lora`, TRL's `peft_config`;
same r, alpha and target modules, no dropout), so pi_ref is the base model with the adapters off in both.
The prompts are "What is a + b?" / "What is a - b?" questions with grpokit's chain-of-thought instruction,
through the model's chat template: grpokit gets the rendered text (`render_prompt`, as `grpokit train`
renders it), TRL the conversation (`[{"role": "user", ...}]`, which it renders itself); the TRL worker
checks that both give the same prompt token ids. The reward is grpokit's `math_accuracy` in both.

What "one step" is in each (the mapping)
----------------------------------------
One step = one generation batch of B prompts x G completions, scored, then exactly one
optimizer step on all B*G completions (mu = num_iterations = 1, so pi_old = pi_theta and
neither trainer runs an extra pi_old forward pass).

  grpokit: prompts_per_step = B, num_generations = G, num_minibatches = 1,
           micro_batch_size = B*G (one forward/backward), generation_batch_size >= B*G.
  TRL:     per_device_train_batch_size = B*G (TRL counts completions, not prompts),
           gradient_accumulation_steps = 1, so generation_batch_size = B*G and
           steps_per_generation = 1; num_generations = G (B = B*G / G prompts per batch).

Same settings in both: loss_type "grpo" (TRL) = loss_aggregation "sequence" (grpokit): per-
sequence token mean, then mean over sequences; beta 0.04 with a frozen reference model (k3
KL); epsilon 0.2 (symmetric clip); group-std advantage scaling; temperature; top_p 1 and no
top_k; max_completion_length; AdamW lr constant (no warm-up, no decay), betas (0.9, 0.99),
no weight decay; grad-norm clip 1.0; seed; fp32; no gradient checkpointing (TRL's default is
on, turned off here since grpokit does not checkpoint); bf16 off (TRL's default is on).

What is timed
-------------
step:     TRL: on_step_begin -> on_step_end callback (generation, rewards, reference
          log-probs, forward/backward, clip, optimizer step). grpokit: `perf/step_time_s` of
          metrics.jsonl (the same stages). Loop overhead outside a step (TRL's logging and data
          loader, grpokit's metrics line) is left out of both.
generate: time inside the policy's `model.generate` (an instance-level timer in both).
score+ref: the rest of the rollout stage: prompt tokenizing, decoding, rewards, advantages,
          reference log-probs (TRL: `_generate_and_score_completions` minus generate;
          grpokit: step minus generate minus `Trainer.update`).
ref logp: of score+ref, the reference's no-grad log-prob forward (TRL: its
          `_get_per_token_logps_and_entropies` called without gradients; grpokit: `Trainer.logprobs`).
update:   policy forward + backward + clip + optimizer step (TRL: step minus
          `_generate_and_score_completions`; grpokit: `Trainer.update`).
The median skips the first `--warmup` steps of every run; the reward is the mean batch
reward over the last 20 steps of each run, averaged over runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    # name: model shape, prompts per step B, completions per prompt G, new tokens
    "tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512,
             "prompts": 8, "generations": 8, "max_new_tokens": 8},
    "small": {"hidden_size": 256, "num_layers": 6, "num_heads": 4, "intermediate_size": 1024,
              "prompts": 8, "generations": 8, "max_new_tokens": 32},
    # random init (no SFT), its head scaled so that EOS is never drawn: every completion runs the full
    # 128 tokens in all three trainers, so they do the same work (rewards are all 0 here)
    "113m": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072,
             "prompts": 4, "generations": 4, "max_new_tokens": 128, "eos_free": True},
    # a real pretrained checkpoint (`make models`) trained through LoRA adapters, the adapters of
    # examples/smollm2_word_arithmetic.yaml; chat-templated arithmetic prompts, math_accuracy reward
    "smollm2": {"model_dir": "models/smollm2-135m-instruct", "prompts": 4, "generations": 4, "max_new_tokens": 64,
                "lora": {"r": 16, "alpha": 32.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]}},
}
FRAMEWORKS = {"trl": "TRL", "grpokit": "grpokit+hf", "grpokit-shared": "grpokit+hf, shared prefill",
              "grpokit-vllm": "grpokit+vllm"}
EOS_FREE_LOGIT_STD = 4.0  # head logit scale that makes a zero EOS logit ~never sampled
BETA, EPSILON = 0.04, 0.2
REWARD_WINDOW = 20


# ---------------------------------------------------------------------------- helpers


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # grpokit-vllm: the engine in the worker's process
    return env


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "trl", "accelerate", "grpokit"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


class Timer:
    """Accumulates seconds spent inside wrapped callables, per step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def wrap(self, name: str, fn, only_without_grad: bool = False):
        """fn, timed under `name`; with only_without_grad, only its calls made under torch.no_grad()
        count (TRL computes reference and policy log-probs with one method)."""
        import torch

        def timed(*args, **kwargs):
            if only_without_grad and torch.is_grad_enabled():
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(name):  # a labelled range in a --profile run
                    return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed


def _check_fp32(*models) -> None:
    import torch

    for m in models:
        dtypes = {p.dtype for p in m.parameters()}
        if dtypes != {torch.float32}:
            raise RuntimeError(f"expected an fp32 model, found parameter dtypes {dtypes}")


def check_reference(trainer: str, model, ref_model, lora: bool, base_under_adapters: bool) -> None:
    """pi_ref must be what the other trainer uses too: with LoRA the base model under disabled
    adapters (`base_under_adapters`), else a separate frozen model; the weights fp32."""
    if lora:
        if not base_under_adapters:
            raise RuntimeError(f"{trainer}'s LoRA reference is not the base model with its adapters disabled")
        _check_fp32(model)
    else:
        if ref_model is None or ref_model is model:
            raise RuntimeError(f"{trainer} did not build a separate reference model")
        _check_fp32(model, ref_model)


# ---------------------------------------------------------------------------- preparation


def arithmetic_questions(n: int, seed: int) -> list[dict]:
    """`n` rows {question, answer}: "What is a + b?" or "What is a - b?", a and b in 2..60."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(2, 60), rng.randint(2, 60), rng.choice("+-")
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)})
    return rows


def prepare_checkpoint(name: str, workdir: Path, seed: int, num_rl_questions: int, checkpoint: str = "") -> dict:
    """For a config of a real checkpoint (`checkpoint`, else the config's model_dir): check it is there
    and write the RL prompts (rendered through its chat template as `grpokit train` renders them);
    nothing is trained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpokit.data.templates import render_prompt

    model_dir = Path(checkpoint or CONFIGS[name]["model_dir"]).resolve()
    if not (model_dir / "config.json").is_file():
        sys.exit(f"{model_dir} has no config.json: build it with `make models` (config {name}), or name a model "
                 "folder with --checkpoint")
    data = workdir / f"rl-prompts-{name}-{model_dir.name}-seed{seed}-{num_rl_questions}.jsonl"
    if not data.is_file():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = [{**r, "prompt": render_prompt(r["question"], tokenizer, "cot")}
                for r in arithmetic_questions(num_rl_questions, seed + 1)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with torch.device("meta"):  # count the parameters without reading the weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {"model_dir": str(model_dir), "data": str(data), "parameters": sum(p.numel() for p in model.parameters()),
            "sft_steps": 0, "sft_final_loss": None, "sft_seconds": 0.0}


def prepare(name: str, workdir: Path, sft_steps: int, seed: int, threads: int, num_rl_questions: int,
            checkpoint: str = "") -> dict:
    """SFT a tiny Llama once for config `name`, save it, and write the RL prompts; reused if present.
    A config of a real checkpoint takes it as it is (prepare_checkpoint)."""
    import torch

    if "model_dir" in CONFIGS[name]:
        return prepare_checkpoint(name, workdir, seed, num_rl_questions, checkpoint)

    from grpokit.config import SFTConfig
    from grpokit.data import arithmetic
    from grpokit.models import build_char_tokenizer, build_tiny_model
    from grpokit.train.sft import sft_train

    shape = CONFIGS[name]
    out = workdir / f"{name}-sft{sft_steps}-seed{seed}"
    data = workdir / f"rl-prompts-seed{seed}-{num_rl_questions}.jsonl"
    task = arithmetic.ChainSpec()
    if not data.is_file():
        rows = arithmetic.make_rows(arithmetic.sample_questions(num_rl_questions, seed + 1, task, "train"))
        data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    info_path = out / "bench_sft.json"
    if info_path.is_file():
        return {"model_dir": str(out), "data": str(data), **json.loads(info_path.read_text())}

    _set_threads(threads)
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = build_tiny_model(tokenizer, "llama", shape["hidden_size"], shape["num_layers"], shape["num_heads"],
                             shape["intermediate_size"], seed=seed)
    sft_rows = arithmetic.make_sft_rows(arithmetic.sample_questions(4000, seed, task, "train"), 0.7, seed)
    started = time.perf_counter()
    losses = []
    if sft_steps > 0:
        losses = sft_train(model, tokenizer, [(r["prompt"], r["solution"]) for r in sft_rows],
                           SFTConfig(max_steps=sft_steps, warmup_steps=min(30, sft_steps // 5 + 1)),
                           seed=seed, progress=False)
    if shape.get("eos_free"):
        with torch.no_grad():  # the final norm leaves unit-scale features: logit std = row std * sqrt(hidden)
            head = model.get_output_embeddings().weight
            head.normal_(0.0, EOS_FREE_LOGIT_STD / shape["hidden_size"] ** 0.5)
            head[tokenizer.eos_token_id] = 0.0
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": sft_steps,
        "sft_final_loss": losses[-1] if losses else None,
        "sft_seconds": time.perf_counter() - started,
    }
    info_path.write_text(json.dumps(info))
    return {"model_dir": str(out), "data": str(data), **info}


# ---------------------------------------------------------------------------- workers


def _load_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_grpokit(args) -> dict:
    import torch

    from grpokit.config import GRPOConfig, LoraConfig
    from grpokit.run.metrics import read_metrics
    from grpokit.models import load_model_and_tokenizer
    from grpokit.config import RolloutConfig
    from grpokit.models.lora import AdapterDisabledReference, apply_lora
    from grpokit.rewards import WeightedReward
    from grpokit.train.grpo import GRPOTrainer

    shape = CONFIGS[args.config]
    b, g = shape["prompts"], shape["generations"]
    random_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model_dir, dtype="fp32", device="cpu")
    if shape.get("lora"):  # as `grpokit train` does with model.lora.r > 0: the base frozen, adapters trained
        model = apply_lora(model, LoraConfig(**shape["lora"]))
    config = GRPOConfig(
        num_generations=g,
        prompts_per_step=b,
        max_completion_length=shape["max_new_tokens"],
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=BETA,
        epsilon=EPSILON,
        num_iterations=1,
        num_minibatches=1,
        loss_aggregation="sequence",
        scale_rewards=True,
        temperature=args.temperature,
        top_p=1.0,
        micro_batch_size=b * g,
        generation_batch_size=max(512, b * g),
        max_grad_norm=1.0,
        warmup_steps=0,  # constant lr from step 1, like TRL's lr_scheduler_type="constant"
        weight_decay=0.0,
    )
    name, reward = reward_function(args.config)
    rewards = [WeightedReward(name, reward, 1.0, 60.0)]  # grpokit's defaults
    run_dir = Path(args.run_dir)
    engine = None
    if args.framework == "grpokit-vllm":  # colocated vLLM, weights pushed after every update
        from grpokit.rollout.vllm import VLLMEngine

        engine = VLLMEngine(model, tokenizer, max_model_len=256 + shape["max_new_tokens"], kv_cache_gb=1.0,
                            dtype="float32", seed=args.seed)
    # grpokit-shared: rollout.shared_prefill, each prompt's prefill once per group (rollout/sampler.py)
    rollout = RolloutConfig(shared_prefill=args.framework == "grpokit-shared")
    trainer = GRPOTrainer(model, tokenizer, rewards, _load_rows(args.data), config, run_dir, seed=args.seed,
                          progress=False, engine=engine, rollout_config=rollout)
    check_reference("grpokit", trainer.model, trainer.ref_model, bool(shape.get("lora")),
                    isinstance(trainer.ref_model, AdapterDisabledReference))

    timer = Timer()
    if engine is None:
        model.generate = timer.wrap("generate", model.generate)
    else:  # the engine's whole generate call (the weight sync after each update counts in score+ref)
        engine.generate = timer.wrap("generate", engine.generate)
    trainer.update = timer.wrap("update", trainer.update)
    trainer.logprobs = timer.wrap("ref_logp", trainer.logprobs)  # mu = 1: pi_ref's log-probs alone
    per_step: list[dict] = []
    original_step = trainer.step

    def step():
        timer.reset()
        if args.profile_step == len(per_step) + 1:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                record = original_step()
            write_profile(profile, Path(args.out).with_suffix(".profile.txt"), args.profile_step)
        else:
            record = original_step()
        per_step.append({"generate": timer.seconds.get("generate", 0.0), "update": timer.seconds.get("update", 0.0),
                         "ref_logp": timer.seconds.get("ref_logp", 0.0), "threads": torch.get_num_threads()})
        return record

    trainer.step = step
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = []
    for row, extra in zip(rows, per_step):
        total = row["perf/step_time_s"]
        steps.append({
            "step": row["step"],
            "step_time_s": total,
            "generate_s": extra["generate"],
            "score_ref_s": total - extra["generate"] - extra["update"],
            "update_s": extra["update"],
            "ref_logp_s": extra["ref_logp"],
            "reward": row["reward/mean"],
            "completion_length": row["completion/mean_length"],
            "completion_max_length": row["completion/max_length"],
            "kl": row["kl"],
            "threads": extra["threads"],
            # grpokit's own metrics.jsonl timings
            **{key: row[key] for key in ("perf/rollout_time_s", "perf/scoring_time_s", "perf/logprob_time_s",
                                         "perf/update_time_s", "perf/step_time_s") if key in row},
        })
    return {"train_wall_s": wall, "steps": steps}


def reward_function(config: str):
    """(name, fn) of the config's reward, in TRL's signature fn(prompts, completions, **columns)."""
    if "model_dir" in CONFIGS[config]:
        from grpokit.rewards import math_accuracy

        # its verifier processes start on the first answer that needs math-verify: here, before either
        # trainer's first step, not inside whichever step first meets such an answer
        math_accuracy(["warm-up"], ["\\boxed{2}"], answer=["3"])
        return "math_accuracy", math_accuracy
    from grpokit.data import arithmetic

    return "chain_accuracy", arithmetic.chain_accuracy


def on_completion_text(fn):
    """fn for TRL's conversational completions ([{"role": "assistant", "content": text}]): fn sees the text."""
    def reward(prompts, completions, **columns):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(x) for x in fn(prompts, texts, **columns)]

    reward.__name__ = fn.__name__
    return reward


def as_conversations(rows: list[dict]) -> list[dict]:
    """Rows of a real checkpoint's config for TRL: the user turn as a conversation, which TRL renders
    through the chat template itself (grpokit's rows hold it rendered: `prompt`)."""
    from grpokit.data.templates import instruction_text

    return [{**r, "prompt": [{"role": "user", "content": instruction_text(r["question"], "cot")}]} for r in rows]


def check_same_prompt_ids(trainer, tokenizer, rows: list[dict], conversations: list[dict]) -> None:
    """TRL's prompt token ids of the conversations must be those grpokit samples from (its rendered
    prompts tokenized without special tokens, as HFEngine does)."""
    theirs = trainer._tokenize_prompts([c["prompt"] for c in conversations[:8]])[0]
    ours = tokenizer([r["prompt"] for r in rows[:8]], add_special_tokens=False)["input_ids"]
    if [list(ids) for ids in theirs] != [list(ids) for ids in ours]:
        raise RuntimeError(f"TRL's prompt ids differ from grpokit's: {list(theirs[0])} vs {ours[0]}")


def write_profile(profile, path: Path, step: int) -> None:
    """The profiled step's operators: by their own CPU time, then by the time inside them (the
    labelled stages generate, ref_logp and update among them)."""
    averages = profile.key_averages()
    path.write_text(f"step {step}, operators by self CPU time\n"
                    + averages.table(sort_by="self_cpu_time_total", row_limit=25)
                    + "\nby total CPU time (children included)\n"
                    + averages.table(sort_by="cpu_time_total", row_limit=25))


def random_seed(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    shape = CONFIGS[args.config]
    b, g = shape["prompts"], shape["generations"]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.run_dir) / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=b * g,  # completions, not prompts
        gradient_accumulation_steps=1,
        num_generations=g,
        num_iterations=1,
        max_completion_length=shape["max_new_tokens"],
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=BETA,
        epsilon=EPSILON,
        loss_type="grpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        dataloader_num_workers=0,
    )
    assert config.generation_batch_size == b * g and config.steps_per_generation == 1, config
    rows = _load_rows(args.data)
    reward = reward_function(args.config)[1]
    peft_config = None
    if shape.get("lora"):  # the adapters grpokit's apply_lora makes: same r, alpha, targets; no dropout
        from peft import LoraConfig

        lora = shape["lora"]
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    conversations = as_conversations(rows) if "model_dir" in shape else rows
    trainer = GRPOTrainer(model=model, reward_funcs=[on_completion_text(reward)], args=config,
                          train_dataset=Dataset.from_list(conversations), processing_class=tokenizer,
                          peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)
    # with LoRA, TRL's pi_ref is the base model with the adapters disabled unless it made a "ref" adapter
    check_reference("TRL", trainer.model, trainer.ref_model, peft_config is not None,
                    trainer.ref_model is None and "ref" not in getattr(trainer.model, "peft_config", {}))
    if conversations is not rows:
        check_same_prompt_ids(trainer, tokenizer, rows, conversations)

    timer = Timer()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.generate = timer.wrap("generate", policy.generate)
    trainer._generate_and_score_completions = timer.wrap("rollout", trainer._generate_and_score_completions)
    # pi_ref's log-probs, without gradients (mu = 1: TRL computes no pi_old pass)
    trainer._get_per_token_logps_and_entropies = timer.wrap("ref_logp", trainer._get_per_token_logps_and_entropies,
                                                            only_without_grad=True)
    per_step: dict[int, dict] = {}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            timer.reset()
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            total = time.perf_counter() - self.start
            gen, rollout = timer.seconds.get("generate", 0.0), timer.seconds.get("rollout", 0.0)
            per_step[state.global_step] = {"step": state.global_step, "step_time_s": total, "generate_s": gen,
                                           "score_ref_s": rollout - gen, "update_s": total - rollout,
                                           "ref_logp_s": timer.seconds.get("ref_logp", 0.0),
                                           "threads": torch.get_num_threads()}

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "reward" in logs and state.global_step in per_step:
                per_step[state.global_step].update({
                    "reward": logs["reward"],
                    "completion_length": logs.get("completions/mean_length"),
                    "completion_max_length": logs.get("completions/max_length"),
                    "kl": logs.get("kl"),
                    "trl/step_time": logs.get("step_time"),  # TRL's own training_step timer (no optimizer step)
                })

    trainer.add_callback(StepTimes())
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    return {"train_wall_s": wall, "steps": [per_step[k] for k in sorted(per_step)]}


def _run_settings(args) -> dict:
    """What a run's numbers depend on; a reused run must match all of it."""
    return {k: getattr(args, k) for k in ("framework", "config", "model_dir", "steps", "threads", "lr",
                                            "temperature", "seed")}


def worker(args) -> None:
    _set_threads(args.threads)
    import torch

    result = run_trl(args) if args.framework == "trl" else run_grpokit(args)
    result.update({"framework": args.framework, "config": args.config, "threads": torch.get_num_threads(),
                   "versions": versions(), "settings": _run_settings(args)})
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- driver


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(name: str, runs: list[dict], warmup: int, info: dict) -> dict:
    out = {"config": name, "parameters": info["parameters"], **CONFIGS[name]}
    frameworks = [fw for fw in FRAMEWORKS if any(r["framework"] == fw for r in runs)]
    out["frameworks"] = frameworks
    for fw in frameworks:
        mine = [r for r in runs if r["framework"] == fw]
        timed = [s for r in mine for s in r["steps"][warmup:]]
        rewards = [statistics.fmean([s["reward"] for s in r["steps"][-REWARD_WINDOW:]]) for r in mine]
        out[fw] = {
            "runs": len(mine),
            "median_step_s": median([s["step_time_s"] for s in timed]),
            "median_generate_s": median([s["generate_s"] for s in timed]),
            "median_score_ref_s": median([s["score_ref_s"] for s in timed]),
            "median_update_s": median([s["update_s"] for s in timed]),
            "median_ref_logp_s": median([s["ref_logp_s"] for s in timed if "ref_logp_s" in s]),
            "median_step_s_per_run": [median([s["step_time_s"] for s in r["steps"][warmup:]]) for r in mine],
            f"reward_last{REWARD_WINDOW}": statistics.fmean(rewards) if rewards else float("nan"),
            f"reward_last{REWARD_WINDOW}_per_run": rewards,
            "mean_completion_length": statistics.fmean(s["completion_length"] for s in timed) if timed else None,
            "max_completion_length": max((s.get("completion_max_length") or 0 for s in timed), default=None),
            "threads": sorted({s["threads"] for s in timed}),
        }
        if fw != "trl":
            out[fw]["median_perf_rollout_time_s"] = median([s["perf/rollout_time_s"] for s in timed])
            out[fw]["ratio"] = out[fw]["median_step_s"] / out["trl"]["median_step_s"]
            out[fw]["ratio_per_pair"] = [g / t for t, g in zip(out["trl"]["median_step_s_per_run"],
                                                              out[fw]["median_step_s_per_run"])]
    return out


def table(results: list[dict]) -> str:
    w = f"last {REWARD_WINDOW}"
    lines = [
        (f"| config | params | prompts x G, new tokens | trainer | s/step | ratio to TRL (per pair) | "
         f"reward ({w}) |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for fw in r["frameworks"]:
            d = r[fw]
            ratio = "1" if fw == "trl" else \
                f"**{d['ratio']:.2f}** ({', '.join(f'{x:.2f}' for x in d['ratio_per_pair'])})"
            lines.append(
                f"| {r['config']} | {r['parameters'] / 1e6:.2f}M | {r['prompts']} x {r['generations']}, "
                f"{r['max_new_tokens']} | {FRAMEWORKS[fw]} | {d['median_step_s']:.3f} | {ratio} | "
                f"{d[f'reward_last{REWARD_WINDOW}']:.3f} |"
            )
    lines += [
        "",
        ("Where a step's time goes (medians, seconds; score+ref = tokenize/decode, rewards, advantages, "
         "reference log-probs, and ref logp its reference log-prob forward; update = policy "
         "forward+backward+optimizer):"),
        "",
        "| config | trainer | step | generate | score+ref | (ref logp) | update | completion tokens: mean, max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for fw in r["frameworks"]:
            d, label = r[fw], FRAMEWORKS[fw]
            step = d["median_step_s"]

            def cell(v, step=step):
                return f"{v:.3f} ({100 * v / step:.0f}%)"

            lines.append(f"| {r['config']} | {label} | {step:.3f} | {cell(d['median_generate_s'])} | "
                         f"{cell(d['median_score_ref_s'])} | {cell(d['median_ref_logp_s'])} | "
                         f"{cell(d['median_update_s'])} | {d['mean_completion_length']:.1f}, "
                         f"{d['max_completion_length']:.0f} |")
    return "\n".join(lines)


def parse_sft_steps(text: str, names: list[str]) -> dict[str, int]:
    """"200" (every config) or "tiny=200,small=100"."""
    if "=" not in text:
        return {n: int(text) for n in names}
    steps = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        steps[key.strip()] = int(value)
    missing = [n for n in names if n not in steps and "model_dir" not in CONFIGS[n]]  # a checkpoint is not SFT-ed
    if missing:
        sys.exit(f"--sft-steps names no value for config(s) {missing}")
    return steps


def run_worker(args, env: dict, fw: str, name: str, info: dict, run_dir: Path, out: Path, steps: int,
               profile_step: int = 0) -> dict:
    """One trainer's run in a subprocess of its own; its result."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, __file__, "_worker", "--framework", fw, "--config", name,
           "--model-dir", info["model_dir"], "--data", info["data"], "--run-dir", str(run_dir),
           "--out", str(out), "--steps", str(steps), "--threads", str(args.threads),
           "--lr", str(args.lr), "--temperature", str(args.temperature), "--seed", str(args.seed),
           "--profile-step", str(profile_step)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-10000:])
        sys.exit(f"{fw} run failed for config {name} (exit {proc.returncode})")
    return json.loads(out.read_text())


def driver(args) -> None:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")
    sft_steps = parse_sft_steps(args.sft_steps, names)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if "trl" not in frameworks or any(f not in FRAMEWORKS for f in frameworks):
        sys.exit(f"--frameworks must name trl and any of {sorted(FRAMEWORKS)}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="grpokit-vs-trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = _thread_env(args.threads)
    print(f"workdir {workdir}; threads {args.threads}; versions {versions()}", flush=True)
    results = []
    for name in names:
        info = prepare(name, workdir, sft_steps.get(name, 0), args.seed, args.threads, args.rl_questions,
                       args.checkpoint)
        print(f"[{name}] {info['parameters'] / 1e6:.2f}M parameters, SFT {info['sft_steps']} steps "
              f"(loss {info['sft_final_loss']}) -> {info['model_dir']}", flush=True)
        runs = []
        for pair in range(args.pairs):
            for fw in frameworks:  # alternate: TRL, grpokit, TRL, grpokit, ...
                run_dir = workdir / f"{name}-{fw}-{pair}"
                out = workdir / f"{name}-{fw}-{pair}.json"
                wanted = {"framework": fw, "config": name, "model_dir": info["model_dir"], "steps": args.steps,
                          "threads": args.threads, "lr": args.lr, "temperature": args.temperature, "seed": args.seed}
                if args.reuse and out.is_file():
                    run = json.loads(out.read_text())
                    if run.get("settings") == wanted:
                        runs.append(run)
                        print(f"[{name}] pair {pair + 1}/{args.pairs} {fw:8s} reused {out}", flush=True)
                        continue
                started = time.perf_counter()
                run = run_worker(args, env, fw, name, info, run_dir, out, args.steps)
                runs.append(run)
                times = [s["step_time_s"] for s in run["steps"][args.warmup:]]
                rew = [s["reward"] for s in run["steps"][-REWARD_WINDOW:]]
                print(f"[{name}] pair {pair + 1}/{args.pairs} {fw:8s} median {median(times):.3f} s/step, "
                      f"reward(last {REWARD_WINDOW}) {statistics.fmean(rew):.3f}, "
                      f"subprocess {time.perf_counter() - started:.0f}s", flush=True)
        if args.profile:  # one more grpokit run, its step after the warm-up under torch.profiler
            out = workdir / f"{name}-grpokit-profile.json"
            run_worker(args, env, "grpokit", name, info, workdir / f"{name}-grpokit-profile", out, args.warmup + 1,
                       profile_step=args.warmup + 1)
            print(f"\n[{name}] grpokit step {args.warmup + 1} under torch.profiler:\n"
                  f"{out.with_suffix('.profile.txt').read_text()}", flush=True)
        results.append(summarize(name, runs, args.warmup, info) | {"sft": info, "runs": runs})
    text = table(results)
    print()
    print(text)
    if args.json:
        payload = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "versions": versions(),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "settings": {k: v for k, v in vars(args).items() if k != "func"},
            "results": results,
            "table": text,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        p = argparse.ArgumentParser(prog="vs_trl.py _worker")
        p.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
        p.add_argument("--config", choices=sorted(CONFIGS), required=True)
        for key in ("--model-dir", "--data", "--run-dir", "--out"):
            p.add_argument(key, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--threads", type=int, required=True)
        p.add_argument("--lr", type=float, required=True)
        p.add_argument("--temperature", type=float, required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--profile-step", type=int, default=0, help="grpokit: run this step under torch.profiler")
        worker(p.parse_args(argv[1:]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per run (default 40)")
    p.add_argument("--configs", default="tiny,small", help=f"comma-separated, from {sorted(CONFIGS)}")
    p.add_argument("--json", default="", help="write all per-step results and the summary to this path")
    p.add_argument("--pairs", type=int, default=2, help="alternating TRL/grpokit run pairs per config (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the median")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in every run (default 1: on a shared machine, 2+ OpenMP threads per process "
                        "spin-wait on each other when the cores are oversubscribed and single steps take 10x longer)")
    p.add_argument("--lr", type=float, default=5e-5, help="constant AdamW learning rate of both (default 5e-5)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frameworks", default="trl,grpokit",
                   help="comma-separated, from trl, grpokit (its hf engine), grpokit-shared (the same with "
                        "rollout.shared_prefill) and grpokit-vllm (needs vllm: run in "
                        ".venv-vllm with VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    p.add_argument("--sft-steps", default="tiny=200,small=150,113m=0",
                   help="grpokit SFT steps before GRPO: one number, or per config (default tiny=200,small=150,113m=0)")
    p.add_argument("--rl-questions", type=int, default=5000, help="RL prompts in the shared dataset")
    p.add_argument("--profile", action="store_true",
                   help="after the measured runs, one more grpokit run whose step after the warm-up runs under "
                        "torch.profiler (not in the medians); its top operators are printed")
    p.add_argument("--checkpoint", default="",
                   help="the model folder of a real checkpoint's config (smollm2), instead of its model_dir")
    p.add_argument("--reuse", action="store_true",
                   help="reuse finished runs in --workdir whose settings match (to resume an interrupted benchmark)")
    p.add_argument("--workdir", default="", help="where checkpoints and runs go; reused SFT checkpoints if present "
                                                 "(default: a new temp dir)")
    driver(p.parse_args(argv))


if __name__ == "__main__":
    main()
