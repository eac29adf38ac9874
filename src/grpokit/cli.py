"""Command line: `grpokit demo | sft | train | train-rm | bench | eval`. Every config key is an
override, --key=value or --key value; every subcommand spells its shared options the same way."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from importlib import resources

from grpokit import distributed
from grpokit.bench.cost import main as cost_main
from grpokit.bench.limit import main as limit_main
from grpokit.bench.memory import main as memory_main
from grpokit.run.checkpoint import CheckpointError
from grpokit.checks import load_config  # the config with its names checked against the registries
from grpokit.config import Config, ConfigError, describe
from grpokit.data.files import DatasetError
from grpokit.distributed import PeerFailure
from grpokit.math import ADVANTAGES, IS_CORRECTIONS, POLICY_LOSSES
from grpokit.models.loading import ModelNotFound, check_model_config
from grpokit.rewards.registry import reward_names
from grpokit.rollout.engine import RolloutEngineError, WeightSyncError
from grpokit.run.directory import NEW, OVERWRITE, RunComplete, RunDirectoryInUse, default_run_dir, latest_default_run_dir
from grpokit.run.lock import RunDirectoryLocked, RunDirectoryUnwritable
from grpokit.tasks.registry import task_names

# The training stack (stages, train, eval and what only they use) is imported where a command
# runs, not here: `grpokit --help` and `grpokit bench` start without it.

DEMO_PRESET = resources.files("grpokit") / "presets" / "demo.yaml"
# The demo's model-reward variants also read this layer (grpo.beta 0.2; README: reward models).
DEMO_REWARD_MODEL_PRESET = resources.files("grpokit") / "presets" / "demo_reward_model.yaml"
COMMANDS = {
    "demo": "SFT a tiny model, GRPO it, show the before/after table (CPU, minutes); the stages of presets/demo.yaml",
    "sft": "SFT model.name_or_path on data.sft_sources (default: the built-in task's demonstrations)",
    "train": "RL (GRPO or PPO) from model.name_or_path on data.sources (default: the built-in task), "
             "evaluating held-out questions before and after",
    "train-rm": "train an outcome (Bradley-Terry) or, with --process, a process reward model",
    "label-steps": "label the steps of the policy's sampled solutions from rollouts (Math-Shepherd), for "
                   "train-rm --process --data",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO (DeepSeekMath) for causal language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="grpokit bench cost | memory | limit: the cost of GRPO vs PPO, measured or analytic; generation against the machine's limit",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    sub.add_parser("rollout-worker", help="grpokit rollout-worker --connect HOST:PORT --index I: sample for a trainer "
                                          "started with rollout.workers (docs/async.md)", add_help=False).add_argument(
        "worker_args", nargs=argparse.REMAINDER)
    sub.add_parser("convert-gguf", help="grpokit convert-gguf SRC DEST: a GGUF checkpoint (a .gguf file or a "
                                        "directory holding one) as a plain Hugging Face folder that trains",
                   add_help=False).add_argument("convert_args", nargs=argparse.REMAINDER)
    sub.add_parser("eval", help="grpokit eval MODEL --data FILE...: CoT and tool-integrated accuracy (DeepSeekMath "
                                "Table 5); see grpokit eval --help", add_help=False).add_argument(
        "eval_args", nargs=argparse.REMAINDER)
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, epilog=config_keys_help(name == "demo"),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("config", nargs="?", help="YAML config" + (" laid over the demo preset" if name == "demo" else ""))
        p.add_argument("--output-dir", "--output_dir", dest="output_dir",
                       help=f"run directory (config key output_dir); default runs/{name}, or runs/{name}-N when "
                            "that holds a run. A directory that holds another run is refused")
        p.add_argument("--overwrite", action="store_true",
                       help="delete the earlier run in the run directory first (it is never overwritten otherwise)")
        p.add_argument("--seed", type=int, help="seed (config key seed)")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
    demo, train, rm, label = (sub.choices[n] for n in ("demo", "train", "train-rm", "label-steps"))
    label.add_argument("--data", default="", metavar="FILE",
                       help="questions with reference answers (gsm8k, math or plain format); default: the built-in "
                            "task's questions")
    label.add_argument("--out", required=True, metavar="STEPS.jsonl", help="where the labelled solutions go")
    demo.add_argument("--reward", choices=["rule", "model"],
                      help="rule: the verifier (default); model: a reward model trained on pi_SFT's graded samples")
    demo.add_argument("--supervision", choices=["outcome", "process"],
                      help="outcome (default), or process: a process reward model scores each step (eq. 6)")
    demo.add_argument("--iterative", type=int, metavar="K",
                      help="iterative GRPO with K iterations, refreshing the reward model (implies --reward model)")
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                       help="continue exactly from the latest intact checkpoint of output_dir, or from PATH")
    train.add_argument("--force", action="store_true", help="resume even if the config changed")
    rm.add_argument("--process", action="store_true", help="a process reward model: one score per step")
    rm.add_argument("--data", default="", metavar="FILE",
                    help="JSONL/JSON/Parquet of (prompt, chosen, rejected) pairs, or (prompt, completion, correct) "
                         "graded samples; with --process, (prompt, completion|steps, labels). Default: the "
                         "policy's own samples on the task, graded by rule")
    return parser


def config_keys_help(demo: bool) -> str:
    """The epilog listing every config key; for `demo`, with the preset's values as the defaults."""
    defaults = load_config([str(DEMO_PRESET)]) if demo else None
    notes = {"rewards": f"(built-in names: {', '.join(reward_names())}; or 'package.module:function')",
             "grpo.loss": f"(registered: {', '.join(sorted(POLICY_LOSSES))}; or 'package.module:name')",
             "grpo.advantage": f"(registered: {', '.join(sorted(ADVANTAGES))}; or 'package.module:name')",
             "rollout.is_correction": f"(registered: none, {', '.join(sorted(IS_CORRECTIONS))}; or "
                                      f"'package.module:name')",
             "task.name": f"(registered: {', '.join(task_names())})"}
    return ("config keys (YAML or --key=value; a bare leaf name works when unique)"
            + (", with the demo preset's values:\n" if demo else ":\n") + describe(Config, defaults, notes))


def own_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string a subcommand defines itself (all else is a config key)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}


def join_override_values(argv: list[str]) -> list[str]:
    """`--key value` -> `--key=value` for config keys, so a value is never taken for the CONFIG path."""
    own = own_options(_parser()) - {"--output_dir"}  # the config key's own spelling joins like any key
    out: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        is_key = item.startswith("--") and "=" not in item and item not in own
        if is_key and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{item}={argv[i + 1]}")
            i += 2
        else:
            out.append(item)
            i += 1
    return out


def demo_variant_overrides(args) -> list[str]:
    """`--reward model`, `--supervision process`, `--iterative K` as config overrides. A reward
    model replaces the rule-based reward, so the run shows what the learned reward alone teaches."""
    process = getattr(args, "supervision", None) == "process" or getattr(args, "process", False)
    model = getattr(args, "reward", None) == "model" or getattr(args, "iterative", None) or process
    out = []
    if model:
        out.append(f"--reward_model.kind={'process' if process else 'outcome'}")
    if args.command == "demo" and model:
        out.append("--rewards=[]")
    if getattr(args, "iterative", None) is not None:
        out.append(f"--iterative.iterations={args.iterative}")
    return out


def bench(argv: list[str]) -> int:
    """`grpokit bench cost ...` (measured), `grpokit bench memory ...` (analytic) or `grpokit bench limit ...`."""
    if argv[:1] == ["cost"]:
        return cost_main(argv[1:])
    if argv[:1] == ["memory"]:
        return memory_main(argv[1:])
    if argv[:1] == ["limit"]:
        return limit_main(argv[1:])
    asked = argv[:1] in (["-h"], ["--help"])
    print("usage: grpokit bench cost [--json PATH] [options]   GRPO vs PPO measured on one model\n"
          "       grpokit bench memory [--params 7e9 ...]      model-state memory of GRPO vs PPO, analytic\n"
          "       grpokit bench memory --measure [...]        peak memory per process, full vs LoRA, 1 vs 2\n"
          "       grpokit bench limit [--json PATH] [options] generation against this machine's bandwidth and FLOP/s\n"
          "grpokit bench cost --help (memory, limit): their options",
          file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


def quiet_dependency_warnings() -> None:
    """Deprecation notices that transformers, PEFT and accelerate raise about their own APIs (e.g.
    transformers' `is_gradient_checkpointing` FutureWarning, triggered inside PEFT) are meant for
    grpokit's code, not for the user: keep them off the console. Warnings from anywhere else stay."""
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(transformers|peft|accelerate)(\.|$)")


def convert_gguf(argv: list[str]) -> int:
    """`grpokit convert-gguf SRC DEST`: grpokit.models.gguf.convert_gguf, its logit check printed."""
    parser = argparse.ArgumentParser(prog="grpokit convert-gguf", description=(
        "Convert a GGUF checkpoint into a plain Hugging Face folder (safetensors, config, tokenizer with its chat "
        "template, generation config), then check that the folder's logits equal the GGUF's on a fixed prompt. "
        "Needs the gguf package: pip install 'grpokit[models]'."))
    parser.add_argument("src", help="a .gguf file, or a directory holding one")
    parser.add_argument("dest", help="the directory to write: new or empty")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from grpokit.models.gguf import GgufConversionError, convert_gguf as convert

    hf_logging.disable_progress_bar()
    try:
        done = convert(args.src, args.dest)
    except GgufConversionError as err:
        print(f"grpokit: error: {err}", file=sys.stderr)
        return 1
    print(f"{done.dest}: {done.parameters:,} parameters from {done.gguf_file}; logits on a {done.prompt_tokens}-token "
          f"prompt (fp32) match the GGUF's within {done.max_abs_logit_diff:.3g} (tolerance {done.tolerance:g})")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_dependency_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] == ["bench"]:
        return bench(argv[1:])  # its own usage, --help included
    if argv[:1] == ["rollout-worker"]:
        from grpokit.pipeline.rollout_worker import main as worker_main  # see the imports at the top

        return worker_main(argv[1:])
    if argv[:1] == ["convert-gguf"]:
        return convert_gguf(argv[1:])
    if argv[:1] == ["eval"]:
        from grpokit.eval.command import main as eval_main  # see the imports at the top

        return eval_main(argv[1:])
    quiet_library_progress()
    argv = join_override_values(argv)
    own = own_options(parser)
    # Config overrides bypass argparse, which would take a value with spaces for the CONFIG path.
    overrides = [a for a in argv if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in own]
    args, unknown = parser.parse_known_args([a for a in argv if a not in overrides])
    overrides += unknown
    if args.output_dir:
        overrides.append(f"--output_dir={args.output_dir}")
    if args.seed is not None:
        overrides.append(f"--seed={args.seed}")
    overrides += demo_variant_overrides(args)
    if args.command == "label-steps" and args.data:
        overrides.append(f"--data.sources=[{{path: {args.data!r}}}]")
    user_files = [args.config] if args.config else []
    files = [str(DEMO_PRESET), *user_files] if args.command == "demo" else user_files

    def load_and_run() -> int:
        config = load_config(files, overrides)  # fails here, before any model loads
        if args.command == "demo" and config.reward_model.kind != "none":  # a layer under the user's own
            config = load_config([str(DEMO_PRESET), str(DEMO_REWARD_MODEL_PRESET), *user_files], overrides)
        check_model_config(config)
        choose_run_dir(args, config)
        if config.distributed.launcher == "ray" and config.distributed.ranks > 1 and not distributed.launched():
            from grpokit.pipeline import ray_trainers  # see the imports at the top

            return ray_trainers.run(config, functools.partial(_run_as_ray_rank, args, config))
        return _run(args, config)

    return _reporting_errors(load_and_run)


def _run_as_ray_rank(args, config) -> int:
    """The command in a trainer rank's Ray actor (pipeline/ray_trainers.py), set up as main sets up this process."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_dependency_warnings()
    quiet_library_progress()
    return run_loaded(args, config)


def quiet_library_progress() -> None:
    """Our own bars show training; not transformers' per-shard file I/O."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def run_loaded(args, config) -> int:
    """Run the command of a loaded config: its exit code, with the errors a user can act on reported in one
    line (a trainer rank that Ray started runs this too, pipeline/ray_trainers.py)."""
    return _reporting_errors(lambda: _run(args, config))


def _reporting_errors(run) -> int:
    try:
        return run()
    except ConfigError as err:
        print(f"grpokit: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpokit: interrupted; checkpoints already written are intact", file=sys.stderr)
        return 130
    except _expected_errors() as err:
        print(f"grpokit: error: {err}", file=sys.stderr)
        return 1


def choose_run_dir(args, config) -> None:
    """output_dir when none is given: runs/<command>, or the next free runs/<command>-N (a bare
    --resume continues the newest of them); said on stderr, so the user knows where the run went."""
    if args.overwrite and getattr(args, "resume", False):
        raise ConfigError("--overwrite starts afresh and --resume continues: pass one of them")
    if config.output_dir:
        return
    resume = getattr(args, "resume", False)
    config.output_dir = str(latest_default_run_dir(args.command) if resume else default_run_dir(args.command))
    print(f"grpokit: run directory {config.output_dir} (--output-dir picks another)", file=sys.stderr)


def _expected_errors() -> tuple[type[Exception], ...]:
    """Failures with a message that already says what to do: no traceback needed."""
    from grpokit.train.failures import NonFiniteTraining, RewardFailure  # see the imports at the top
    from grpokit.train.reward_model import RewardModelDataError
    from grpokit.rewards.likelihood_prm import LikelihoodFitError
    from grpokit.rollout.wire import RolloutWorkerError

    return (CheckpointError, DatasetError, ModelNotFound, RunDirectoryLocked, NonFiniteTraining, RewardFailure,
            RewardModelDataError, LikelihoodFitError, PeerFailure, RunComplete, RunDirectoryInUse, RunDirectoryUnwritable,
            WeightSyncError, RolloutWorkerError, RolloutEngineError)


def _run(args, config) -> int:
    """Run the command; under torchrun, in a process group (every process runs this same code)."""
    from grpokit.pipeline import stages  # see the imports at the top

    if distributed.env_world_size() > 1 and args.command not in ("train", "sft"):
        raise ConfigError(f"`grpokit {args.command}` runs in one process; under torchrun `grpokit train` and "
                          "`grpokit sft` are data parallel")
    if config.distributed.ranks > 1 and distributed.launched() and not distributed.started_by_ray():
        raise ConfigError(f"distributed.ranks={config.distributed.ranks} is the number of trainer processes Ray starts; "
                          "under torchrun, --nproc_per_node sets it: leave distributed.ranks at 1")
    distributed.report_crashes()
    distributed.init(config.distributed.timeout_s)
    distributed.main_only_stdout()
    finished = False
    try:
        progress, mode = not args.quiet, OVERWRITE if args.overwrite else NEW
        if args.command == "demo":
            stages.run_demo(config, progress, mode)
        elif args.command == "label-steps":
            stages.run_label_steps(config, args.out, progress, mode)
        elif args.command == "train-rm":
            stages.run_train_rm(config, progress, data=args.data, run_dir_mode=mode)
        elif args.command == "train":
            if config.sft.checkpoint and not config.model.name_or_path and not args.resume:
                print(f"grpokit: warning: sft.checkpoint={config.sft.checkpoint} is read by `grpokit demo`'s stages; "
                      "`grpokit train` starts from model.name_or_path, unset here, so from a fresh tiny model: "
                      f"pass --model.name_or_path={config.sft.checkpoint} to train that policy", file=sys.stderr)
            stages.run_train(config, progress, resume=args.resume, force=args.force, run_dir_mode=mode)
        else:
            stages.run_sft(config, progress, mode)
        finished = True
    except BaseException as err:
        if distributed.is_initialized() and not isinstance(err, (ConfigError, KeyboardInterrupt)):
            reason = (str(err).strip().splitlines() or [""])[0][:300]
            print(f"grpokit: process {distributed.rank()} of {distributed.world_size()} stopped: "
                  f"{type(err).__name__}: {reason}\n(if another process died first, its own message says why; "
                  f"the rest stop at their next collective, within distributed.timeout_s="
                  f"{config.distributed.timeout_s:g}s. Checkpoints already written are intact: resume with the "
                  f"same torchrun command and --resume)", file=sys.stderr)
        raise
    finally:
        distributed.shutdown(finished)
    return 0


if __name__ == "__main__":
    distributed.exit_process(main())
