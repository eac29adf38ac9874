"""`grpokit train`: RL (config.algo) from model.name_or_path. prepare() builds the run's setup once
(config, task, policy, tokenizer, reference, rows, held-out rows, engine, run directory, the
checkpoint resumed); run_train reads top to bottom: evaluate before, reward model, trainer,
iterations, evaluate after, summary. (Moved here from pipeline/stages.py, which runs it in
`grpokit demo` after SFT.)

Under `torchrun --nproc_per_node=N -m grpokit train ...` every process runs this same code on its own
share of each batch (train/loop.py); rank 0 alone takes the run lock and writes files. The held-out
questions are evaluated before and after RL (eval.before), the before/after table goes to results.md
beside summary.json and the reward curve. With a learned reward (reward_model.kind), round 0 trains the
reward model on pi_SFT's own samples graded by rule, unless reward_model.path gives one;
iterative.iterations > 1 refreshes it between iterations.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from contextlib import ExitStack

import torch

from grpokit import distributed
from grpokit.config import Config, check_world_size, to_dict
from grpokit.data.sources import check_sources
from grpokit.eval.evaluate import evaluate, evaluate_task
from grpokit.eval.questions import write_heldout
from grpokit.eval.records import write_heldout_completions
from grpokit.models.lora import parameter_counts
from grpokit.models.precision import describe_precision
from grpokit.pipeline.build import RunSetup, make_trainer, reward_model_stage, seed_everything, start_run
from grpokit.pipeline.inputs import (
    check_reward_model_setup,
    engine_setup,
    heldout_rows,
    labels_from_rollouts,
    limit_prompts,
    load_trainable_policy,
)
from grpokit.pipeline.ray_cluster import RayLaunch
from grpokit.pipeline.report import report_results, stage_times
from grpokit.eval.validation import validation_accuracy, validation_summary
from grpokit.pipeline.resume import keep_rounds, resume_point
from grpokit.rollout import make_engine, max_model_len
from grpokit.rollout.engine import evaluation_engine
from grpokit.rollout.multi_turn import ToolEngine
from grpokit.rollout.remote import RemoteRollouts
from grpokit.run.claim import run_lock
from grpokit.run.directory import CLAIMED, NEW
from grpokit.run.memory import peak_rss_bytes
from grpokit.tasks import task_for
from grpokit.tasks.base import with_prompt_modes
from grpokit.tools import make_tool
from grpokit.train.iterative import rm_headline, run_iterations
from grpokit.train.sampling import sampling_params


def run_train(config: Config, progress: bool = True, resume: bool | str = False, force: bool = False,
              timings: dict | None = None, started: float | None = None, run_dir_mode: str = NEW) -> dict:
    """RL (config.algo) from model.name_or_path; with `resume`, continue exactly from the latest
    intact checkpoint of output_dir (or from the path given). A new run needs an unused output_dir
    (`run_dir_mode`: rundir.NEW, OVERWRITE or CLAIMED). Returns the run's summary."""
    started = started or time.perf_counter()
    check_train_inputs(config)
    timings = dict(timings or {})
    with run_lock(config.output_dir, CLAIMED if resume else run_dir_mode, can_resume=True), \
            ExitStack() as cleanup:
        run = prepare(config, progress, resume, force, cleanup)
        before, validation_before = _evaluate_before(run, timings)
        stage = _reward_model_for_run(run, timings)
        trainer = _trainer_for_run(run, stage, cleanup)
        rl_started = time.perf_counter()
        start = int(run.boundary.name.split("-")[1]) + 1 if run.boundary is not None else 1
        try:
            history = run_iterations(trainer, stage, config.iterative.iterations, start=start)
        finally:
            trainer.logger.close()
        final = trainer.checkpoints.latest()
        if trainer.interrupted:
            print("stopped before the final evaluation; the checkpoint above is loadable with from_pretrained")
            return {"interrupted": True, "checkpoint": str(final)}
        timings["rl_seconds"] = time.perf_counter() - rl_started
        summary = _summary(run, history, (before, validation_before), final, timings, started)
    print(stage_times(summary, config.algo))
    peak = f"; peak memory {summary['peak_rss_bytes'] / 2**30:.2f} GiB (RSS)" if "peak_rss_bytes" in summary else ""
    print(f"final checkpoint {final}; wall time {summary['wall_seconds']:.0f}s{peak}; wrote {run.run_dir}/summary.json")
    return summary


def check_train_inputs(config: Config) -> None:
    """What a run refuses before any model loads: unreadable data files, a reward model that cannot be
    set up, a world size the config does not split over."""
    for sources in (config.data.sources, config.data.eval_sources):
        check_sources(sources, config.data.skip_malformed_lines, needs_answer=not config.rewards)
    check_reward_model_setup(config)
    check_world_size(config, distributed.world_size(), distributed.local_world_size())


def prepare(config: Config, progress: bool, resume: bool | str, force: bool, cleanup: ExitStack) -> RunSetup:
    """The run's setup, built once under its lock: the Ray placement (launcher=ray), where it resumes,
    the run directory, the task, the policy (and pi_ref), the RL and held-out rows, and the rollout
    engine. What has to be closed (the engine, the placement) is pushed on `cleanup`."""
    # the placement before any model loads; rank 0 of a sharded trainer holds it
    ray = RayLaunch(config) if config.distributed.launcher == "ray" and distributed.is_main() else None
    if ray is not None:
        cleanup.callback(ray.close)
    checkpoint, boundary = resume_point(config, resume, force)
    run_dir = start_run(config, fresh=checkpoint is None, write=distributed.is_main())
    task = task_for(config)
    model, tokenizer, ref_model = load_trainable_policy(config, checkpoint, reference=True)
    data = task.data(tokenizer, sft=False)
    rows = limit_prompts(with_prompt_modes(task, data.train, config.task.prompt_modes, tokenizer), config, tokenizer)
    heldout = heldout_rows(data.heldout, config, tokenizer)
    if heldout and distributed.is_main():
        write_heldout(run_dir, heldout)  # what `grpokit eval RUN_DIR` evaluates
    print(f"{model.config.model_type}: {parameter_counts(model)}; {describe_precision(model)}; "
          f"{len(rows)} RL questions, {len(heldout)} held-out questions")

    def prompts() -> list[str]:  # its questions, the held-out ones and their TIR form when evaluated
        tir = task.tir_rows(heldout, tokenizer) if heldout and config.eval.tir else None
        return [r["prompt"] for r in rows + data.validation + heldout] + [r["prompt"] for r in tir or []]

    model_len, weights = engine_setup(config, tokenizer, prompts, labels_from_rollouts(config), weights=True,
                                      checkpoint=None if config.model.lora.r else checkpoint)
    engine = make_engine(config.rollout, model, tokenizer, config.seed, model_len, weights)
    cleanup.callback(engine.close)  # vLLM's own process groups go before torchrun's
    return RunSetup(config, run_dir, task, model, tokenizer, rows, progress, engine, ref_model, heldout,
                    checkpoint, boundary, model_len, ray, validation=data.validation)


def _evaluate_before(run: RunSetup, timings: dict):
    """(the held-out evaluation, the validation accuracy) before RL (eval.before; not on resume), or (None, {})."""
    if not (run.heldout and run.config.eval.before and run.checkpoint is None):
        return None, {}
    before = _evaluate_heldout(run, "before", timings)
    validation_before = validation_accuracy(run.task, run.model, run.tokenizer, run.validation, run.config,
                                            run.engine)
    run.engine.release_memory(weights_pushed_next=False)  # the reward model may train next
    print(f"before RL, held-out: {before.headline()}"
          + (f"; TIR greedy {before.tir.greedy_accuracy:.1%}" if before.tir else ""))
    return before, validation_before


def _evaluate_heldout(run: RunSetup, when: str, timings: dict):
    """The held-out evaluation `when` ("before" or "after") RL: its seconds go to timings, and its
    graded greedy completions to heldout-`when`.jsonl (CoT) and heldout-`when`-tir.jsonl (TIR)."""
    t = time.perf_counter()
    result = evaluate_task(run.task, run.model, run.tokenizer, run.heldout, run.config, evaluation_engine(run.engine),
                           progress=run.progress, desc=f"held-out eval {when} RL")
    if distributed.is_main():
        write_heldout_completions(run.run_dir / f"heldout-{when}.jsonl", run.heldout, result.greedy_completions,
                                  result.greedy_correct)
        if result.tir is not None:
            write_heldout_completions(run.run_dir / f"heldout-{when}-tir.jsonl", run.heldout, result.tir.completions,
                                      result.tir.correct)
    timings[f"eval_{when}_seconds"] = time.perf_counter() - t
    return result


def _reward_model_for_run(run: RunSetup, timings: dict):
    """The run's reward model: from an iteration boundary (with its replay buffer), from the one
    this run trained before (on resume), from reward_model.path, or trained now on the policy's
    graded samples (round 0) and saved as run_dir/reward_model. Its seconds go to timings."""
    config = run.config
    if config.reward_model.kind == "none":
        return None
    t = time.perf_counter()
    seed_everything(config.seed)  # the reward model's data does not depend on how pi_SFT was obtained
    own = run.run_dir / "reward_model"
    if run.boundary is not None:
        stage = reward_model_stage(run, path=str(run.boundary / "reward_model"))
        shutil.copyfile(run.boundary / "replay_buffer.jsonl", stage.buffer.path)
        stage.buffer.load()
        keep_rounds(run.run_dir, int(run.boundary.name.split("-")[1]))
    elif run.checkpoint is not None and not config.reward_model.path and (own / "config.json").is_file():
        stage = reward_model_stage(run, path=str(own))
        stage.buffer.load()  # round 0's replay share, which the next refresh must keep
        keep_rounds(run.run_dir, 0)
    else:
        stage = reward_model_stage(run)
        if not config.reward_model.path:
            metrics = stage.train_round(run.model, 0)
            stage.save(own, metrics)
            print(f"{config.reward_model.kind} reward model, held-out: {rm_headline(metrics)}")
    timings["reward_model_seconds"] = time.perf_counter() - t
    return stage


def _trainer_for_run(run: RunSetup, stage, cleanup: ExitStack):
    """The trainer, with the rollout workers (rollout.workers > 0), the periodic held-out evaluation
    (eval.every_steps) and, on resume, the checkpoint's state."""
    remote = _rollout_workers(run)
    if remote is not None:  # after a failure, without waiting on a worker that may hang
        cleanup.push(lambda error, *_: remote.close(failed=error is not None))
    seed_everything(distributed.process_seed(run.config.seed))  # generate's draws differ between processes
    trainer = make_trainer(run, _rl_engine(run), reward_scorer=stage.scorer if stage else None, remote=remote)
    trainer.after_step = _periodic_heldout(run, trainer.sampler)
    if run.checkpoint is not None:
        trainer.resume_from(run.checkpoint)
        if distributed.is_main():
            print(f"resumed from {run.checkpoint} at step {trainer.global_step}", file=sys.stderr)
    return trainer


def _rl_engine(run: RunSetup):
    """What RL samples from: with rollout.tool, multi-turn rollouts that call the tool (its output
    masked out of the loss); evaluation keeps the run's engine itself."""
    rollout = run.config.rollout
    if not rollout.tool:
        return run.engine
    tool = make_tool(rollout.tool, **rollout.tool_args)
    return ToolEngine(run.engine, run.tokenizer, tool, rollout.max_tool_calls)


def _rollout_workers(run: RunSetup):
    """rollout.workers > 0: the rollout workers, started (or, with worker_launch=external, awaited) and
    given the run's config; None: RL samples in this process. With launcher=ray, on the run's placement."""
    config, ray = run.config, run.ray
    if not config.rollout.workers or not distributed.is_main():  # a sharded trainer's rank 0 holds them
        return None
    started = time.perf_counter()
    remote = RemoteRollouts(config.rollout, to_dict(config), run.model,
                            dataclasses.asdict(sampling_params(config.grpo, config.rollout.shared_prefill)),
                            config.grpo.num_generations, run.model_len or max_model_len(config.rollout, run.model),
                            config.distributed.timeout_s, run.run_dir / "logs", run.tokenizer.pad_token_id,
                            transport=ray.transport if ray else None, launcher=ray.launcher if ray else None)
    print(f"{config.rollout.workers} rollout worker(s) ready at {remote.address} in "
          f"{time.perf_counter() - started:.1f}s; "
          f"rollout.mode={config.rollout.mode}, staleness {config.rollout.staleness}{remote.threads}")
    return remote


def _periodic_heldout(run: RunSetup, sampler):
    """eval.every_steps > 0: the trainer's after-step hook that evaluates the held-out questions greedily
    every that many steps (not the last one: the evaluation after RL is that one). Its accuracy joins the
    step's metrics row. It draws nothing from the run's random streams, so the run trains as without it.
    `sampler.ready_for_eval` first gives the run's engine this step's weights where rollout workers sampled."""
    config, task = run.config, run.task
    every = config.eval.every_steps
    if not (every and run.heldout):
        return None

    def after_step(step: int) -> dict:
        if step % every or step >= config.grpo.max_steps:
            return {}
        t = time.perf_counter()
        sampler.ready_for_eval(step)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            result = evaluate(run.model, run.tokenizer, run.heldout, task.extract_answer,
                              config.grpo.max_completion_length, k=0, batch_size=config.eval.batch_size,
                              engine=evaluation_engine(run.engine), grade=task.grade)
        return {"heldout/greedy_accuracy": result.greedy_accuracy,
                "perf/heldout_eval_time_s": time.perf_counter() - t}

    return after_step


def _summary(run: RunSetup, history: list, befores: tuple, final, timings: dict, started: float) -> dict:
    """The run's summary.json: the held-out evaluation after RL and the before/after results, the
    seconds of each stage, wall time and peak memory; written by rank 0."""
    config, (before, validation_before) = run.config, befores
    summary = {"seed": config.seed, "algo": config.algo, "checkpoint": str(final)}
    if run.heldout:
        after = _evaluate_heldout(run, "after", timings)
        summary.update(report_results(config, run.task, run.run_dir, history, before, after))
    summary.update(validation_summary(validation_before, validation_accuracy(
        run.task, run.model, run.tokenizer, run.validation, config, run.engine)))
    # The process's peak: the demo's SFT stage too, where it ran here (the README's memory figures).
    summary.update(timings, wall_seconds=time.perf_counter() - started, peak_rss_bytes=peak_rss_bytes())
    if distributed.is_main():
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
