"""Command line: `grpokit demo | sft | train`. Every config key is an override: --key=value."""

from __future__ import annotations

import argparse
import os
import sys

from grpokit.config import Config, ConfigError, describe, load_config

EPILOG = "config keys (YAML or --key=value; a bare leaf name works when unique):\n" + describe(Config)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO (DeepSeekMath) for causal language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="grpokit bench cost | memory: the cost of GRPO vs PPO, measured or analytic")
    demo = sub.add_parser("demo", help="SFT a tiny model, GRPO it, show the before/after table (CPU, minutes)",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("config", nargs="?", help="optional YAML config; defaults are the embedded demo")
    demo.add_argument("--output-dir", help="run directory (default runs/demo)")
    demo.add_argument("--seed", type=int, help="seed (default 0)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--reward", choices=["rule", "model"],
                      help="rule: the verifier (default); model: a reward model trained on pi_SFT's graded samples")
    demo.add_argument("--supervision", choices=["outcome", "process"],
                      help="outcome (default), or process: a process reward model scores each step (eq. 6)")
    demo.add_argument("--iterative", type=int, metavar="K",
                      help="iterative GRPO with K iterations, refreshing the reward model (implies --reward model)")
    for name, text in (("train", "GRPO from model.name_or_path on data.sources (default: the built-in task)"),
                       ("sft", "SFT model.name_or_path on data.sft_sources (default: the built-in task's demos)")):
        p = sub.add_parser(name, help=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("config", nargs="?", help="YAML config")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
        if name == "train":
            p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                           help="continue exactly from the latest intact checkpoint of output_dir, or from PATH")
            p.add_argument("--force", action="store_true", help="resume even if the config changed")
    rm = sub.add_parser("train-rm", help="train an outcome (Bradley-Terry) or, with --process, a process reward model",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rm.add_argument("config", nargs="?", help="YAML config (model.name_or_path initialises the reward model)")
    rm.add_argument("--process", action="store_true", help="a process reward model: one score per step")
    rm.add_argument("--data", default="", metavar="FILE",
                    help="JSONL/JSON/Parquet of (prompt, chosen, rejected) pairs, or (prompt, completion, correct) "
                         "graded samples; with --process, (prompt, completion|steps, labels). Default: the "
                         "policy's own samples on the built-in task, graded by rule")
    rm.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


OWN_OPTIONS = {"--output-dir", "--seed", "--quiet", "--help", "-h", "--resume", "--force", "--reward",
               "--supervision", "--iterative", "--process", "--data", "--init"}


def join_override_values(argv: list[str]) -> list[str]:
    """`--key value` -> `--key=value` for config keys, so a value is never taken for the CONFIG path."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        is_key = item.startswith("--") and "=" not in item and item not in OWN_OPTIONS
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


def _user_set(key: str, config_path: str | None, overrides: list[str]) -> bool:
    """Whether the YAML file or an override sets dotted `key` (so a default must not replace it)."""
    from grpokit.config import resolve_key

    for item in overrides:
        if resolve_key(item.removeprefix("--").split("=", 1)[0]) == key:
            return True
    if config_path:
        import yaml

        node = yaml.safe_load(open(config_path)) or {}
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True
    return False


def bench(argv: list[str]) -> int:
    """`grpokit bench cost ...` (measured) or `grpokit bench memory ...` (analytic)."""
    if argv[:1] == ["cost"]:
        from grpokit.bench.cost import main as cost_main

        return cost_main(argv[1:])
    if argv[:1] == ["memory"]:
        from grpokit.bench.memory import main as memory_main

        return memory_main(argv[1:])
    print("usage: grpokit bench cost [--json PATH] [options]   GRPO vs PPO measured on one model\n"
          "       grpokit bench memory [--params 7e9 ...]      model-state memory of GRPO vs PPO, analytic",
          file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if argv_list[:1] == ["bench"]:
        return bench(argv_list[1:])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars show training; not per-shard file I/O
    argv = join_override_values(argv_list)
    # Config overrides bypass argparse, which would take a value with spaces for the CONFIG path.
    overrides = [a for a in argv if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in OWN_OPTIONS]
    args, unknown = _parser().parse_known_args([a for a in argv if a not in overrides])
    overrides += unknown
    if getattr(args, "output_dir", None):
        overrides.append(f"--output_dir={args.output_dir}")
    if getattr(args, "seed", None) is not None:
        overrides.append(f"--seed={args.seed}")
    overrides += demo_variant_overrides(args)
    try:
        config = load_config(args.config, overrides)  # fails here, before any model loads
    except ConfigError as err:
        print(f"grpokit: config error: {err}", file=sys.stderr)
        return 2
    if args.command == "demo" and config.reward_model.kind != "none" and not _user_set("grpo.beta", args.config,
                                                                                         overrides):
        from grpokit.demo import REWARD_MODEL_BETA

        config.grpo.beta = REWARD_MODEL_BETA
    try:
        return _run(args, config)
    except ConfigError as err:
        print(f"grpokit: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpokit: interrupted; checkpoints already written are intact", file=sys.stderr)
        return 130
    except _expected_errors() as err:
        print(f"grpokit: error: {err}", file=sys.stderr)
        return 1


def _expected_errors() -> tuple[type[Exception], ...]:
    """Failures with a message that already says what to do: no traceback needed."""
    from grpokit.checkpoint import CheckpointError
    from grpokit.data.files import DatasetError
    from grpokit.runlock import RunDirectoryLocked
    from grpokit.train.grpo import NonFiniteTraining, RewardFailure
    from grpokit.train.reward_model import RewardModelDataError

    return (CheckpointError, DatasetError, RunDirectoryLocked, NonFiniteTraining, RewardFailure,
            RewardModelDataError)


def _run(args, config) -> int:
    if args.command == "demo":
        from grpokit.demo import run_demo

        run_demo(config, progress=not args.quiet)
    elif args.command == "train-rm":
        from grpokit.pipeline import run_train_rm

        run_train_rm(config, progress=not args.quiet, data=args.data)
    elif args.command == "train":
        from grpokit.pipeline import run_train

        run_train(config, progress=not args.quiet, resume=args.resume, force=args.force)
    else:
        from grpokit.pipeline import run_sft

        run_sft(config, progress=not args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
