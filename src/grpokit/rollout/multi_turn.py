"""Multi-turn rollouts with a tool (grpokit.tools), token in / token out.

Each round, every active completion is continued from its token ids (the prompt's, then every
token so far) until the tool's stop string, an EOS, or the completion's length limit. The
calls of all completions that stopped at the tool run together (tools.run_calls), and each
output's text is tokenised once, as its own segment, and appended to that completion's ids;
the policy's sampled ids are never decoded and re-tokenised, so the trainer scores exactly
the tokens that were sampled. At most `max_tool_calls` calls per completion: as in
DeepSeekMath's evaluation, the output of the last allowed call ends the completion.

The Rollout's completion ids are the sampled ids and the tool segments in order;
completion_mask covers both (tool output is context the policy reads), sampled_mask is 1 on
sampled tokens only, so the loss never trains the policy to write a tool's output
(docs/algorithm.md, "Tool output in the loss"). params.max_new_tokens bounds the whole
completion, tool output included: a segment that does not fit is cut and the completion
counts as truncated.

Under torchrun every process makes the same engine calls (rounds run while any process has a
completion to continue), since a sharded policy's generation is a collective.

An engine takes part by offering `continue_ids(contexts, budgets, params, seeds)` (HFEngine:
transformers' generate on the ids; VLLMEngine: TokensPrompt, with the sampled tokens' log-probs,
which become the Rollout's sampling_logp, 0 on tool output); each request's seed is the one the engine gets for a
single-turn completion (rollout/engine.py, request_seeds) in the first round, and one derived
from it and the round after that.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from grpokit.seeds import derive_seed
from grpokit import distributed
from grpokit.rollout.sampler import SamplingParams, assemble_rollout, left_padded
from grpokit.tools import Tool, ToolOutput, appended_text, check_tokenizer, run_calls, stopped_at
from grpokit.types import Rollout

# Why a completion ended: "answer" (an EOS, or a stop string other than the tool's), "length"
# (the limit on completion tokens, tool output included), "tool_limit" (the output of a call in
# the last allowed round), "no_program" (the tool found no call before its stop string),
# "tool_error" (the tool itself raised on the call: the sample failed, Rollout.failed, and the loss
# leaves it out).
STOP_REASONS = ("answer", "length", "tool_limit", "no_program", "tool_error")


@dataclass
class _Completion:
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1 per sampled token, 0 per tool-output token
    logp: list[float] | None = field(default_factory=list)  # the engine's, 0 on tool output; None: unreported
    outputs: list[ToolOutput] = field(default_factory=list)
    reason: str = ""

    def extend(self, ids: list[int], sampled: bool, logp: list[float] | None = None) -> None:
        self.ids += ids
        self.sampled += [int(sampled)] * len(ids)
        if self.logp is not None and sampled and logp is None:
            self.logp = None
        elif self.logp is not None:
            self.logp += logp[: len(ids)] if sampled else [0.0] * len(ids)


@dataclass
class ToolRollout:
    """A multi-turn rollout: the Rollout the trainer reads (sampled_mask set), and per completion
    why it ended (STOP_REASONS) and what the tool answered to each of its calls."""

    rollout: Rollout
    stop_reasons: list[str]
    tool_outputs: list[list[ToolOutput]]
    rounds: int = 0  # rounds of generation run
    generate_seconds: float = 0.0  # wall time in the engine
    tool_seconds: float = 0.0  # wall time in the tool (its calls of a round run together)

    @property
    def tool_calls(self) -> list[int]:
        return [len(outputs) for outputs in self.tool_outputs]

    def metrics(self) -> dict[str, float]:
        """tool/* numbers of the batch: calls per completion, shares of calls that failed, timed
        out or crashed the tool, the tool's seconds (summed over calls, and the wall time beside the
        engine's), the rounds, the share of completion tokens it wrote, and the share of completions
        per stop reason."""
        calls = [o for outputs in self.tool_outputs for o in outputs]
        n = max(1, len(calls))
        mask = self.rollout.completion_mask
        sampled = self.rollout.policy_mask
        out = {
            "tool/calls_mean": len(calls) / max(1, len(self.tool_outputs)),
            "tool/failed_frac": sum(o.failed for o in calls) / n,
            "tool/timeout_frac": sum(o.timed_out for o in calls) / n,
            "tool/error_frac": sum(o.error is not None for o in calls) / n,
            "tool/seconds": sum(o.seconds for o in calls),
            "tool/wall_s": self.tool_seconds,
            "tool/generate_wall_s": self.generate_seconds,
            "tool/rounds": self.rounds,
            "tool/output_token_frac": float((mask.sum() - sampled.sum()) / mask.sum().clamp(min=1)),
        }
        out.update({f"tool/stop_{reason}_frac": self.stop_reasons.count(reason) / max(1, len(self.stop_reasons))
                    for reason in STOP_REASONS})
        return out


def round_seeds(seeds: list[int] | None, round_index: int) -> list[int] | None:
    """The requests' seeds in round `round_index`: the single-turn seeds in round 0 (a completion
    that calls no tool is the one `generate` samples), then one per (seed, round)."""
    if seeds is None or round_index == 0:
        return seeds
    return [derive_seed(s, f"round{round_index}") for s in seeds]


def tool_segment(tokenizer, text: str) -> list[int]:
    """The token ids of a tool's appended text, tokenised on its own; special-token text the
    tool printed (an "<eos>") stays text, so it can never end the completion."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def check_engine(engine) -> None:
    """Refuse an engine that cannot continue from token ids, which multi-turn rollouts need."""
    if not hasattr(engine, "continue_ids"):
        raise ValueError(f"the rollout engine {type(engine).__name__} cannot continue from token ids "
                         "(continue_ids); multi-turn tool rollouts need one that can, such as `hf`")


def _check_rounds(max_tool_calls: int) -> None:
    if max_tool_calls < 1:
        raise ValueError(f"max_tool_calls must be at least 1 (one round of generation), got {max_tool_calls}")


def multi_turn_rollout(engine, tokenizer, prompts: list[str], num_generations: int, params: SamplingParams,
                       tool: Tool, max_tool_calls: int = 4, rows: list[dict] | None = None,
                       seeds: list[int] | None = None, with_tool: list[bool] | None = None) -> ToolRollout:
    """`num_generations` multi-turn completions of each prompt (groups contiguous, as
    RolloutEngine.generate), each calling `tool` at most `max_tool_calls` times. `seeds`: one per
    completion (request_seeds), for engines with per-request seeds. The tool's stop string is
    added to params.stop. `with_tool`: per prompt, whether the tool answers it (default: every
    prompt); for one it does not (a chain-of-thought question), the stop string is text and
    sampling goes on in the next round, as if it had not paused, until EOS or the length limit
    (max_tool_calls counts calls, so such pauses never end it)."""
    _check_rounds(max_tool_calls)
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if not prompts:
        raise ValueError("multi_turn_rollout got no prompts")
    check_engine(engine)
    if seeds is not None and len(seeds) != len(prompts) * num_generations:
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts) * num_generations} completions")
    params = dataclasses.replace(params, stop=tuple(dict.fromkeys((*params.stop, tool.stop))))
    limit = params.max_new_tokens
    prompt_ids = [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
                  for _ in range(num_generations)]
    if with_tool is not None and len(with_tool) != len(prompts):
        raise ValueError(f"got {len(with_tool)} with_tool flags for {len(prompts)} prompts")
    answers = [True if with_tool is None else bool(with_tool[i // num_generations]) for i in range(len(prompt_ids))]
    completions = [_Completion() for _ in prompt_ids]
    active = list(range(len(completions)))
    rounds, generate_seconds, tool_seconds = 0, 0.0, 0.0
    for round_index in itertools.count():  # every round adds a token to each completion it continues: it ends
        # Under torchrun each process's engine call may be a collective (a sharded policy is gathered,
        # a tensor-parallel vLLM pools requests): all go on while any has a completion to continue, one
        # with none left calling with no contexts.
        if not (distributed.any_process(bool(active)) if distributed.world_size() > 1 else active):
            break
        start = time.perf_counter()
        continuations = engine.continue_ids(
            [prompt_ids[i] + completions[i].ids for i in active], [limit - len(completions[i].ids) for i in active],
            params, round_seeds(None if seeds is None else [seeds[i] for i in active], round_index))
        generate_seconds += time.perf_counter() - start
        rounds += 1
        calls, goes_on = _tool_calls(active, continuations, completions, tokenizer, tool, limit, answers)
        start = time.perf_counter()
        outputs = run_calls(tool, [call for _, call, _ in calls])
        tool_seconds += time.perf_counter() - start
        active = goes_on
        _add_outputs(calls, outputs, completions, tokenizer, limit, max_tool_calls, active)
    return ToolRollout(_assemble(tokenizer, prompts, num_generations, prompt_ids, completions, rows),
                       [c.reason for c in completions], [c.outputs for c in completions], rounds, generate_seconds,
                       tool_seconds)


def _tool_calls(active: list[int], continuations, completions: list[_Completion], tokenizer, tool: Tool, limit: int,
                answers: list[bool]) -> tuple[list[tuple[int, str, str]], list[int]]:
    """One round's continuations added to their completions: (the tool calls to run, as (completion,
    call, overhang after the stop string), the completions that go on without a call). A completion
    that ends here gets its reason."""
    calls: list[tuple[int, str, str]] = []  # (completion, call, overhang after the stop string)
    goes_on: list[int] = []  # paused at the stop string of a tool that does not answer them
    for i, continuation in zip(active, continuations, strict=True):
        completion = completions[i]
        completion.extend(continuation.ids, sampled=True, logp=continuation.logp)
        if continuation.finish == "length":
            completion.reason = "length"
            continue
        if continuation.finish != "stop":  # EOS: no tool call, nothing to decode
            completion.reason = "answer"
            continue
        text = tokenizer.decode(completion.ids, skip_special_tokens=True)
        overhang = stopped_at(text, tool.stop)
        if overhang is None:
            completion.reason = "answer"
            continue
        if len(completion.ids) >= limit:
            completion.reason = "length"  # no room left for the tool's output
            continue
        if not answers[i]:
            if continuation.ids:  # an engine that wrote nothing new would only stop there again
                goes_on.append(i)
            else:
                completion.reason = "answer"
            continue
        call = tool.parse(text)
        if call is None:
            completion.reason = "no_program"
            continue
        calls.append((i, call, overhang))
    return calls, goes_on


def _add_outputs(calls: list[tuple[int, str, str]], outputs, completions: list[_Completion], tokenizer, limit: int,
                 max_tool_calls: int, active: list[int]) -> None:
    """The tool's outputs appended to their completions (tool tokens, not sampled), within the length
    limit; a completion that goes on joins `active`, one that ends gets its reason."""
    for (i, _, overhang), output in zip(calls, outputs, strict=True):
        completion = completions[i]
        completion.outputs.append(output)
        if output.error is not None:
            completion.reason = "tool_error"
            continue
        segment = tool_segment(tokenizer, appended_text(output.text, overhang))
        room = limit - len(completion.ids)
        completion.extend(segment[:room], sampled=False)
        if len(segment) > room:
            completion.reason = "length"
        elif len(completion.outputs) >= max_tool_calls:  # the output of its last allowed call ends it
            completion.reason = "tool_limit"
        elif len(segment) == room:
            completion.reason = "length"
        else:
            active.append(i)


def _assemble(tokenizer, prompts: list[str], num_generations: int, prompt_ids: list[list[int]],
              completions: list[_Completion], rows: list[dict] | None) -> Rollout:
    """The Rollout of the completions' token ids: completion_mask on every completion token,
    sampled_mask on the sampled ones, sampling_logp where the engine reported every sampled token's."""
    width = max(1, max(len(c.ids) for c in completions))
    completion_ids = torch.full((len(completions), width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    sampled_mask = torch.zeros((len(completions), width), dtype=torch.long)
    with_logp = all(c.logp is not None for c in completions)
    sampling_logp = torch.zeros((len(completions), width), dtype=torch.float32) if with_logp else None
    for row, c in enumerate(completions):
        completion_ids[row, : len(c.ids)] = torch.tensor(c.ids, dtype=torch.long)
        completion_mask[row, : len(c.ids)] = 1
        sampled_mask[row, : len(c.ids)] = torch.tensor(c.sampled, dtype=torch.long)
        if sampling_logp is not None:
            sampling_logp[row, : len(c.ids)] = torch.tensor(c.logp, dtype=torch.float32)
    truncated = torch.tensor([c.reason == "length" for c in completions])
    ids, mask = left_padded(prompt_ids, tokenizer.pad_token_id)
    rollout = assemble_rollout(tokenizer, prompts, num_generations, ids, mask, completion_ids, completion_mask,
                               truncated, rows, sampling_logp, sampled_mask)
    rollout.failed = torch.tensor([c.reason == "tool_error" for c in completions])
    return rollout


class ToolEngine:
    """A RolloutEngine whose `generate` is a multi-turn rollout with `tool` on `engine` (which must
    offer continue_ids): what the training loop calls unchanged, through engine.generate(prompts,
    G, params, rows, seeds). Weight syncs and memory go to the wrapped engine; the last batch's
    ToolRollout (stop reasons, tool outputs, metrics()) stays in `last`, and rollout_metrics() is
    what the loop logs of it."""

    def __init__(self, engine, tokenizer, tool: Tool, max_tool_calls: int = 4):
        check_engine(engine)
        _check_rounds(max_tool_calls)
        check_tokenizer(tool, tokenizer)
        self.engine, self.tokenizer, self.tool, self.max_tool_calls = engine, tokenizer, tool, max_tool_calls
        self.last: ToolRollout | None = None

    @property
    def copies_weights(self) -> bool:
        return self.engine.copies_weights

    def generate(self, prompts, num_generations, params, rows=None, seeds=None) -> Rollout:
        """The multi-turn rollout of `prompts`; the tool answers every prompt but those whose row's
        "mode" is "cot" (task.prompt_modes), which sample as a single-turn rollout would."""
        with_tool = [row.get("mode") != "cot" for row in rows] if rows else None
        self.last = multi_turn_rollout(self.engine, self.tokenizer, prompts, num_generations, params, self.tool,
                                       self.max_tool_calls, rows, seeds, with_tool)
        return self.last.rollout

    def rollout_metrics(self) -> dict[str, float]:
        """The last batch's tool/* numbers (ToolRollout.metrics), which the training loop logs, and
        what the wrapped engine reports of itself (hf_static: its compilations)."""
        inner = getattr(self.engine, "rollout_metrics", None)
        return {**(inner() if inner is not None else {}), **(self.last.metrics() if self.last is not None else {})}

    def failure(self) -> str:
        """What failed the last batch's failed samples, in words, for the message that stops a run."""
        errors = [o.error for outputs in (self.last.tool_outputs if self.last else []) for o in outputs if o.error]
        return f"the tool {self.tool.name!r} raised on every call (last error: {errors[-1] if errors else 'none'})"

    def sync_weights(self, model: torch.nn.Module, state_dict: dict | None = None) -> None:
        self.engine.sync_weights(model, state_dict)

    def release_memory(self, weights_pushed_next: bool) -> None:
        self.engine.release_memory(weights_pushed_next)

    def close(self) -> None:
        self.engine.close()

    def __getattr__(self, name: str):
        """Whatever else the loop asks of an engine (check_synced, max_model_len, ...) is the wrapped engine's."""
        if name == "engine":  # not set yet (unpickling, a half-built wrapper): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)
