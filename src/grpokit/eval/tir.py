"""Chain-of-thought and tool-integrated reasoning (TIR) prompts, as DeepSeekMath evaluates them
(paper, Table 5), and a model-free driver for TIR rollouts.

In TIR the model interleaves reasoning with ```python blocks; generation stops at "```output",
the program runs in the sandbox and its output block is appended (the Python tool,
grpokit/tools/python.py, which assembles programs and formats their output as DeepSeekMath's
evaluation does). Training runs the same tool on token ids (rollout/multi_turn.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grpokit.data.answers import final_answer
from grpokit.data.templates import COT_INSTRUCTION, TIR_INSTRUCTION, instruction_text, plain_text
from grpokit.sandbox import SandboxResult, run_many
from grpokit.tools import appended_text, stopped_at
# program assembly and output blocks are the Python tool's; eval and its tests read them from here too
from grpokit.tools.python import (OUTPUT_STOP, cumulative_program, format_tool_output,  # noqa: F401
                                  last_python_block, python_blocks, shorten, tool_output)

INSTRUCTIONS = {"cot": COT_INSTRUCTION, "tir": TIR_INSTRUCTION}


def build_prompt(question: str, mode: str) -> str:
    """The user turn: the question, a newline, and the instruction of `mode` ("cot" or "tir")."""
    if mode not in INSTRUCTIONS:
        raise ValueError(f"prompt mode must be one of {sorted(INSTRUCTIONS)}, got {mode!r}")
    return instruction_text(question, mode)


def plain_chat(prompt: str) -> str:
    """DeepSeekMath's chat layout for models without a chat template (the prompt stripped)."""
    return plain_text(prompt, "user-assistant")


@dataclass
class TIRTrace:
    """One prompt's rollout.

    completion: everything after the prompt: the model's text, verbatim, with tool output inserted.
    tool_spans: [start, end) character ranges of `completion` written by the tool, not the
        model (the text after each "```output" up to and including the closing fence and
        newline), so a loss can mask them.
    stop_reason: "answer" (the model ended without calling a tool), "tool_limit" (it called
        one in the last allowed round; that output is the completion's end), or "no_program"
        (it wrote "```output" with no program to run).
    """

    prompt: str
    completion: str = ""
    tool_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: int = 0
    stop_reason: str = ""
    tool_results: list[SandboxResult] = field(default_factory=list, repr=False)

    @property
    def answer(self) -> str | None:
        return final_answer(self.completion)


def tir_rollout(
    generate_fn: Callable[[list[str]], Sequence[str]],
    prompts: Sequence[str],
    max_tool_calls: int = 4,
    run_fn: Callable[[list[str]], Sequence[SandboxResult]] = run_many,
    program_fn: Callable[[str], str | None] = cumulative_program,
) -> list[TIRTrace]:
    """Multi-turn TIR rollouts for `prompts`, in at most `max_tool_calls` rounds.

    generate_fn(contexts) -> continuations, one per context (prompt + completion so far). It
    must stop at "```output" and keep that string at the end of the continuation (vLLM:
    include_stop_str_in_output=True; transformers' stop_strings keeps it); a continuation
    without it has finished. Each round, the programs of all contexts that stopped there go
    to run_fn in one batch and their output is appended. As in ToRA and DeepSeekMath's
    evaluation, the output of the last round's programs ends the completion: the model is
    not called again, and `final_answer` falls back to that output.
    """
    if max_tool_calls < 1:
        raise ValueError(f"max_tool_calls must be at least 1 (one round of generation), got {max_tool_calls}")
    traces = [TIRTrace(prompt=p) for p in prompts]
    active = list(range(len(traces)))
    for _ in range(max_tool_calls):
        if not active:
            break
        continuations = list(generate_fn([traces[i].prompt + traces[i].completion for i in active]))
        if len(continuations) != len(active):
            raise ValueError(f"generate_fn returned {len(continuations)} continuations for {len(active)} contexts")
        calls: list[tuple[int, str, str]] = []  # (trace index, program, overhang after "```output")
        for i, continuation in zip(active, continuations):
            trace = traces[i]
            trace.completion += continuation
            overhang = stopped_at(continuation, OUTPUT_STOP)
            if overhang is None:
                trace.stop_reason = "answer"
                continue
            program = program_fn(trace.completion)
            if program is None:
                trace.stop_reason = "no_program"
                continue
            calls.append((i, program, overhang))
        results = list(run_fn([program for _, program, _ in calls])) if calls else []
        for (i, _, overhang), result in zip(calls, results, strict=True):
            trace = traces[i]
            injected = appended_text(tool_output(result).text, overhang)
            start = len(trace.completion)
            trace.completion += injected
            trace.tool_spans.append((start, len(trace.completion)))
            trace.tool_calls += 1
            trace.tool_results.append(result)
        active = [i for i, _, _ in calls]
    for i in active:
        traces[i].stop_reason = "tool_limit"
    return traces


@dataclass
class Timings:
    generate: float = 0.0
    tools: float = 0.0
    score: float = 0.0
    generate_calls: int = 0
    programs: int = 0


class EngineGenerate:
    """A tir_rollout generate_fn on a RolloutEngine: one continuation per context.

    A context too long for max_new_tokens more tokens within max_model_len gets no
    continuation (its rollout ends there). With temperature > 0 each request gets a seed from
    (seed, context, how many identical contexts came before it in the call): a completion does
    not depend on its batch (engines with per-request seeds, vLLM; `hf` draws from torch's RNG).
    `ends` maps a context + continuation to "length" (cut at max_new_tokens) or
    "context_limit", so a finished rollout's reason can be looked up by its text.
    """

    def __init__(self, engine, tokenizer, params, max_model_len: int, seed: int, timings: Timings):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_model_len, self.seed, self.timings = max_model_len, seed, timings
        self.ends: dict[str, str] = {}

    def _seeds(self, contexts: list[str]) -> list[int]:
        seen: Counter = Counter()
        seeds = []
        for context in contexts:
            digest = hashlib.blake2b(f"{self.seed}/{seen[context]}/{context}".encode(), digest_size=4).digest()
            seeds.append(int.from_bytes(digest, "little"))
            seen[context] += 1
        return seeds

    def __call__(self, contexts: Sequence[str]) -> list[str]:
        start = time.perf_counter()
        contexts = list(contexts)
        lengths = [len(ids) for ids in self.tokenizer(contexts, add_special_tokens=False)["input_ids"]]
        fits = [i for i, n in enumerate(lengths) if n + self.params.max_new_tokens <= self.max_model_len]
        out = [""] * len(contexts)
        for i in set(range(len(contexts))) - set(fits):
            self.ends[contexts[i]] = "context_limit"
        if fits:
            batch = [contexts[i] for i in fits]
            seeds = self._seeds(batch) if self.params.temperature > 0 else None
            rollout = self.engine.generate(batch, 1, self.params, seeds=seeds)
            for i, text, truncated in zip(fits, rollout.completions, rollout.truncated.tolist(), strict=True):
                out[i] = text
                if truncated:
                    self.ends[contexts[i] + text] = "length"
            self.timings.generate_calls += 1
        self.timings.generate += time.perf_counter() - start
        return out


def timed_sandbox(timings: Timings, timeout_s: float) -> Callable[[list[str]], list]:
    """run_many with `timeout_s` per program, its wall time and program count added to `timings`."""
    def run(codes: list[str]):
        start = time.perf_counter()
        try:
            return run_many(codes, timeout_s=timeout_s)
        finally:
            timings.tools += time.perf_counter() - start
            timings.programs += len(codes)

    return run


def rollouts(generate: EngineGenerate, prompts: list[str], mode: str, max_tool_calls: int,
             run_fn: Callable[[list[str]], list]) -> list[tuple[TIRTrace, str]]:
    """(trace, stop reason) per prompt. CoT: one generation. TIR: tir_rollout, stopping at
    "```output" to run the program. Reasons: answer, length, context_limit; TIR also
    tool_limit and no_program."""
    if mode == "tir":
        traces = tir_rollout(generate, prompts, max_tool_calls, run_fn=run_fn)
    else:
        traces = [TIRTrace(prompt=p, completion=c, stop_reason="answer") for p, c in zip(prompts, generate(prompts))]
    return [(t, generate.ends.get(t.prompt + t.completion, "answer") if t.stop_reason == "answer" else t.stop_reason)
            for t in traces]
