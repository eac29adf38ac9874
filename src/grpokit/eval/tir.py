"""Chain-of-thought and tool-integrated reasoning (TIR) prompts, as DeepSeekMath evaluates them
(paper, Table 5), and a model-free driver for TIR rollouts.

In TIR the model interleaves reasoning with ```python blocks. Generation stops at the
string "```output"; the program runs in the sandbox, its output is appended, and the model
continues from there:

    We need 2 to the 10th power.
    ```python
    print(2**10)
    ```
    ```output
    1024
    ```
    So the answer is $\\boxed{1024}$.

Following DeepSeekMath's evaluation code, a program is the latest block together with the
earlier blocks of the same completion minus their top-level print lines (variables carry
over, old prints stay quiet); an output longer than 100 characters shows its first and last
50; a failed program shows the last line of its traceback; a program past its deadline
shows "Timeout Error".
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grpokit.data.answers import final_answer
from grpokit.data.templates import COT_INSTRUCTION, TIR_INSTRUCTION, instruction_text, plain_text
from grpokit.sandbox import SandboxResult, run_many

INSTRUCTIONS = {"cot": COT_INSTRUCTION, "tir": TIR_INSTRUCTION}
OUTPUT_STOP = "```output"
# DeepSeekMath shows at most 100 characters of a program's output: the first and last 50.
MAX_OUTPUT_CHARS = 100
TIMEOUT_OUTPUT = "Timeout Error"

_PYTHON_BLOCK = re.compile(r"```python(.*?)```", re.DOTALL)


def build_prompt(question: str, mode: str) -> str:
    """The user turn: the question, a newline, and the instruction of `mode` ("cot" or "tir")."""
    if mode not in INSTRUCTIONS:
        raise ValueError(f"prompt mode must be one of {sorted(INSTRUCTIONS)}, got {mode!r}")
    return instruction_text(question, mode)


def plain_chat(prompt: str) -> str:
    """DeepSeekMath's chat layout for models without a chat template (the prompt stripped)."""
    return plain_text(prompt, "user-assistant")


def _before_stop(text: str) -> str:
    """`text` without a trailing "```output" (and whitespace after it)."""
    stripped = text.rstrip()
    return stripped[: -len(OUTPUT_STOP)] if stripped.endswith(OUTPUT_STOP) else text


def python_blocks(text: str) -> list[str]:
    """The closed ```python blocks of `text`, stripped, empty ones left out, in order."""
    return [b for b in (m.group(1).strip() for m in _PYTHON_BLOCK.finditer(text)) if b]


def last_python_block(text: str) -> str | None:
    """The last closed ```python block before a trailing "```output"; None when there is none.
    As a rollout's `program_fn`, each block runs on its own (ToRA's choice)."""
    blocks = python_blocks(_before_stop(text))
    return blocks[-1] if blocks else None


def cumulative_program(text: str) -> str | None:
    """The program DeepSeekMath's evaluation runs for a completion that stopped at "```output".

    The completion must end with a closing fence right before "```output". The program is
    every earlier block's lines except top-level lines containing "print(" (lines that are
    indented or start with "import" or "def " always stay), then the last block whole.
    None when there is nothing to run.
    """
    text = _before_stop(text)
    if not text.rstrip().endswith("```"):
        return None
    blocks = python_blocks(text)
    if not blocks:
        return None
    kept = [
        line
        for block in blocks[:-1]
        for line in block.split("\n")
        if line.startswith(("    ", "import", "def ")) or "print(" not in line
    ]
    return "\n".join([*kept, blocks[-1]]).strip()


def shorten(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """`text` when at most `limit` characters, else its first and last limit/2 around "..."."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + "..." + text[-half:]


def format_tool_output(result: SandboxResult) -> str:
    """The output block the model sees: "```output\\n{shown}\\n```\\n".

    shown is "Timeout Error" for a timeout, the last traceback line for a failure (what the
    program printed before failing is dropped), else stdout; stripped and cut to 100 characters.
    """
    if result.timed_out:
        shown = TIMEOUT_OUTPUT
    elif result.error is not None:
        shown = result.error
    else:
        shown = result.stdout
    return f"{OUTPUT_STOP}\n{shorten(shown.strip()).strip()}\n```\n"


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


def _stopped_at_output(continuation: str) -> str | None:
    """What follows the trailing "```output" when generation stopped there (a tokenizer's last
    token may overhang it by whitespace), else None."""
    at = continuation.rfind(OUTPUT_STOP)
    if at < 0:
        return None
    overhang = continuation[at + len(OUTPUT_STOP) :]
    return overhang if not overhang.strip() else None


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
            overhang = _stopped_at_output(continuation)
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
            injected = format_tool_output(result)[len(OUTPUT_STOP) :]
            if "\n" in overhang:  # the model already wrote the newline after "```output"
                injected = injected[1:]
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
