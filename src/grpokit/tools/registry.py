"""Tools a policy may call mid-completion, registered by name, and the harness that runs them.

A tool is what multi-turn rollouts (rollout/multi_turn.py) stop for: generation stops once
the policy writes the tool's `stop` string; `parse` reads the call from the completion so
far; `run` answers a batch of calls at once, one ToolOutput each, whose text is appended
after the stop string as context the policy reads but never samples (and so is never
trained on). Adding a tool is one module in grpokit.tools (every module of the package is
imported with it):

    @register_tool("my_tool")
    class MyTool:
        name = "my_tool"
        stop = "<result>"
        instruction = "Call my_tool by writing ... <result>"
        def parse(self, completion: str) -> str | None: ...
        def run(self, calls: list[str]) -> list[ToolOutput]: ...
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from grpokit.errors import ConfigError


@dataclass(frozen=True)
class ToolOutput:
    """What a tool answered to one call.

    text: what is appended after the stop string, verbatim (tokenised once, as its own segment).
    failed: the call did not succeed (a program that raised, a malformed expression).
    timed_out: the call was stopped at its deadline.
    seconds: how long the call took.
    error: set when the tool itself raised in the harness (not the call's own failure): no text
        is appended, and the rollout of that sample ends there.
    """

    text: str
    failed: bool = False
    timed_out: bool = False
    seconds: float = 0.0
    error: str | None = None


class Tool(Protocol):
    name: str
    stop: str  # generation stops right after the policy writes this string
    instruction: str  # what the prompt tells the policy about the tool
    # Optional: `texts`, the strings besides `stop` the policy must be able to write for a call
    # (fences, ...); check_tokenizer refuses a tokenizer that cannot.

    def parse(self, completion: str) -> str | None:
        """The call in `completion` (the policy's text so far, ending with `stop`), or None when
        it holds nothing to run."""

    def run(self, calls: Sequence[str]) -> list[ToolOutput]:
        """One output per call, in order; the calls may run in parallel."""


TOOLS: dict[str, Callable[..., Tool]] = {}


def register_tool(name: str):
    """Register a tool class (or any factory of keyword options returning a Tool) as `name`."""
    def decorate(factory):
        if name in TOOLS and TOOLS[name] is not factory:
            raise ValueError(f"tool {name!r} is registered twice ({TOOLS[name].__module__} and {factory.__module__})")
        TOOLS[name] = factory
        return factory
    return decorate


def make_tool(name: str, **options) -> Tool:
    """The tool registered as `name`, built with `options`."""
    if name not in TOOLS:
        close = difflib.get_close_matches(name, TOOLS, n=1)
        raise ValueError(f"unknown tool {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                         f"registered: {', '.join(sorted(TOOLS))}")
    return TOOLS[name](**options)


def check_tokenizer(tool: Tool, tokenizer) -> None:
    """Refuse, before any rollout, a tokenizer that cannot write the tool's stop string or its
    other texts: tokenised and decoded, each must come back as it was (no unknown token, nothing
    lost), or the policy could never call the tool."""
    unk = getattr(tokenizer, "unk_token_id", None)
    for text in (tool.stop, *getattr(tool, "texts", ())):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=True)
        if back != text or (unk is not None and unk in ids):
            raise ConfigError(f"the tokenizer cannot write {text!r}, which the {tool.name} tool needs (it comes back "
                              f"as {back!r}); use a tokenizer whose vocabulary covers it (the tiny model: "
                              "model.tiny.alphabet=arithmetic-tir), or another rollout.tool")


def stopped_at(text: str, stop: str) -> str | None:
    """What follows the trailing `stop` when `text` ends with it, up to whitespace (a tokenizer's
    last token may overhang the stop string by a newline), else None."""
    at = text.rfind(stop)
    if at < 0:
        return None
    overhang = text[at + len(stop) :]
    return overhang if not overhang.strip() else None


def run_calls(tool: Tool, calls: Sequence[str]) -> list[ToolOutput]:
    """tool.run(calls), made safe for a batch: when the tool raises, each call is run on its own,
    and a call on which it raises again gets an output with `error` set instead of taking the
    batch down. A tool returning the wrong number of outputs is a bug in the tool: it raises."""
    calls = list(calls)
    if not calls:
        return []
    try:
        outputs = list(tool.run(calls))
    except Exception:  # one bad call must not fail the others: find it
        return [_run_alone(tool, call) for call in calls]
    if len(outputs) != len(calls):
        raise ValueError(f"tool {tool.name!r} returned {len(outputs)} outputs for {len(calls)} calls")
    return outputs


def _run_alone(tool: Tool, call: str) -> ToolOutput:
    start = time.perf_counter()
    try:
        (output,) = tool.run([call])
        return output
    except Exception as err:
        return ToolOutput("", failed=True, seconds=time.perf_counter() - start,
                          error=f"{type(err).__name__}: {err}")


def appended_text(output_text: str, overhang: str) -> str:
    """The text appended after a stop string whose last token overhung it by `overhang`
    (whitespace): a newline the policy already wrote is not written twice."""
    return output_text[1:] if "\n" in overhang and output_text.startswith("\n") else output_text
