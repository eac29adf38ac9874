"""Chain-of-thought and tool-integrated reasoning (TIR) prompts, as DeepSeekMath evaluates them
(paper, Table 5), and the evaluation's rollouts of both.

In TIR the model interleaves reasoning with ```python blocks; generation stops at "```output",
the program runs in the sandbox and its output block is appended (the Python tool,
grpokit/tools/python.py, which assembles programs and formats their output as DeepSeekMath's
evaluation does). Evaluation samples TIR with the rollout training uses
(rollout/multi_turn.py: token ids in and out, max_new_tokens bounding the whole completion,
tool output included), so for the same checkpoint, questions and seeds the trainer's greedy
TIR completions and `grpokit eval`'s are the same tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from grpokit.seeds import derive_seed
from grpokit.data.answers import final_answer
from grpokit.data.templates import COT_INSTRUCTION, TIR_INSTRUCTION, instruction_text, plain_text
from grpokit.rollout.multi_turn import check_engine, multi_turn_rollout
from grpokit.rollout.sampler import SamplingParams
from grpokit.tools import Tool, ToolOutput
from grpokit.tools.python import PythonTool

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
    """One prompt's rollout: `completion` is everything after the prompt, the model's tokens and
    the tool's output blocks in order, decoded; `tool_outputs` what the tool answered to each call."""

    prompt: str
    completion: str = ""
    tool_calls: int = 0
    tool_outputs: list[ToolOutput] = field(default_factory=list, repr=False)

    @property
    def answer(self) -> str | None:
        return final_answer(self.completion)


@dataclass
class Timings:
    generate: float = 0.0
    tools: float = 0.0
    score: float = 0.0
    generate_calls: int = 0
    programs: int = 0


def prompt_seeds(seed: int, prompts: Sequence[str]) -> list[int]:
    """One sampling seed per prompt from (seed, the prompt, how many identical prompts came before
    it): a completion does not depend on its batch (engines with per-request seeds; `hf` draws
    from torch's RNG)."""
    seen: Counter = Counter()
    seeds = []
    for prompt in prompts:
        seeds.append(derive_seed(seed, seen[prompt], prompt))
        seen[prompt] += 1
    return seeds


@dataclass(frozen=True)
class RolloutLimits:
    """What bounds an evaluation's rollouts: the engine's context, the seed its samples are drawn
    from, and in TIR the tool (default: the Python tool) and how many calls of it a completion may make."""
    max_model_len: int
    seed: int = 0
    max_tool_calls: int = 2
    tool: Tool | None = None


def rollouts(engine, tokenizer, prompts: list[str], mode: str, params: SamplingParams, limits: RolloutLimits,
             timings: Timings) -> list[tuple[TIRTrace, str]]:
    """(trace, stop reason) per prompt. CoT: one generation (reasons: answer, length). TIR:
    multi_turn_rollout with limits.tool, the rollout RL trains on (reasons: its STOP_REASONS). A
    prompt with no room for params.max_new_tokens within limits.max_model_len gets no completion
    (reason context_limit): evaluation never cuts a question."""
    if not prompts:
        return []
    max_model_len, seed, max_tool_calls, tool = limits.max_model_len, limits.seed, limits.max_tool_calls, limits.tool
    start, tools_before = time.perf_counter(), timings.tools
    lengths = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    fits = [i for i, n in enumerate(lengths) if n + params.max_new_tokens <= max_model_len]
    out = [(TIRTrace(prompt=p), "context_limit") for p in prompts]
    batch = [prompts[i] for i in fits]
    seeds = prompt_seeds(seed, batch) if params.temperature > 0 and batch else None
    if batch and mode == "tir":
        check_engine(engine)
        result = multi_turn_rollout(engine, tokenizer, batch, 1, params, tool or PythonTool(), max_tool_calls,
                                    seeds=seeds)
        for i, text, reason, outputs in zip(fits, result.rollout.completions, result.stop_reasons,
                                            result.tool_outputs, strict=True):
            out[i] = (TIRTrace(prompts[i], text, len(outputs), outputs), reason)
        timings.programs += sum(result.tool_calls)
        timings.tools += result.tool_seconds
        timings.generate_calls += result.rounds
    elif batch:
        timings.generate_calls += 1
        rollout = engine.generate(batch, 1, params, seeds=seeds)
        for i, text, cut in zip(fits, rollout.completions, rollout.truncated.tolist(), strict=True):
            out[i] = (TIRTrace(prompts[i], text), "length" if cut else "answer")
    timings.generate += time.perf_counter() - start - (timings.tools - tools_before)
    return out
