"""The `grpokit eval` command line: options, their checks, and the three things it does
(generate and grade, --compare, --completions)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers.utils import logging as hf_logging

from grpokit.run.checkpoint import CheckpointError
from grpokit.config import Config
from grpokit.data.files import DatasetError
from grpokit.errors import EvalError
from grpokit.eval.benchmark import EVAL, MODEL, ROLLOUT, EvalSettings, grade_completion_file, run_evaluation
from grpokit.eval.questions import HELDOUT
from grpokit.eval.records import REPORT, RESULTS
from grpokit.eval.report import MODES, compare_runs, report_markdown
from grpokit.models.loading import (
    DeviceUnavailable,
    ModelNotFound,
    resolve_device,
)
from grpokit.rollout import ENGINES, RolloutEngineError


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless it has none worth showing (None, "", False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default in ("", []) or default is argparse.SUPPRESS \
                or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


class Deprecated(argparse.Action):
    """An old spelling of an option, kept for one release: it sets what `new` sets, and says so in one line.
    The config keys' dotted names are what every other command takes (--eval.k, not --k)."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"grpokit: warning: {option_string} is deprecated: use {self.new} (the old flag goes in the next "
              "release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpokit eval", formatter_class=DefaultsHelpFormatter,
        description="Accuracy on math benchmarks with chain-of-thought (cot) and tool-integrated (tir) prompts, "
                    "as in DeepSeekMath's Table 5.",
        epilog="Completions files for scoring: JSONL/JSON/Parquet records with a completion column. Records with a "
               "'question' field (or the column --key names) are matched to the data row with the same question; "
               "otherwise the i-th record belongs to the i-th data row.")
    p.add_argument("model", nargs="?", help="a model directory, a hub id, or a run directory (its newest checkpoint)")
    p.add_argument("--data", nargs="+", action="extend", default=[], metavar="FILE",
                   help="JSONL/JSON/Parquet in GSM8K, MATH or plain (question, answer) form; NAME=FILE names it. "
                        f"Default for a run directory: its held-out questions ({HELDOUT})")
    p.add_argument("--mode", default="cot,tir", help="cot, tir or both (cot,tir)")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", help="where results, report and completions go")
    p.add_argument("--max-rows", type=int, default=0, help="first N questions of each file; 0 = all")
    p.add_argument("--eval.k", dest="k", type=int, default=0, metavar="K",
                   help="also draw K samples per question for maj@K and pass@K")
    p.add_argument("--k", dest="k", type=int, default=0, action=Deprecated, new="--eval.k", help=argparse.SUPPRESS)
    p.add_argument("--temperature", type=float, default=EVAL.temperature,
                   help="sampling temperature of the --eval.k samples (default: %(default)s, as eval.temperature)")
    p.add_argument("--rollout.engine", "--engine", dest="engine", choices=sorted(ENGINES), default=ROLLOUT.engine,
                   help="hf: transformers' generate; vllm: a vLLM engine; or another registered engine")
    p.add_argument("--rollout.kv_cache_gb", "--kv-cache-gb", dest="kv_cache_gb", type=float,
                   default=ROLLOUT.kv_cache_gb, help="vllm: GiB for its KV cache")
    p.add_argument("--grpo.max_completion_length", dest="max_new_tokens", type=int, default=None, metavar="N",
                   help="tokens per completion (TIR: every round and the tool's output blocks together, as "
                        "in RL); for a run's checkpoint, the run's grpo.max_completion_length unless given "
                        "(default: 1024)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=None, action=Deprecated,
                   new="--grpo.max_completion_length", help=argparse.SUPPRESS)
    p.add_argument("--max-tool-calls", type=int, default=EVAL.max_tool_calls,
                   help="TIR: programs a completion may run (default: %(default)s, as "
                        "eval.max_tool_calls)")
    p.add_argument("--tool-timeout", type=float, default=EVAL.tool_timeout_s,
                   help="TIR: seconds a program may run (default: %(default)s, as eval.tool_timeout_s)")
    p.add_argument("--max-model-len", type=int, default=ROLLOUT.max_model_len,
                   help="longest context in tokens; 0 = the model's max_position_embeddings")
    p.add_argument("--batch-size", type=int, default=None,
                   help="questions per batch (and per resumable write); for a run's checkpoint, the run's "
                        f"eval.batch_size (the batches its own evaluation made) unless given (default: {EVAL.batch_size}, "
                        "as eval.batch_size)")
    p.add_argument("--seed", type=int, default=Config.seed, help="seed of the --eval.k samples")
    p.add_argument("--device", default=MODEL.device, help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=MODEL.dtype, help="auto (bf16 on CUDA, else fp32), bf16, fp16 or fp32")
    p.add_argument("--question-column", default="", help="column holding the question (default: recognised)")
    p.add_argument("--answer-column", default="", help="column holding the reference (default: recognised)")
    p.add_argument("--skip-malformed-lines", action="store_true",
                   help="leave out (and count) rows that cannot be read, or whose reference answer cannot, instead "
                        "of stopping; the results cover the rows read")
    p.add_argument("--compare", nargs=2, metavar=("DIR_BEFORE", "DIR_AFTER"),
                   help="print and write (DIR_AFTER/compare.md, or --output-dir) the before/after table")
    p.add_argument("--completions", metavar="FILE", help="score this file's completions against --data instead of "
                                                         "generating")
    p.add_argument("--completion-column", default="completion",
                   help="scoring: the column with the completion; a dotted name reaches into objects")
    p.add_argument("--key", default=None, help="scoring: the record column matched to the data's question")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


# The options whose names are config keys: what a message about their value calls them.
OPTION = {"max_new_tokens": "--grpo.max_completion_length", "k": "--eval.k"}


def _modes(text: str) -> list[str]:
    modes = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise EvalError(f"--mode takes cot, tir or cot,tir; got {text!r}")
    return list(dict.fromkeys(modes))


def _check_numbers(args) -> None:
    for name in ("max_new_tokens", "max_tool_calls", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise EvalError(f"{OPTION.get(name, '--' + name.replace('_', '-'))} must be at least 1, got "
                            f"{getattr(args, name)}")
    for name in ("max_rows", "k", "max_model_len"):
        if getattr(args, name) < 0:
            raise EvalError(f"{OPTION.get(name, '--' + name.replace('_', '-'))} must be 0 or more, got "
                            f"{getattr(args, name)}")
    if args.k and args.temperature <= 0:
        raise EvalError(f"--eval.k samples need --temperature > 0, got {args.temperature}")
    if args.tool_timeout <= 0:
        raise EvalError(f"--tool-timeout must be positive, got {args.tool_timeout}")
    resolve_device(args.device, "--device")  # before the data is read or the model loads


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.compare:
            if args.model or args.data or args.completions:
                raise EvalError("--compare takes two evaluation directories and nothing else (no MODEL, --data)")
            table, path = compare_runs(*args.compare, args.output_dir)
            print(table)
            print(f"wrote {path}")
            return 0
        if args.completions:
            if args.model or len(args.data) != 1:
                raise EvalError("--completions FILE needs exactly one --data FILE (its questions and references) "
                                "and no MODEL")
            modes = _modes(args.mode if args.mode != "cot,tir" else "cot")
            if len(modes) != 1:
                raise EvalError("--completions scores one mode; --mode names it (cot or tir)")
            results = grade_completion_file(args.completions, args.data[0], args.completion_column, args.key,
                                            modes[0], args.max_rows, args.output_dir, args.question_column,
                                            args.answer_column, args.skip_malformed_lines)
            print(report_markdown(results))
            if args.output_dir:
                print(f"wrote {Path(args.output_dir) / RESULTS}")
            return 0
        if args.model and not args.data and (Path(args.model) / HELDOUT).is_file():
            args.data = [str(Path(args.model) / HELDOUT)]  # the run's own held-out questions
            args.question_column, args.answer_column = args.question_column or "question", args.answer_column or "answer"
        if not args.model or not args.data or not args.output_dir:
            raise EvalError("usage: grpokit eval MODEL --data FILE... --output-dir DIR (or --compare / --completions);"
                            " see grpokit eval --help")
        _check_numbers(args)
        settings = EvalSettings(args.max_new_tokens or 0, args.max_tool_calls, args.k, args.temperature if args.k else 0.0,
                                args.seed, args.batch_size or 0, args.tool_timeout, args.max_model_len)
        hf_logging.disable_progress_bar()
        results = run_evaluation(args.model, args.data, args.output_dir, _modes(args.mode), settings, args.engine,
                                 args.max_rows, args.device, args.dtype, args.kv_cache_gb, args.question_column,
                                 args.answer_column, progress=not args.quiet,
                                 skip_malformed=args.skip_malformed_lines)
        print(report_markdown(results))
        print(f"wrote {Path(args.output_dir) / RESULTS}, {REPORT} and the completions files")
        return 0
    except (DatasetError, EvalError, CheckpointError, ModelNotFound, DeviceUnavailable, RolloutEngineError) as err:
        print(f"grpokit: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpokit: interrupted; the completions written so far are kept: rerun to resume", file=sys.stderr)
        return 130
