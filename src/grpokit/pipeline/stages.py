"""The stages and their one composition. `grpokit sft`, `train-rm` and `train` run one stage
each on any checkpoint; `grpokit demo` runs the stages its preset (presets/demo.yaml) lists,
the same code: SFT -> pi_SFT saved and reloaded through the hub loader -> RL -> the table.

Under `torchrun --nproc_per_node=N -m grpokit train ...` every process runs this same code on
its own share of each batch (train/loop.py); the models are sharded with FSDP2
(models/sharding.py), and rank 0 alone takes the run lock (run/claim.py) and writes files.

`grpokit train` (RL) is rl.py's run_train. The stages compose the building blocks of build.py and
what inputs.py loads and checks; where a run resumes and what it refuses to resume with are in
resume.py, the before/after table and the summary's results in report.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

from grpokit import distributed
from grpokit.config import Config, ConfigError
from grpokit.data.reward_data import write_jsonl
from grpokit.data.sniff import reward_model_examples
from grpokit.data.sources import check_sources
from grpokit.eval.plots import plot_loss_curve
from grpokit.models.lora import parameter_counts
from grpokit.models.precision import describe_precision
from grpokit.pipeline.build import RunSetup, load_policy, reward_model_stage, start_run
from grpokit.pipeline.inputs import (
    check_reward_model_fits,
    check_reward_model_setup,
    engine_setup,
    labels_from_rollouts,
    limit_prompts,
    load_trainable_policy,
)
from grpokit.pipeline.rl import run_train
from grpokit.rollout import make_engine
from grpokit.run.checkpoint import save_checkpoint
from grpokit.run.claim import claim, run_lock
from grpokit.run.directory import CLAIMED, NEW
from grpokit.run.metrics import MetricsWriter, NullWriter, read_metrics
from grpokit.tasks import task_for
from grpokit.tools import make_tool
from grpokit.train.reward_model import (
    evaluate_reward_model,
    example_record,
    fit_reward_model,
    rollout_step_examples,
    sample_completions,
    split_by_prompt,
)
from grpokit.train.sft import sft_train

__all__ = ["run_demo", "run_label_steps", "run_sft", "run_train", "run_train_rm"]


SFT_METRICS, SFT_LOSS_CURVE = "sft_metrics.jsonl", "sft_loss_curve.png"


def run_sft(config: Config, progress: bool = True, run_dir_mode: str = NEW) -> Path:
    """SFT model.name_or_path (or a fresh tiny model) on the task's demonstrations; data parallel
    under torchrun (sft.batch_size is the global batch). Writes sft_metrics.jsonl (a row a step)
    and sft_loss_curve.png beside the checkpoint. `run_dir_mode`: rundir.NEW, OVERWRITE or CLAIMED."""
    check_sources(config.data.sft_sources, config.data.skip_malformed_lines)  # before any model loads
    if config.sft.batch_size % distributed.world_size():
        raise ConfigError(f"sft.batch_size={config.sft.batch_size} does not split over {distributed.world_size()} "
                          f"processes (the world size): make it a multiple of {distributed.world_size()}")
    with run_lock(config.output_dir, run_dir_mode):
        run_dir = start_run(config, write=distributed.is_main())
        # As in RL: adapters over a frozen base (compute dtype). The built-in tiny model is random and
        # has no files an adapter could load with: it trains whole, as pi_SFT for LoRA RL (the demo).
        lora = config.model.lora.r > 0 and bool(config.model.name_or_path)
        model, tokenizer, _ = load_trainable_policy(config, lora=lora)
        print(f"{model.config.model_type}: {parameter_counts(model)}; {describe_precision(model)}")
        demos = limit_prompts(task_for(config).data(tokenizer).sft, config, tokenizer)
        if not demos:
            raise ConfigError("no SFT demonstrations: set data.sft_sources to files with worked solutions")
        log = run_dir / SFT_METRICS
        with (MetricsWriter(log) if distributed.is_main() else NullWriter()) as writer:
            losses = sft_train(model, tokenizer, [(r["prompt"], r["completion"]) for r in demos], config.sft,
                               seed=config.seed, progress=progress, on_step=writer.write,
                               tool_spans=_demonstration_tool_spans(config))
        path = save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "sft")
        if distributed.is_main():
            plot_loss_curve(read_metrics(log), run_dir / SFT_LOSS_CURVE, title=f"grpokit SFT (seed {config.seed})")
    print(f"saved {path} ({len(demos)} demonstrations, final loss {losses[-1]:.4f}); "
          f"loss per step in {run_dir / SFT_METRICS} and {run_dir / SFT_LOSS_CURVE}")
    return path


def _demonstration_tool_spans(config: Config):
    """sft.mask_tool_output: the output_spans of rollout.tool (else the python tool), which SFT
    leaves out of the loss; None to train on every completion token."""
    if not config.sft.mask_tool_output:
        return None
    tool = make_tool(config.rollout.tool or "python", **(config.rollout.tool_args if config.rollout.tool else {}))
    return getattr(tool, "output_spans", None)


def run_demo(config: Config, progress: bool = True, run_dir_mode: str = NEW) -> dict:
    """The preset's stages in order: SFT (unless sft.checkpoint gives pi_SFT), then RL from it,
    in one run directory."""
    started = time.perf_counter()
    sft_dir = config.sft.checkpoint
    if sft_dir and not (Path(sft_dir) / "config.json").is_file():
        raise ConfigError(f"sft.checkpoint {sft_dir!r} is not a saved model (no config.json there); "
                          "point it at a run's checkpoints/sft directory")
    if "train" in config.stages:
        check_reward_model_setup(config)  # before SFT, which would otherwise run first
    claim(config.output_dir, run_dir_mode)  # the stages below share the directory, each taking its lock
    timings = {}
    if "sft" in config.stages and not sft_dir:
        sft_dir = str(run_sft(config, progress, CLAIMED))
        timings["sft_seconds"] = time.perf_counter() - started
    elif sft_dir:
        print(f"pi_SFT from {sft_dir} (sft.checkpoint); no SFT in this run")
    if "train" not in config.stages:
        return {"checkpoint": sft_dir}
    # pi_SFT enters RL through the same loader a hub checkpoint would.
    rl_config = dataclasses.replace(config, model=dataclasses.replace(config.model, name_or_path=sft_dir or
                                                                      config.model.name_or_path))
    return run_train(rl_config, progress, timings=timings, started=started, run_dir_mode=CLAIMED)


def run_label_steps(config: Config, out: str, progress: bool = True, run_dir_mode: str = NEW) -> dict:
    """Math-Shepherd step labels: sample reward_model.data.samples_per_question solutions of
    reward_model.data.num_questions questions from the policy, split them at reward_model.step_delimiter,
    continue every step prefix reward_model.label.rollouts times, grade by rule, and write
    (prompt, steps, labels, soft_labels) records to `out`, the file `train-rm --process --data` reads."""
    check_sources(config.data.sources, config.data.skip_malformed_lines)
    rm = config.reward_model
    with run_lock(config.output_dir, run_dir_mode):
        run_dir = start_run(config)
        policy, tokenizer = load_policy(config, trainable=False)  # it only samples
        task = task_for(config)
        rows = limit_prompts(task.data(tokenizer, sft=False).train, config, tokenizer)
        rows = random.Random(f"{config.seed}-label-steps").sample(rows, min(rm.data.num_questions, len(rows)))
        model_len, weights = engine_setup(config, tokenizer, lambda: [r["prompt"] for r in rows], step_prefixes=True,
                                          weights=True)
        engine = make_engine(config.rollout, policy, tokenizer, config.seed, model_len, weights)
        sampled, completions = sample_completions(engine, rows, rm, config.grpo.max_completion_length,
                                                  progress=progress)
        started = time.perf_counter()
        examples, stats = rollout_step_examples(engine, sampled, completions, task.grade, rm,
                                                config.grpo.max_completion_length, progress)
        stats["seconds"] = time.perf_counter() - started
        if task.step_labeller is not None:  # the built-in task can check every step: how often rollouts agree
            by_prompt = {r["prompt"]: r for r in sampled}
            pairs = [(label, rule) for x in examples
                     for label, rule in zip(x.labels, task.step_labeller(by_prompt[x.prompt], list(x.steps)))]
            stats["agreement_with_rule_labels"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
            stats["wrong_steps_by_rule"] = sum(not b for _, b in pairs)
        write_jsonl(Path(out), [example_record(x) for x in examples])
        (run_dir / "label_steps_stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))
    print(f"wrote {len(examples)} step-labelled solutions to {out}")
    return stats


def run_train_rm(config: Config, progress: bool = True, data: str = "", run_dir_mode: str = NEW) -> Path:
    """Train an outcome (Bradley-Terry) or process (per-step BCE) reward model, initialised from
    model.name_or_path (or a fresh tiny model), on `data` or on the policy's own graded samples.
    Saves output_dir/reward_model in Hugging Face format with its held-out accuracy."""
    if config.reward_model.kind == "none":  # train-rm without --process: an outcome reward model
        config = dataclasses.replace(config, reward_model=dataclasses.replace(config.reward_model, kind="outcome"))
    rm = config.reward_model
    check_reward_model_fits(config, trains=True)
    examples = reward_model_examples(data, rm.kind, rm.step_delimiter, config.data.skip_malformed_lines,
                                     config.seed, rm.data.max_pairs_per_prompt) if data else None  # before the run starts
    with run_lock(config.output_dir, run_dir_mode):
        run_dir = start_run(config)
        policy, tokenizer = load_policy(config)
        task = task_for(config)
        rows = limit_prompts(task.data(tokenizer, sft=False).train, config, tokenizer) if not data else []
        model_len, _ = engine_setup(config, tokenizer, lambda: [r["prompt"] for r in rows],
                                    step_prefixes=labels_from_rollouts(config))
        engine = make_engine(config.rollout, policy, tokenizer, config.seed, model_len)
        stage = reward_model_stage(RunSetup(config, run_dir, task, policy, tokenizer, rows, progress, engine))
        if examples is None:
            metrics = stage.train_round(policy, 0)
        else:
            train, heldout = split_by_prompt(examples, rm.train.heldout_fraction, config.seed)
            losses = fit_reward_model(stage.scorer, train, rm, seed=config.seed, progress=progress)
            metrics = {"round": 0, "new_examples": len(train), "heldout_examples": len(heldout),
                       "final_loss": losses[-1], **evaluate_reward_model(stage.scorer, heldout)}
        del policy, engine
        path = stage.save(run_dir / "reward_model", metrics)
    print(json.dumps(metrics, indent=2))
    print(f"saved {path} ({rm.kind} reward model)")
    return path
