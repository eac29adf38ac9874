"""The stages and their one composition. `grpokit sft`, `train-rm` and `train` run one stage
each on any checkpoint; `grpokit demo` runs the stages its preset (presets/demo.yaml) lists,
the same code: SFT -> pi_SFT saved and reloaded through the hub loader -> RL -> the table.

Under `torchrun --nproc_per_node=N -m grpokit train ...` every process runs this same code on
its own share of each batch (train/loop.py); the models are sharded with FSDP2
(models/sharding.py), and rank 0 alone takes the run lock and writes files.

`train` evaluates the task's held-out questions before and after RL (eval.before), writes the
before/after table (results.md), summary.json and the reward curve. With a learned reward
(reward_model.kind), round 0 trains the reward model on pi_SFT's own samples graded by rule,
unless reward_model.path gives one; iterative.iterations > 1 refreshes it between iterations.

The stages compose the building blocks of build.py; where a run resumes and what it refuses to
resume with are in resume.py, the before/after table and the summary's results in report.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.pipeline.build import load_policy, make_trainer, reward_model_stage, seed_everything, start_run
from grpokit.run.checkpoint import save_checkpoint
from grpokit.config import Config, ConfigError, check_world_size, to_dict
from grpokit.data.files import DatasetError, filter_long_prompts
from grpokit.data.reward_data import write_jsonl
from grpokit.data.sniff import reward_model_examples
from grpokit.data.sources import check_sources, heldout_note, long_prompts_note
from grpokit.eval.plots import plot_loss_curve
from grpokit.run.metrics import MetricsWriter, NullWriter, read_metrics
from grpokit.models.fits import checkpoint_parameters, tiny_llama_parameters, training_does_not_fit
from grpokit.models.loading import local_weights_dir, resolve_device
from grpokit.models.lora import apply_lora, is_lora, load_lora, parameter_counts
from grpokit.models.precision import describe_precision
from grpokit.models.sharding import shard_model, world_sharding
from grpokit.pipeline.report import report_results, stage_times
from grpokit.pipeline.resume import keep_rounds, resume_point
from grpokit.rollout import engine_spec, longest_prompt_tokens, make_engine, max_model_len, run_max_model_len
from grpokit.rollout.engine import evaluation_engine
from grpokit.pipeline.ray_cluster import RayLaunch
from grpokit.rollout.remote import RemoteRollouts
from grpokit.run.directory import CLAIMED, NEW, claim_run_dir
from grpokit.run.lock import RunLock
from grpokit.run.memory import peak_rss_bytes
from grpokit.rollout.multi_turn import ToolEngine
from grpokit.tasks import task_for
from grpokit.tasks.base import with_prompt_modes
from grpokit.tools import make_tool
from grpokit.eval.evaluate import evaluate, evaluate_task
from grpokit.eval.questions import write_heldout
from grpokit.eval.records import write_heldout_completions
from grpokit.eval.validation import validation_accuracy, validation_summary
from grpokit.models.reference import frozen_copy
from grpokit.train.sampling import sampling_params
from grpokit.train.iterative import rm_headline, run_iterations
from grpokit.train.reward_model import (
    evaluate_reward_model,
    example_record,
    fit_reward_model,
    rollout_step_examples,
    sample_completions,
    split_by_prompt,
)
from grpokit.train.sft import sft_train


def on_main(step, what: str) -> None:
    """Run `step` on rank 0 alone; when it fails there, every process stops (rank 0 with its error)."""
    failure = None
    if distributed.is_main():
        try:
            step()
        except Exception as err:
            failure = err
    if not distributed.all_agree(failure is None):
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not {what}; see its message")


@contextmanager
def run_lock(output_dir: str, mode: str = CLAIMED, can_resume: bool = False):
    """The run directory's lock, taken by rank 0 alone (the other processes write nothing there),
    and the directory claimed for a new run (rundir.claim_run_dir) unless `mode` is CLAIMED;
    when rank 0 cannot take or claim it, every process stops."""
    lock = RunLock(output_dir)
    on_main(lock.__enter__, f"lock the run directory {output_dir}")
    try:
        on_main(lambda: claim_run_dir(output_dir, mode, can_resume), f"claim the run directory {output_dir}")
        yield
    finally:
        if distributed.is_main():
            lock.__exit__(None, None, None)


def claim(output_dir: str, mode: str) -> None:
    """Claim output_dir for a new run (rundir.claim_run_dir) under its lock, then release the lock
    for the run's stages to take in turn."""
    with run_lock(output_dir, mode):
        pass


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
        model, tokenizer = load_policy(config, trainable=not lora)
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:  # the checkpoint holds the adapter, which loads with its base (model.name_or_path)
            model = apply_lora(model, config.model.lora)
        print(f"{model.config.model_type}: {parameter_counts(model)}; {describe_precision(model)}")
        if world_sharding(config.distributed.fsdp):
            shard_model(model)
        demos = _limit_prompts(task_for(config).data(tokenizer).sft, config, tokenizer)
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


def _limit_prompts(rows: list[dict], config: Config, tokenizer) -> list[dict]:
    """Apply data.max_prompt_length to RL questions or SFT demonstrations, saying in one line how
    many of how many it dropped or cut."""
    d = config.data
    is_sft = bool(rows) and "completion" in rows[0]  # only demonstrations carry their target
    what, key = ("SFT demonstrations", "data.sft_sources") if is_sft else ("RL questions", "data.sources")
    kept, long = filter_long_prompts(rows, tokenizer, d.max_prompt_length, d.long_prompts, key)
    if long:
        print(long_prompts_note(long, len(rows), what, d), file=sys.stderr)
    return kept


def _heldout_rows(rows: list[dict], config: Config, tokenizer) -> list[dict]:
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


def check_reward_model_setup(config: Config) -> None:
    """Setups that could only fail after training has started, refused before any model loads."""
    rm = config.reward_model
    needs_labels = not rm.path or config.iterative.iterations > 1
    if rm.kind == "process" and config.data.sources and needs_labels and rm.label.method == "rule":
        raise ConfigError(
            "process labels for data.sources cannot be made by rule (only the built-in task has a step checker): "
            "set reward_model.label.method=rollouts to label steps from rollouts, or train a PRM with `grpokit "
            "label-steps` + `grpokit train-rm --process --data STEPS.jsonl` and set reward_model.path to it")
    _check_reward_model_fits(config)


def _check_reward_model_fits(config: Config, trains: bool = False) -> None:
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


def _reward_model_for_run(config: Config, task, policy, tokenizer, rows, run_dir: Path, progress: bool, checkpoint,
                          boundary: Path | None, engine):
    """The run's reward model: from an iteration boundary (with its replay buffer), from the one
    this run trained before (on resume), from reward_model.path, or trained now on the policy's
    graded samples (round 0) and saved as run_dir/reward_model."""
    if config.reward_model.kind == "none":
        return None
    seed_everything(config.seed)  # the reward model's data does not depend on how pi_SFT was obtained
    own = run_dir / "reward_model"
    stage_args = (config, task, policy, tokenizer, rows, run_dir, progress)
    if boundary is not None:
        stage = reward_model_stage(*stage_args, path=str(boundary / "reward_model"), engine=engine)
        shutil.copyfile(boundary / "replay_buffer.jsonl", stage.buffer.path)
        stage.buffer.load()
        keep_rounds(run_dir, int(boundary.name.split("-")[1]))
        return stage
    if checkpoint is not None and not config.reward_model.path and (own / "config.json").is_file():
        stage = reward_model_stage(*stage_args, path=str(own), engine=engine)
        stage.buffer.load()  # round 0's replay share, which the next refresh must keep
        keep_rounds(run_dir, 0)
        return stage
    stage = reward_model_stage(*stage_args, engine=engine)
    if not config.reward_model.path:
        metrics = stage.train_round(policy, 0)
        stage.save(own, metrics)
        print(f"{config.reward_model.kind} reward model, held-out: {rm_headline(metrics)}")
    return stage


def _policy_for_run(config: Config, checkpoint: Path | None):
    """(policy, tokenizer, reference or None) for RL: model.name_or_path, or the checkpoint resumed;
    with LoRA (model.lora.r > 0), the base model plus new or resumed adapters, and no separate
    reference (the trainer runs the base under the adapters). None = the trainer makes the reference."""
    lora = config.model.lora.r > 0
    # a LoRA base is frozen (compute dtype); a full fine-tune holds model.master_dtype weights
    model, tokenizer = load_policy(config, None if lora or checkpoint is None else str(checkpoint), trainable=not lora)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if lora:
        model = apply_lora(model, config.model.lora) if checkpoint is None else load_lora(model, checkpoint)
    elif checkpoint is not None and config.grpo.beta > 0:
        # the resumed policy, and the initial one frozen in place as pi_ref: two copies, not three
        # loaded as the uninterrupted run's policy was, then frozen the same way: the same pi_ref
        ref_model = frozen_copy(load_policy(config)[0])
    return model, tokenizer, ref_model


def _shard_for_run(config: Config, model, ref_model):
    """FSDP2 for the policy and the frozen reference (made before sharding: a sharded model cannot be
    copied) when distributed.fsdp asks for it; the pair to train with."""
    if not world_sharding(config.distributed.fsdp):
        return model, ref_model
    if ref_model is None and config.grpo.beta > 0 and not is_lora(model):
        ref_model = frozen_copy(model)
    shard_model(model)
    if ref_model is not None:
        shard_model(ref_model)
    return model, ref_model


def _engine_model_len(config: Config, tokenizer, prompts: list[str], tir_prompts: list[str] | None = None,
                      step_prefixes: bool = False) -> int | None:
    """A vLLM engine's max_model_len for a run over `prompts` and `tir_prompts` (None for hf): the
    longest prompt + grpo.max_completion_length, which bounds a TIR completion too, tool output
    included (rollout/multi_turn.py); twice that completion when step prefixes are continued
    (process labels from rollouts)."""
    if not engine_spec(config.rollout.engine).copies_weights:
        return None
    c = config.grpo.max_completion_length
    room = 2 * c if step_prefixes else c
    longest = longest_prompt_tokens(tokenizer, [*prompts, *(tir_prompts or [])])
    return run_max_model_len(config.rollout, longest + room,
                             f"the longest prompt ({longest} tokens) + {room} completion tokens")


def _train_model_len(config: Config, task, tokenizer, rows: list[dict], heldout: list[dict]) -> int | None:
    """_engine_model_len for RL: its questions, the held-out ones and their TIR form when evaluated."""
    if not engine_spec(config.rollout.engine).copies_weights:
        return None
    tir = task.tir_rows(heldout, tokenizer) if heldout and config.eval.tir else None
    return _engine_model_len(config, tokenizer, [r["prompt"] for r in rows + heldout],
                             [r["prompt"] for r in tir or []], _labels_from_rollouts(config))


def _loaded_weights_dir(config: Config, checkpoint: Path | None = None) -> str | None:
    """Where the policy just loaded (from `checkpoint`, else model.name_or_path; a LoRA policy's
    base) lies in from_pretrained form, for a vLLM engine to load without a copy; None for a tiny
    model built in memory, or weights vLLM cannot read alone."""
    if not engine_spec(config.rollout.engine).copies_weights:
        return None
    source = str(checkpoint) if checkpoint is not None else config.model.name_or_path
    return local_weights_dir(source) if source else None


def _labels_from_rollouts(config: Config) -> bool:
    return config.reward_model.kind == "process" and config.reward_model.label.method == "rollouts"



def _evaluate_heldout(when: str, task, model, tokenizer, heldout: list[dict], config: Config, engine, run_dir: Path,
                      progress: bool, timings: dict):
    """The held-out evaluation `when` ("before" or "after") RL: its seconds go to timings, and its
    graded greedy completions to heldout-`when`.jsonl (CoT) and heldout-`when`-tir.jsonl (TIR)."""
    t = time.perf_counter()
    result = evaluate_task(task, model, tokenizer, heldout, config, evaluation_engine(engine), progress=progress,
                           desc=f"held-out eval {when} RL")
    if distributed.is_main():
        write_heldout_completions(run_dir / f"heldout-{when}.jsonl", heldout, result.greedy_completions,
                                  result.greedy_correct)
        if result.tir is not None:
            write_heldout_completions(run_dir / f"heldout-{when}-tir.jsonl", heldout, result.tir.completions,
                                      result.tir.correct)
    timings[f"eval_{when}_seconds"] = time.perf_counter() - t
    return result


def _periodic_heldout(config: Config, task, model, tokenizer, heldout: list[dict], engine, sampler):
    """eval.every_steps > 0: the trainer's after-step hook that evaluates the held-out questions greedily
    every that many steps (not the last one: the evaluation after RL is that one). Its accuracy joins the
    step's metrics row. It draws nothing from the run's random streams, so the run trains as without it.
    `sampler.ready_for_eval` first gives `engine` this step's weights where rollout workers sampled instead."""
    every = config.eval.every_steps
    if not (every and heldout):
        return None

    def after_step(step: int) -> dict:
        if step % every or step >= config.grpo.max_steps:
            return {}
        t = time.perf_counter()
        sampler.ready_for_eval(step)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            result = evaluate(model, tokenizer, heldout, task.extract_answer, config.grpo.max_completion_length,
                              k=0, batch_size=config.eval.batch_size, engine=evaluation_engine(engine),
                              grade=task.grade)
        return {"heldout/greedy_accuracy": result.greedy_accuracy,
                "perf/heldout_eval_time_s": time.perf_counter() - t}

    return after_step


def _rl_engine(config: Config, engine, tokenizer):
    """What RL samples from: with rollout.tool, multi-turn rollouts that call the tool (its output
    masked out of the loss); evaluation keeps `engine` itself."""
    if not config.rollout.tool:
        return engine
    tool = make_tool(config.rollout.tool, **config.rollout.tool_args)
    return ToolEngine(engine, tokenizer, tool, config.rollout.max_tool_calls)

def _rollout_workers(config: Config, model, tokenizer, model_len: int | None, run_dir: Path, ray=None):
    """rollout.workers > 0: the rollout workers, started (or, with worker_launch=external, awaited) and
    given the run's config; None: RL samples in this process. ray: the run's RayLaunch (launcher=ray)."""
    if not config.rollout.workers or not distributed.is_main():  # a sharded trainer's rank 0 holds them
        return None
    started = time.perf_counter()
    remote = RemoteRollouts(config.rollout, to_dict(config), model, dataclasses.asdict(sampling_params(config.grpo, config.rollout.shared_prefill)),
                            config.grpo.num_generations, model_len or max_model_len(config.rollout, model),
                            config.distributed.timeout_s, run_dir / "logs", tokenizer.pad_token_id,
                            transport=ray.transport if ray else None, launcher=ray.launcher if ray else None)
    print(f"{config.rollout.workers} rollout worker(s) ready at {remote.address} in "
          f"{time.perf_counter() - started:.1f}s; "
          f"rollout.mode={config.rollout.mode}, staleness {config.rollout.staleness}{remote.threads}")
    return remote


def run_train(config: Config, progress: bool = True, resume: bool | str = False, force: bool = False,
              timings: dict | None = None, started: float | None = None, run_dir_mode: str = NEW) -> dict:
    """RL (config.algo) from model.name_or_path; with `resume`, continue exactly from the latest
    intact checkpoint of output_dir (or from the path given). A new run needs an unused output_dir
    (`run_dir_mode`: rundir.NEW, OVERWRITE or CLAIMED). Returns the run's summary."""
    started = started or time.perf_counter()
    for sources in (config.data.sources, config.data.eval_sources):  # file errors before any model loads
        check_sources(sources, config.data.skip_malformed_lines, needs_answer=not config.rewards)
    check_reward_model_setup(config)
    check_world_size(config, distributed.world_size(), distributed.local_world_size())
    with run_lock(config.output_dir, CLAIMED if resume else run_dir_mode, can_resume=True), \
            ExitStack() as cleanup:
        # the placement before any model loads; rank 0 of a sharded trainer holds it
        ray = RayLaunch(config) if config.distributed.launcher == "ray" and distributed.is_main() else None
        if ray is not None:
            cleanup.callback(ray.close)
        checkpoint, boundary = resume_point(config, resume, force)
        run_dir = start_run(config, fresh=checkpoint is None, write=distributed.is_main())
        task = task_for(config)
        model, tokenizer, ref_model = _policy_for_run(config, checkpoint)
        model, ref_model = _shard_for_run(config, model, ref_model)
        data = task.data(tokenizer, sft=False)
        rows = _limit_prompts(with_prompt_modes(task, data.train, config.task.prompt_modes, tokenizer), config, tokenizer)
        heldout = _heldout_rows(data.heldout, config, tokenizer)
        if heldout and distributed.is_main():
            write_heldout(run_dir, heldout)  # what `grpokit eval RUN_DIR` evaluates
        print(f"{model.config.model_type}: {parameter_counts(model)}; {describe_precision(model)}; "
              f"{len(rows)} RL questions, {len(heldout)} held-out questions")
        engine = make_engine(config.rollout, model, tokenizer, config.seed,
                             _train_model_len(config, task, tokenizer, rows + data.validation, heldout),
                             _loaded_weights_dir(config, None if config.model.lora.r else checkpoint))
        cleanup.callback(engine.close)  # vLLM's own process groups go before torchrun's
        timings = dict(timings or {})
        before, validation_before = None, {}
        if heldout and config.eval.before and checkpoint is None:
            before = _evaluate_heldout("before", task, model, tokenizer, heldout, config, engine, run_dir, progress,
                                       timings)
            validation_before = validation_accuracy(task, model, tokenizer, data.validation, config, engine)
            engine.release_memory(weights_pushed_next=False)  # the reward model may train next
            print(f"before RL, held-out: {before.headline()}"
                  + (f"; TIR greedy {before.tir.greedy_accuracy:.1%}" if before.tir else ""))
        t = time.perf_counter()
        stage = _reward_model_for_run(config, task, model, tokenizer, rows, run_dir, progress, checkpoint, boundary,
                                      engine)
        if stage is not None:
            timings["reward_model_seconds"] = time.perf_counter() - t
        remote = _rollout_workers(config, model, tokenizer,
                                  _train_model_len(config, task, tokenizer, rows + data.validation, heldout), run_dir, ray)
        if remote is not None:  # after a failure, without waiting on a worker that may hang
            cleanup.push(lambda error, *_: remote.close(failed=error is not None))
        seed_everything(distributed.process_seed(config.seed))  # generate's draws differ between processes
        trainer = make_trainer(config, model, tokenizer, rows, run_dir, progress, ref_model,
                               reward_scorer=stage.scorer if stage else None,
                               engine=_rl_engine(config, engine, tokenizer), remote=remote)
        trainer.after_step = _periodic_heldout(config, task, model, tokenizer, heldout, engine, trainer.sampler)
        if checkpoint is not None:
            trainer.resume_from(checkpoint)
            if distributed.is_main():
                print(f"resumed from {checkpoint} at step {trainer.global_step}", file=sys.stderr)
        rl_started = time.perf_counter()
        start = int(boundary.name.split("-")[1]) + 1 if boundary is not None else 1
        try:
            history = run_iterations(trainer, stage, config.iterative.iterations, start=start)
        finally:
            trainer.logger.close()
        final = trainer.checkpoints.latest()
        if trainer.interrupted:
            print("stopped before the final evaluation; the checkpoint above is loadable with from_pretrained")
            return {"interrupted": True, "checkpoint": str(final)}
        timings["rl_seconds"] = time.perf_counter() - rl_started
        summary = {"seed": config.seed, "algo": config.algo, "checkpoint": str(final)}
        if heldout:
            after = _evaluate_heldout("after", task, model, tokenizer, heldout, config, engine, run_dir, progress,
                                      timings)
            summary.update(report_results(config, task, run_dir, history, before, after))
        summary.update(validation_summary(validation_before,
                                          validation_accuracy(task, model, tokenizer, data.validation, config, engine)))
        # The process's peak: the demo's SFT stage too, where it ran here (the README's memory figures).
        summary.update(timings, wall_seconds=time.perf_counter() - started, peak_rss_bytes=peak_rss_bytes())
        if distributed.is_main():
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(stage_times(summary, config.algo))
    peak = f"; peak memory {summary['peak_rss_bytes'] / 2**30:.2f} GiB (RSS)" if "peak_rss_bytes" in summary else ""
    print(f"final checkpoint {final}; wall time {summary['wall_seconds']:.0f}s{peak}; wrote {run_dir}/summary.json")
    return summary


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
        rows = _limit_prompts(task.data(tokenizer, sft=False).train, config, tokenizer)
        rows = random.Random(f"{config.seed}-label-steps").sample(rows, min(rm.data.num_questions, len(rows)))
        model_len = _engine_model_len(config, tokenizer, [r["prompt"] for r in rows], step_prefixes=True)
        engine = make_engine(config.rollout, policy, tokenizer, config.seed, model_len, _loaded_weights_dir(config))
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
    _check_reward_model_fits(config, trains=True)
    examples = reward_model_examples(data, rm.kind, rm.step_delimiter, config.data.skip_malformed_lines,
                                     config.seed, rm.data.max_pairs_per_prompt) if data else None  # before the run starts
    with run_lock(config.output_dir, run_dir_mode):
        run_dir = start_run(config)
        policy, tokenizer = load_policy(config)
        task = task_for(config)
        rows = _limit_prompts(task.data(tokenizer, sft=False).train, config, tokenizer) if not data else []
        model_len = _engine_model_len(config, tokenizer, [r["prompt"] for r in rows],
                                      step_prefixes=_labels_from_rollouts(config))
        engine = make_engine(config.rollout, policy, tokenizer, config.seed, model_len)
        stage = reward_model_stage(config, task, policy, tokenizer, rows, run_dir, progress, engine=engine)
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
