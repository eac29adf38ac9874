"""Reinforcement learning with tools: multi-turn rollouts token in / token out
(rollout/multi_turn.py), tool output masked out of every loss term and count (Rollout.policy_mask),
worked by hand; and a second tool, an exact calculator defined here, through the same rollout."""

import ast
import copy
import dataclasses
import math
import operator
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from grpokit import distributed
from grpokit.config import GRPOConfig
from grpokit.data import arithmetic
from grpokit.math import grpo_loss, loss_denominator
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.rewards import RewardResult, WeightedReward
from grpokit.rollout import Continuation, HFEngine, SamplingParams, ToolEngine, multi_turn_rollout
from grpokit.rollout.multi_turn import round_seeds
from grpokit.rollout.hf_static import StaticCacheDecoder, StaticCacheEngine
from grpokit.tools import ToolOutput, make_tool, register_tool
from run_helpers import spawn_ranks
from grpokit.tools.python import PythonTool
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.ppo import shaped_token_rewards

CHARS = arithmetic.TIR_ALPHABET + "<>*/"  # the TIR fences and print(), a-f for stop strings, the calculator's <<>>


# --- a second tool: an exact calculator with its own fence ----------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _exact(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_exact(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_exact(node.left), _exact(node.right))
    raise ValueError("not arithmetic")


@register_tool("calculator")
class Calculator:
    """<<expression>> is answered with "=value", in exact fractions: <<1/3*6>>=2."""

    name = "calculator"
    stop = ">>"
    instruction = "Compute with <<expression>>; its exact value follows."

    def parse(self, completion):
        at = completion.rfind("<<")
        return completion.rstrip()[at + 2 : -len(self.stop)] if at >= 0 else None

    def run(self, calls):
        return [self._one(call) for call in calls]

    def _one(self, expression):
        try:
            value = _exact(ast.parse(expression, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError):
            return ToolOutput("=error", failed=True)
        return ToolOutput("=" + str(value))


def test_the_calculator_is_a_tool_by_name():
    calc = make_tool("calculator")
    assert calc.parse("so <<6*7>>") == "6*7"
    assert [o.text for o in calc.run(["6*7", "1/3*6", "2/4", "1/0", "x"])] == ["=42", "=2", "=1/2", "=error", "=error"]


# --- engines and tokenizers for the golden tests --------------------------------------------


class IdScript:
    """An engine whose continue_ids gives each context the next scripted id list of the prompt its
    context starts with (cut to the budget), and records the contexts and budgets it was given."""

    copies_weights = False  # it samples from no model: a training step re-points it (sync_weights)

    def __init__(self, tokenizer, script: dict[str, list[list[int]]]):
        self.eos = tokenizer.eos_token_id
        self.script = [(tokenizer(p, add_special_tokens=False)["input_ids"], list(s)) for p, s in script.items()]
        self.contexts, self.budgets = [], []

    def continue_ids(self, contexts, budgets, params, seeds=None):
        self.contexts.append([list(c) for c in contexts])
        self.budgets.append(list(budgets))
        out = []
        for context, budget in zip(contexts, budgets):
            replies = next(s for prompt, s in self.script if context[: len(prompt)] == prompt)
            ids = replies.pop(0)
            finish = "length" if len(ids) > budget else ("eos" if ids[-1] == self.eos else "stop")
            out.append(Continuation(ids[:budget], finish))
        return out

    def sync_weights(self, model, state_dict=None):
        pass

    def release_memory(self, weights_pushed_next):
        pass


def char_ids(tokenizer, text: str) -> list[int]:
    """One id per character, whatever merges the tokenizer knows: how a policy may sample it."""
    return tokenizer.convert_tokens_to_ids(list(text))


def make_trainer(model, tokenizer, tmp_path, **config):
    config = {"num_generations": 2, "prompts_per_step": 1, "max_completion_length": 120, "max_steps": 1,
              "micro_batch_size": 64, "temperature": 1.0, **config}
    reward = WeightedReward("length", lambda prompts, completions, **_: [len(c) / 10 for c in completions])
    return GRPOTrainer(model, tokenizer, [reward], [{"prompt": "Q: 2+2\n"}], GRPOConfig(**config), tmp_path,
                       progress=False)


@pytest.fixture(scope="module")
def tir_tokenizer():
    return build_char_tokenizer(CHARS)


# --- (a) a two-round TIR rollout, its masks and its loss by hand -----------------------------

S1 = "```python\nprint(2+2)\n```\n```output"  # 34 characters, one token each
S2 = "```python\nprint(4+4)\n```\n```output"  # 34
T1, T2 = "\n4\n```\n", "\n8\n```\n"  # the tool's output blocks: 7 tokens each
S3 = "A: 8"  # then EOS: 5 tokens
POLICY, TOOL, OTHER = 34 + 34 + 5, 7 + 7, 5  # row 0's sampled and tool tokens; row 1: "A: 5" + EOS


@pytest.fixture(scope="module")
def two_rounds(tir_tokenizer):
    tok, eos = tir_tokenizer, tir_tokenizer.eos_token_id
    engine = IdScript(tok, {"Q: 2+2\n": [char_ids(tok, S1), char_ids(tok, S2), char_ids(tok, S3) + [eos]],
                            "Q: 1+4\n": [char_ids(tok, "A: 5") + [eos]]})
    result = multi_turn_rollout(engine, tok, ["Q: 2+2\n", "Q: 1+4\n"], 1, SamplingParams(120, temperature=0),
                                PythonTool(timeout_s=10.0), max_tool_calls=3)
    return engine, result


def test_two_round_rollout_golden(two_rounds, tir_tokenizer):
    engine, result = two_rounds
    tok, eos = tir_tokenizer, tir_tokenizer.eos_token_id
    rollout = result.rollout
    assert len(S1) == len(S2) == 34 and len(T1) == len(T2) == 7
    expected = char_ids(tok, S1 + T1 + S2 + T2 + S3) + [eos]
    assert rollout.completion_ids[0].tolist() == expected
    assert rollout.completion_ids[1].tolist() == char_ids(tok, "A: 5") + [eos] + [tok.pad_token_id] * 82
    assert rollout.completions == [S1 + T1 + S2 + T2 + S3, "A: 5"]
    assert rollout.sampled_mask[0].tolist() == [1] * 34 + [0] * 7 + [1] * 34 + [0] * 7 + [1] * 5
    assert rollout.sampled_mask[1].tolist() == [1] * 5 + [0] * 82
    assert rollout.completion_mask[0].tolist() == [1] * 87 and rollout.completion_mask[1].sum() == 5
    assert rollout.policy_mask.sum(dim=1).tolist() == [POLICY, OTHER]
    assert rollout.attention_mask[0, rollout.prompt_length :].sum() == 87  # tool output is context
    assert result.stop_reasons == ["answer", "answer"] and result.tool_calls == [2, 0]
    assert not rollout.truncated.any()
    # the second program carries nothing printed by the first (DeepSeekMath's cumulative rule)
    assert [o.text for o in result.tool_outputs[0]] == [T1, T2]
    # token in: round 2 continued from the prompt's ids, the sampled ids and the tool's ids as they were
    prompt = tok("Q: 2+2\n", add_special_tokens=False)["input_ids"]
    assert engine.contexts[1] == [prompt + char_ids(tok, S1 + T1)]
    assert engine.contexts[2] == [prompt + char_ids(tok, S1 + T1 + S2 + T2)]
    assert engine.budgets == [[120, 120], [120 - 41], [120 - 82]]  # tool output counts against the limit
    metrics = result.metrics()
    assert metrics["tool/calls_mean"] == 1.0 and metrics["tool/failed_frac"] == 0.0
    assert metrics["tool/output_token_frac"] == pytest.approx(TOOL / (87 + 5))
    assert metrics["tool/stop_answer_frac"] == 1.0


def hand_tensors(rollout, tool_value: float):
    """logp 0 on the policy's tokens and `tool_value` on the tool's; pi_ref 0.5 above on the policy's
    tokens and -30 on the tool's (a huge KL there, if it were counted)."""
    tool = (rollout.completion_mask - rollout.policy_mask).bool()
    logp = either(tool, tool_value, 0.0).requires_grad_(True)
    return logp, either(tool, -30.0, 0.5), tool


def either(mask: torch.Tensor, where_set: float, elsewhere: float) -> torch.Tensor:
    """A float64 [N, T] of `where_set` where mask is true, else `elsewhere`."""
    return torch.where(mask, torch.tensor(where_set, dtype=torch.float64), torch.tensor(elsewhere, dtype=torch.float64))


K3 = math.exp(0.5) - 0.5 - 1  # k3 of d = ref - logp = 0.5, eq. 4


@pytest.mark.parametrize("aggregation, expected", [
    # token: -(sum_policy A - beta k3 * tokens) / tokens, A = +1 (row 0), -1 (row 1), over 73 + 5 tokens
    ("token", -((POLICY - OTHER) - 0.04 * K3 * (POLICY + OTHER)) / (POLICY + OTHER)),
    # constant (Dr. GRPO): the same sum over N * L_max = 2 * 120
    ("constant", -((POLICY - OTHER) - 0.04 * K3 * (POLICY + OTHER)) / (2 * 120)),
    # sequence: each row's mean over its own policy tokens, then the mean over rows
    ("sequence", -((1 - 0.04 * K3) + (-1 - 0.04 * K3)) / 2),
])
def test_the_trainers_loss_counts_policy_tokens_only(two_rounds, tir_tokenizer, tmp_path, aggregation, expected):
    _, result = two_rounds
    model = build_tiny_model(tir_tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    trainer = make_trainer(model, tir_tokenizer, tmp_path, loss_aggregation=aggregation, beta=0.04)
    n = result.rollout.num_samples
    scores = RewardResult(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}, {})
    rollout, loss_mask = trainer.on_policy_device(result.rollout, scores)
    assert torch.equal(loss_mask, rollout.policy_mask)  # the trainer's one mask leaves tool output out
    total = loss_denominator(loss_mask, aggregation)
    assert total == {"token": POLICY + OTHER, "constant": 2, "sequence": 2}[aggregation]
    for tool_value in (0.0, 7.0):  # whatever the log-probs of tool output, the loss does not move
        logp, ref, tool = hand_tensors(rollout, tool_value)
        advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
        loss, stats = trainer.algorithm.loss(logp, logp.detach(), ref, advantages, loss_mask, total, None)
        assert loss.item() == pytest.approx(expected, rel=1e-12)
        assert float(stats["tokens"]) == POLICY + OTHER and float(stats["kl"]) == pytest.approx(K3)
        # (b) the gradient is exactly zero on every tool-output position, and not on the policy's
        loss.backward()
        assert (logp.grad[tool] == 0).all() and (logp.grad[rollout.policy_mask.bool()] != 0).all()


def test_importance_weights_and_the_sequence_ratio_ignore_tool_output(two_rounds):
    rollout = two_rounds[1].rollout
    mask = rollout.policy_mask
    logp, _, tool = hand_tensors(rollout, 0.0)
    old = either(tool, -40.0, -0.1)  # a ratio of e^40 on tool output, were it read
    sampling = either(tool, 40.0, -0.2)
    loss, stats = grpo_loss(logp, old, None, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, beta=0.0,
                            aggregation="token", importance_level="sequence", sampling_logp=sampling,
                            is_correction="tis")
    ratio, weight = math.exp(0.1), math.exp(0.1)  # s_i = exp(mean over policy tokens of 0 - (-0.1)); TIS below its cap
    assert loss.item() == pytest.approx(-(POLICY - OTHER) * weight * ratio / (POLICY + OTHER), rel=1e-12)
    assert float(stats["logp_mismatch"]) == pytest.approx(0.1)
    loss.backward()
    assert (logp.grad[tool] == 0).all()


def test_the_trainer_scores_the_rollouts_tokens_with_tool_output_as_context(two_rounds, tir_tokenizer, tmp_path):
    """policy_micro_loss on a real model: the token count and entropy run over policy tokens."""
    _, result = two_rounds
    model = build_tiny_model(tir_tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    trainer = make_trainer(model, tir_tokenizer, tmp_path, loss_aggregation="token", beta=0.0)
    n = result.rollout.num_samples
    scores = RewardResult(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}, {})
    rollout, loss_mask = trainer.on_policy_device(result.rollout, scores)
    batch = Batch(rollout, scores, loss_mask, None, None, tir_tokenizer, True, layout=trainer.layout)
    micro_loss = trainer.policy_micro_loss(batch, torch.tensor([1.0, -1.0]))
    loss, sums = micro_loss(torch.arange(n), 0, float(POLICY + OTHER))
    assert float(sums["tokens"]) == POLICY + OTHER and float(sums["entropy_tokens"]) == POLICY + OTHER
    assert torch.isfinite(loss)


def test_ppo_puts_the_outcome_reward_on_the_last_policy_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])  # a tool segment between policy tokens, then padding
    rewards = shaped_token_rewards(torch.tensor([3.0]), torch.zeros(1, 6), None, mask, beta=0.0)
    assert rewards.tolist() == [[0, 0, 0, 0, 3.0, 0]]


# --- (d) token in, token out: ids that re-tokenising would change ----------------------------


@pytest.fixture(scope="module")
def merging_tokenizer():
    """Characters plus two merges, "a`" and "t\\n": "a```output" + "\\n4..." re-tokenised merges
    differently from what was sampled, and across the boundary between the policy's text and the tool's."""
    chars = sorted(set(CHARS))
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars, "a`", "t\n"])}
    backend = Tokenizer(models.BPE(vocab, [("a", "`"), ("t", "\n")], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_token_in_token_out(merging_tokenizer, tmp_path):
    tok, eos = merging_tokenizer, merging_tokenizer.eos_token_id
    first = "a```python\nprint(2+2)\n```\n```output"
    sampled = [char_ids(tok, first), char_ids(tok, "A: 4") + [eos]]  # as a policy may sample it: no merges
    engine = IdScript(tok, {"Q: 2+2\n": [list(s) for s in sampled]})
    result = multi_turn_rollout(engine, tok, ["Q: 2+2\n"], 1, SamplingParams(64, temperature=0), PythonTool(),
                                max_tool_calls=2)
    rollout = result.rollout
    segment = tok(T1, add_special_tokens=False)["input_ids"]  # the tool's text, tokenised once, on its own
    ids = sampled[0] + segment + sampled[1]
    assert rollout.completion_ids[0].tolist() == ids
    assert rollout.sampled_mask[0].tolist() == [1] * len(sampled[0]) + [0] * len(segment) + [1] * 5
    # re-tokenising the decoded text merges "a`" and, across the tool boundary, "t\n": other ids
    text = rollout.completions[0]
    assert text == first + T1 + "A: 4"
    retokenised = tok(text, add_special_tokens=False)["input_ids"]
    assert retokenised != ids[:-1] and len(retokenised) == len(ids) - 1 - 2
    assert tok.convert_tokens_to_ids("t\n") in retokenised and tok.convert_tokens_to_ids("t\n") not in ids
    # the trainer's log-probs are those of the sampled ids, with the tool's as context
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    trainer = make_trainer(model, tok, tmp_path, max_completion_length=64)
    logp = trainer.logprobs(model, rollout)
    prompt = tok("Q: 2+2\n", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    direct = logits.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logp[0].double(), direct, rtol=1e-4, atol=1e-4)


# --- the rollout's edges: length limit, no program, a crashing tool, seeds ---------------------


class Exploding(Calculator):
    def run(self, calls):
        if any("0" in c for c in calls):
            raise RuntimeError("calculator crashed")
        return super().run(calls)


def test_a_crashing_tool_ends_only_its_sample_and_the_limit_counts_tool_output(tir_tokenizer):
    tok, eos = tir_tokenizer, tir_tokenizer.eos_token_id
    script = {"Q: 1\n": [char_ids(tok, "<<10>>")],  # the tool raises on it: tool_error, nothing appended
              "Q: 2\n": [char_ids(tok, "<<2*3>>"), char_ids(tok, "A6") + [eos]],  # 7 + 2 + 3 = 12 tokens
              "Q: 3\n": [char_ids(tok, "no cue>>")],  # the stop string without "<<": no_program
              "Q: 4\n": [char_ids(tok, "<<1/3*5>>")]}  # 9 tokens: of "=5/3" only 3 fit in the limit of 12
    engine = IdScript(tok, script)
    result = multi_turn_rollout(engine, tok, list(script), 1, SamplingParams(12, temperature=0), Exploding(),
                                max_tool_calls=3)
    assert result.stop_reasons == ["tool_error", "answer", "no_program", "length"]
    assert result.rollout.completions == ["<<10>>", "<<2*3>>=6A6", "no cue>>", "<<1/3*5>>=5/"]
    assert result.rollout.truncated.tolist() == [False, False, False, True]
    assert result.tool_outputs[0][0].error == "RuntimeError: calculator crashed" and result.tool_calls == [1, 1, 0, 1]
    assert result.rollout.sampled_mask[3].tolist() == [1] * 9 + [0] * 3
    assert result.rollout.completion_mask.sum(dim=1).tolist() == [6, 12, 8, 12]
    assert result.metrics()["tool/error_frac"] == pytest.approx(1 / 3)


def test_a_failed_sample_gets_no_reward_and_no_loss_and_the_run_goes_on(tool_model, tir_tokenizer, tmp_path):
    tok = tir_tokenizer
    script = {"Q: 1\n": [char_ids(tok, "<<10>>")] * 2, "Q: 2\n": [char_ids(tok, "<<2*3>>"), char_ids(tok, "A6")] * 2}
    engine = ToolEngine(IdScript(tok, script), tok, Exploding(), max_tool_calls=2)
    trainer = make_trainer(copy.deepcopy(tool_model), tok, tmp_path, prompts_per_step=2)
    trainer.engine = engine
    rollout = engine.generate(["Q: 1\n", "Q: 2\n"], 2, trainer.sampling)
    assert rollout.failed.tolist() == [True, True, False, False]
    result = trainer._score(rollout)
    assert result.valid.tolist() == [False, False, True, True] and result.total[:2].isnan().all()
    _, loss_mask = trainer.on_policy_device(rollout, result)
    assert loss_mask[:2].sum() == 0 and (loss_mask[2:].sum(dim=1) > 0).all()


def test_steps_of_nothing_but_failed_samples_stop_the_run_naming_the_tool(tool_model, tir_tokenizer, tmp_path):
    from grpokit.train.failures import RewardFailure

    tok = tir_tokenizer
    engine = ToolEngine(IdScript(tok, {"Q: 1\n": [char_ids(tok, "<<10>>")] * 4}), tok, Exploding(), max_tool_calls=2)
    trainer = make_trainer(copy.deepcopy(tool_model), tok, tmp_path, max_failed_steps=2)
    trainer.engine, trainer.dataset = engine, [{"prompt": "Q: 1\n"}]
    first = trainer.step()  # every sample failed once: counted, nothing learnt, the run goes on
    assert first["rewards/failed"] == 2 and first["tool/error_frac"] == 1.0 and first["grad_norm"] == 0
    with pytest.raises(RewardFailure, match=r"every rollout failed for 2 consecutive steps: the tool 'calculator' "
                                            r"raised on every call \(last error: RuntimeError: calculator crashed\)"):
        trainer.step()


def test_a_chain_of_thought_prompt_in_the_batch_is_never_answered_by_the_tool(tir_tokenizer):
    """task.prompt_modes: rows of mode "cot" sample as a single-turn rollout would: their stop
    string is text, and sampling goes on with nothing appended; "tir" rows get the tool."""
    tok, eos = tir_tokenizer, tir_tokenizer.eos_token_id
    script = {"Q: 5\n": [char_ids(tok, "<<2*3>>"), char_ids(tok, " A6") + [eos]],
              "Q: 6\n": [char_ids(tok, "<<2*3>>"), char_ids(tok, "A6") + [eos]]}
    engine = ToolEngine(IdScript(tok, script), tok, Calculator(), max_tool_calls=3)
    rollout = engine.generate(list(script), 1, SamplingParams(40, temperature=0), rows=[{"mode": "cot"}, {"mode": "tir"}])
    assert rollout.completions == ["<<2*3>> A6", "<<2*3>>=6A6"]
    assert engine.last.stop_reasons == ["answer", "answer"] and engine.last.tool_calls == [0, 1]
    assert rollout.sampled_mask[0, :10].tolist() == [1] * 10  # every token of the cot completion is the policy's
    assert rollout.sampled_mask[1, :12].tolist() == [1] * 7 + [0] * 2 + [1] * 3
    # max_tool_calls counts calls, not rounds: a cot row's pause never ends it, even with one call allowed
    script = {"Q: 5\n": [char_ids(tok, "<<2*3>>"), char_ids(tok, " A6") + [eos]]}
    engine = ToolEngine(IdScript(tok, script), tok, Calculator(), max_tool_calls=1)
    rollout = engine.generate(list(script), 1, SamplingParams(40, temperature=0), rows=[{"mode": "cot"}])
    assert rollout.completions == ["<<2*3>> A6"] and engine.last.stop_reasons == ["answer"]


def test_round_seeds():
    assert round_seeds([5, 6], 0) == [5, 6] and round_seeds(None, 3) is None
    later = round_seeds([5, 6], 1)
    assert len(set(later)) == 2 and later != [5, 6] and later != round_seeds([5, 6], 2)


def test_an_engine_without_token_continuation_is_refused(tir_tokenizer):
    with pytest.raises(ValueError, match="cannot continue from token ids"):
        multi_turn_rollout(SimpleNamespace(), tir_tokenizer, ["Q"], 1, SamplingParams(8), Calculator())
    with pytest.raises(ValueError, match="max_tool_calls"):
        ToolEngine(IdScript(tir_tokenizer, {}), tir_tokenizer, Calculator(), max_tool_calls=0)


# --- (e), (f): transformers' generate on a tiny model, the sandbox, the calculator ---------------

PROGRAM = ("Q: 2+2\n", "```python\nprint(2+2)\n```\n```output\n4\n```\nA: 4")
CALCULATION = ("Q: 6*7\n", "<<6*7>>=42\nA: 42")


@pytest.fixture(scope="module")
def tool_model(tir_tokenizer):
    """A tiny Llama taught to write a program after "Q: 2+2" and a calculation after "Q: 6*7", each
    followed by the tool's output and an answer: greedy decoding writes them back."""
    tok = tir_tokenizer
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    rows = [tok(p + c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p, c in (PROGRAM, CALCULATION)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : len(PROGRAM[0])] = -100  # both prompts are 7 characters; only the completions are learnt
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    model.train()
    for _ in range(300):  # until every completion token wins by a logit margin of 2 (about 60 steps)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        logits, targets = out.logits[:, :-1].detach(), labels[:, 1:]
        right = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        rival = logits.scatter(-1, targets.clamp(min=0).unsqueeze(-1), -torch.inf).amax(-1)
        # Checked before the step, on the weights returned: a step at this learning rate can undo
        # the margin it was taken on (seen: +3.1 before the last step, -1.1 after).
        if (right - rival)[targets != -100].min() > 2:
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the tool model did not learn its two completions in 300 steps")
    model.eval()
    return model


# Engines that sample from the policy itself: hf, and hf_static with its static-cache code forced on
# this CPU (rollout/hf_static.py; on CPU it would otherwise sample as hf does).
LOCAL_ENGINES = {"hf": HFEngine,
                 "hf_static": lambda model, tok: StaticCacheEngine(model, tok, StaticCacheDecoder(static=True,
                                                                                                  compile=False))}


@pytest.mark.parametrize("engine", LOCAL_ENGINES)
def test_hf_multi_turn_rollout_runs_the_program_and_masks_its_output(tool_model, tir_tokenizer, engine):
    tok = tir_tokenizer
    result = multi_turn_rollout(LOCAL_ENGINES[engine](tool_model, tok), tok, [PROGRAM[0]], 2,
                                SamplingParams(80, temperature=0), PythonTool(timeout_s=10.0), max_tool_calls=2)
    rollout, before = result.rollout, len("```python\nprint(2+2)\n```\n```output")
    assert rollout.completions == [PROGRAM[1]] * 2
    assert result.stop_reasons == ["answer"] * 2 and result.tool_calls == [1, 1]
    assert result.tool_outputs[0][0].text == "\n4\n```\n" and result.tool_outputs[0][0].seconds > 0
    n = len(PROGRAM[1]) + 1  # one token per character, then EOS
    assert rollout.sampled_mask[0].tolist() == [1] * before + [0] * 7 + [1] * (n - before - 7)
    assert rollout.completion_mask[0].sum() == n and rollout.completion_ids[0, n - 1] == tok.eos_token_id
    if engine == "hf_static":  # the sampler's log-probs on the sampled tokens, 0 on the tool's output
        logp = rollout.sampling_logp[0, :n]
        assert (logp[rollout.sampled_mask[0, :n].bool()] < 0).all() and (logp[before : before + 7] == 0).all()


@pytest.mark.parametrize("engine", LOCAL_ENGINES)
def test_hf_multi_turn_rollout_with_the_calculator_and_a_training_step(tool_model, tir_tokenizer, tmp_path, engine):
    tok = tir_tokenizer
    result = multi_turn_rollout(LOCAL_ENGINES[engine](tool_model, tok), tok, [CALCULATION[0]], 1,
                                SamplingParams(40, temperature=0), make_tool("calculator"), max_tool_calls=2)
    assert result.rollout.completions == [CALCULATION[1]]
    assert result.rollout.sampled_mask[0].tolist()[:10] == [1] * 7 + [0] * 3  # "<<6*7>>" then "=42" from the tool
    # the training loop runs on the same rollouts unchanged: ToolEngine is its engine
    model = copy.deepcopy(tool_model)
    engine = ToolEngine(LOCAL_ENGINES[engine](model, tok), tok, Calculator(), max_tool_calls=2)
    trainer = make_trainer(model, tok, tmp_path, max_completion_length=40, loss_aggregation="token")
    trainer.engine, trainer.dataset = engine, [{"prompt": CALCULATION[0]}]
    record = trainer.step()
    assert engine.last.rollout.sampled_mask is not None and math.isfinite(record["loss"])
    assert record["tool/calls_mean"] == engine.last.metrics()["tool/calls_mean"]
    assert record["tool/stop_answer_frac"] + record["tool/stop_length_frac"] + record["tool/stop_tool_limit_frac"] \
        + record["tool/stop_no_program_frac"] + record["tool/stop_tool_error_frac"] == pytest.approx(1.0)


def test_grpokit_train_samples_tool_integrated_prompts_through_the_tool(tmp_path):
    """`grpokit train` with rollout.tool and tir in task.prompt_modes: the tir share of questions
    gets the task's tool-integrated prompts, rollouts go through the tool, and every step logs the
    tool's numbers; the run writes all its files."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", f"--output_dir={run}", "--grpo.max_steps=2",
                           "--prompts_per_step=4", "--num_generations=2", "--max_completion_length=24", "--eval.k=1",
                           "--task.num_eval_questions=8", "--model.tiny.alphabet=arithmetic-tir",
                           "--rollout.tool=python", "--task.prompt_modes={cot: 0.5, tir: 0.5}", "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        stops = sum(row[f"tool/stop_{reason}_frac"] for reason in
                    ("answer", "length", "tool_limit", "no_program", "tool_error"))
        assert abs(stops - 1.0) < 1e-9 and {"tool/calls_mean", "tool/seconds", "tool/output_token_frac"} <= set(row)
    for name in ("summary.json", "results.md", "heldout.jsonl", "heldout-after.jsonl", "config.yaml"):
        assert (run / name).is_file(), name


def test_tir_prompt_modes_follow_a_fixed_hash_of_the_question():
    from grpokit.config import Config, ConfigError
    from grpokit.data import arithmetic
    from grpokit.models import build_char_tokenizer
    from grpokit.tasks.base import with_prompt_modes
    from grpokit.tasks.chain import ChainTask

    config = Config()
    config.task.num_rl_questions = 400
    task, tokenizer = ChainTask(config), build_char_tokenizer(arithmetic.TIR_ALPHABET)
    rows = task.data(tokenizer, sft=False).train
    assert with_prompt_modes(task, rows, {"cot": 1.0}, tokenizer) is rows  # all-CoT: the rows as they are
    mixed = with_prompt_modes(task, rows, {"cot": 0.5, "tir": 0.5}, tokenizer)
    tir = [r for r in mixed if r["mode"] == "tir"]
    assert 150 < len(tir) < 250  # about half
    assert all(r["prompt"] == arithmetic.format_tir_prompt(r["question"]) for r in tir)
    assert all(r["prompt"] == arithmetic.format_prompt(r["question"]) for r in mixed if r["mode"] == "cot")
    again = with_prompt_modes(task, list(reversed(rows)), {"cot": 1.0, "tir": 1.0}, tokenizer)
    assert {r["question"] for r in again if r["mode"] == "tir"} == {r["question"] for r in tir}  # not the order
    no_programs = build_char_tokenizer(arithmetic.ALPHABET)
    with pytest.raises(ConfigError, match=r"task.prompt_modes gives tir a share, but task 'chain' has no"):
        with_prompt_modes(task, rows, {"tir": 1.0}, no_programs)


@pytest.mark.parametrize("overrides, message", [
    (["--rollout.tool=pyth"], "rollout.tool='pyth' is not a registered tool; registered: .*python"),
    (["--rollout.tool=python", "--rollout.tool_args={bogus: 1}"], "do not suit the python tool"),
    (["--rollout.tool_args={timeout_s: 5}"], "but no rollout.tool: name the tool they are for"),
    (["--task.prompt_modes={cot: 0.5, tir: 0.5}"], "asks for tool-integrated prompts, whose completions call a tool"),
    (["--rollout.tool=python", "--rollout.max_tool_calls=0"], "rollout.max_tool_calls must be >= 1, got 0"),
    (["--task.prompt_modes={xot: 1}"], r"task.prompt_modes takes the modes cot and tir, got \['xot'\]"),
    (["--task.prompt_modes={cot: 0}"], "task.prompt_modes' shares must be >= 0 and not all 0"),
])
def test_tool_keys_that_cannot_work_are_config_errors(overrides, message):
    from grpokit.config import ConfigError
    from grpokit.checks import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_tool_rollouts_under_torchrun_pass_the_world_size_check():
    from grpokit.config import check_world_size
    from grpokit.checks import load_config

    check_world_size(load_config(None, ["--rollout.tool=python", "--grpo.prompts_per_step=4"]), 2)


def _lockstep_worker(rank: int, world: int, port: int, state: dict, out_dir: str) -> None:
    """A multi-turn rollout on an FSDP2-sharded copy of tool_model, each process with its own
    prompts: process 0's program needs a second round, process 1's calculation ends in the first."""
    import os

    from grpokit.models.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    assert distributed.init(timeout_s=120)
    try:
        tok = build_char_tokenizer(CHARS)
        model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        model.load_state_dict(state)
        model = shard_model(model)
        prompt = (PROGRAM, CALCULATION)[rank][0]
        result = multi_turn_rollout(HFEngine(model, tok), tok, [prompt], 1, SamplingParams(80, temperature=0),
                                    PythonTool(timeout_s=10.0), max_tool_calls=2)
        torch.save({"completions": result.rollout.completions, "tool_calls": result.tool_calls},
                   os.path.join(out_dir, f"rollout{rank}.pt"))
        distributed.barrier()
    finally:
        distributed.shutdown()


def test_tool_rollouts_on_two_sharded_processes_step_together_and_match_one_process(tool_model, tmp_path):
    """Under torchrun a sharded policy's generation is a collective: a process whose completions
    have all ended keeps joining the others' rounds (with no contexts) until theirs end too, and
    each process's completions are the ones it samples alone."""
    spawn_ranks(_lockstep_worker, 2, tool_model.state_dict(), str(tmp_path))
    first, second = (torch.load(tmp_path / f"rollout{rank}.pt") for rank in (0, 1))
    assert first == {"completions": [PROGRAM[1]], "tool_calls": [1]}  # round 2 writes the answer
    assert second["tool_calls"] == [0] and second["completions"] == [CALCULATION[1]]  # done in round 1


# --- metrics by prompt mode ---------------------------------------------------------------------


def test_mode_metrics_golden():
    """Two cot and two tir samples, worked by hand: a tir sample with two tool segments and one with
    none; the failed (invalid) sample counts in samples, length and calls but not in the reward."""
    from grpokit.train.mode_metrics import mode_metrics, tool_calls_per_sample
    from grpokit.types import Rollout

    completion_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    sampled_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]])
    rollout = Rollout(prompts=["a"] * 4, completions=[""] * 4, input_ids=torch.zeros(4, 7, dtype=torch.long),
                      attention_mask=torch.ones(4, 7, dtype=torch.long), completion_mask=completion_mask,
                      truncated=torch.zeros(4, dtype=torch.bool), prompt_length=1, group_size=2,
                      rows=[{"mode": "cot"}] * 2 + [{"mode": "tir"}] * 2, sampled_mask=sampled_mask)
    assert tool_calls_per_sample(rollout).tolist() == [0, 0, 2, 0]  # segments at 1 and at 3-4
    result = RewardResult(total=torch.tensor([1.0, 0.0, 1.0, float("nan")], dtype=torch.float64),
                          valid=torch.tensor([True, True, True, False]),
                          per_function={"accuracy": torch.tensor([1.0, 0.0, 1.0, float("nan")])}, errors={})
    out = mode_metrics(rollout, result)
    assert out == {"mode/cot/samples": 2, "mode/cot/reward_mean": 0.5, "mode/cot/accuracy": 0.5,
                   "mode/cot/length_mean": 3.0, "mode/cot/tool_calls_mean": 0.0,
                   "mode/tir/samples": 2, "mode/tir/reward_mean": 1.0, "mode/tir/accuracy": 1.0,
                   "mode/tir/length_mean": 4.5, "mode/tir/tool_calls_mean": 1.0}
    # a batch (or a process's share of one) with one mode still logs both: every process the same keys
    one_mode = mode_metrics(dataclasses.replace(rollout, rows=[{"mode": "cot"}] * 4), result)
    assert one_mode["mode/cot/samples"] == 4 and one_mode["mode/cot/reward_mean"] == pytest.approx(2 / 3)
    assert one_mode["mode/tir/samples"] == 0 and math.isnan(one_mode["mode/tir/reward_mean"])
    assert mode_metrics(dataclasses.replace(rollout, rows=[{}] * 4), result) == {}  # not a mixed run


def test_a_tokenizer_that_cannot_write_the_tools_texts_is_refused_at_start():
    from grpokit.config import ConfigError

    without_fences = build_char_tokenizer(arithmetic.ALPHABET)  # the chain task's characters: no "`"
    with pytest.raises(ConfigError, match=r"cannot write '```output', which the python tool needs .*"
                                          r"model.tiny.alphabet=arithmetic-tir"):
        ToolEngine(IdScript(without_fences, {}), without_fences, PythonTool())
    ToolEngine(IdScript(build_char_tokenizer(CHARS), {}), build_char_tokenizer(CHARS), PythonTool())  # has them


# --- real data: examples/gsm8k_math_tir_grpo.yaml on GSM8K rows ---------------------------------

TIR_REPLY = "```python\nprint(6*7)\n```\n```output\n42\n```\nSo the answer is \\boxed{42}."
GSM8K_ROWS = [{"question": f"A shop sells {i} boxes of {j} pens. How many pens?", "answer": f"{i}*{j}\n#### {i * j}"}
              for i, j in [(2, 3), (4, 5), (6, 7), (8, 9), (3, 3), (5, 5), (7, 7), (9, 9)]]


@pytest.fixture(scope="module")
def program_writer(tmp_path_factory):
    """A tiny Llama with a printable-ASCII tokenizer taught to answer each GSM8K_ROWS question, in
    either prompt (DeepSeekMath's, in the bare layout training renders), with TIR_REPLY: a program,
    its output block and a boxed answer. Saved in hub format."""
    from grpokit.pipeline.build import ASCII_ALPHABET
    from grpokit.run.checkpoint import save_checkpoint
    from grpokit.data.templates import instruction_text, plain_text

    tok = build_char_tokenizer(ASCII_ALPHABET)
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    prompts = [plain_text(instruction_text(r["question"], mode), "bare")
               for r in GSM8K_ROWS for mode in ("cot", "tir")]
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    reply = tok(TIR_REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    width = max(map(len, rows)) + len(reply)
    ids = torch.tensor([r + reply + [tok.pad_token_id] * (width - len(r) - len(reply)) for r in rows])
    mask = torch.tensor([[1] * (len(r) + len(reply)) + [0] * (width - len(r) - len(reply)) for r in rows])
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        labels[i, len(r) : len(r) + len(reply)] = torch.tensor(reply)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(400):  # about 200 steps
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        if out.loss.item() < 0.005:  # before the step, so the weights kept are the ones measured
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert out.loss.item() < 0.005
    model.eval()
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("model") / "program-writer")


def test_the_tir_example_trains_on_gsm8k_rows_through_the_tool(tmp_path, program_writer):
    """examples/gsm8k_math_tir_grpo.yaml on GSM8K-format rows with a tiny model, only the budget made
    tiny: half the questions get the TIR prompt, their rollouts run programs in the sandbox, every
    step logs the tool's numbers and each mode's, and the run writes all its files."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    example = Path(__file__).resolve().parent.parent / "examples" / "gsm8k_math_tir_grpo.yaml"
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(example),
                           f"--model.name_or_path={program_writer}", "--model.dtype=fp32", "--model.device=cpu",
                           "--model.attn_implementation=eager", f"--output_dir={run}",
                           f"--data.sources=[{{path: '{data}', format: gsm8k}}]",
                           f"--data.eval_sources=[{{path: '{data}', format: gsm8k, max_rows: 4}}]",
                           "--grpo.max_steps=2", "--grpo.num_generations=2", "--grpo.prompts_per_step=4",
                           "--grpo.max_completion_length=96", "--grpo.generation_batch_size=8",
                           "--grpo.micro_batch_size=8", "--grpo.save_steps=1", "--grpo.temperature=0.3", "--eval.k=1",
                           "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert any(m.get("mode/tir/samples", 0) > 0 for m in metrics)
    tir_calls = [m["mode/tir/tool_calls_mean"] for m in metrics if m.get("mode/tir/samples")]
    assert tir_calls and min(tir_calls) >= 1.0  # every TIR sample ran its program
    assert all(m["tool/failed_frac"] == 0 and m["tool/wall_s"] > 0 and m["tool/rounds"] >= 2 for m in metrics)
    # 6*7 = 42 is right for one question only: the reward sees the program's outcome
    assert all({"mode/tir/math_accuracy", "mode/cot/math_accuracy"} <= set(m) for m in metrics)
    for name in ("config.yaml", "summary.json", "results.md", "heldout-after.jsonl", "checkpoints/step-2"):
        assert (run / name).exists(), name
