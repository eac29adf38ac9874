"""The real checkpoint through every path (issue 33, part 2): SmolLM2-135M-Instruct (`make models`)
trained by SFT (full and LoRA), GRPO and PPO (fp32 and bf16), outcome and process reward models
on its backbone, `grpokit eval` with CoT and TIR through its chat template, and a LoRA run killed
with SIGKILL and resumed bit for bit; then tool rollouts token in / token out and chat-template
prompts with the SmolLM2, Qwen3 and DeepSeek V4 tokenizers (the last two with a tiny random model
of their vocabulary size, taught to write a program).

Every run is as small as shows the path works: a few GSM8K-like rows written here, 16-32 new
tokens, 1-3 steps, LoRA r=8. About 10 minutes on 2 CPU cores (`make test-real`)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.run.metrics import read_metrics
from run_helpers import cli, start, wait_for_rows

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "smollm2-135m-instruct"
TOKENIZERS = {"smollm2": MODEL, "qwen3": REPO / "models" / "tokenizers" / "qwen3",
              "deepseek-v4": REPO / "models" / "tokenizers" / "deepseek-v4"}

pytestmark = pytest.mark.real

# GSM8K-format rows (question, worked answer ending in "#### n").
ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
     "answer": "2 boxes hold 2*12=<<2*12=24>>24 pens.\n#### 24"},
    {"question": "Sara had 20 dollars and spent 5. How much is left?",
     "answer": "She has 20-5=<<20-5=15>>15 dollars left.\n#### 15"},
    {"question": "What is half of 18?", "answer": "Half of 18 is 18/2=<<18/2=9>>9.\n#### 9"},
]
MODEL_ARG = f"--model.name_or_path={MODEL}"
REWARDS = "--rewards=[{name: math_accuracy}, {name: 'real_checkpoint_rewards:characters', weight: 0.1}]"
LORA = ["--model.lora.r=8", "--model.lora.alpha=16"]


@pytest.fixture(scope="module", autouse=True)
def real_files():
    """Every test here skips, with this one reason, until `make models` has built the files."""
    if not (MODEL / "model.safetensors").is_file() or not all((p / "tokenizer.json").is_file()
                                                               for p in TOKENIZERS.values()):
        pytest.skip("needs the real checkpoint and tokenizers under models/: run `make models`")


@pytest.fixture(scope="module", autouse=True)
def length_reward(real_files, tmp_path_factory):
    """A reward that differs between samples (the characters written, over 100), importable by the
    runs: beside math_accuracy (0 for nearly every 16-token completion) it gives advantages that
    are not all zero, so an update moves the weights."""
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "real_checkpoint_rewards.py").write_text(
        "def characters(prompts, completions, **_):\n    return [len(c) / 100 for c in completions]\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
        yield


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def rl_args(rows_file: Path, output_dir: Path, dtype: str = "fp32", steps: int = 2) -> list[str]:
    """GRPO/PPO on the rows: 2 prompts x 2 samples of 16 tokens a step, no held-out evaluation."""
    return [MODEL_ARG, f"--output_dir={output_dir}", f"--model.dtype={dtype}", "--model.device=cpu",
            f"--data.sources=[{{path: {rows_file}, format: gsm8k}}]", "--data.heldout_fraction=0",
            f"--grpo.max_steps={steps}", "--grpo.prompts_per_step=2", "--grpo.num_generations=2",
            "--grpo.max_completion_length=16", "--grpo.warmup_steps=0", "--grpo.learning_rate=1e-5",
            "--grpo.temperature=1.0", REWARDS, "--quiet"]


def assert_steps(run: Path, steps: int, *keys: str) -> list[dict]:
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "grad_norm", *keys)), r
    return rows


# --- SFT -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft(rows_file, tmp_path, lora):
    out = tmp_path / "sft"
    proc = cli("sft", MODEL_ARG, f"--output_dir={out}", "--model.dtype=fp32", "--model.device=cpu",
               f"--data.sft_sources=[{{path: {rows_file}, format: gsm8k}}]", "--sft.max_steps=2",
               "--sft.batch_size=4", "--sft.warmup_steps=0", "--sft.learning_rate=1e-5", "--quiet",
               *(LORA if lora else []))
    assert ("0.92M trainable of 135.44M parameters" if lora else "134.52M parameters, all trainable") in proc.stdout
    losses = [r["loss"] for r in read_metrics(out / "sft_metrics.jsonl")]
    # A pretrained instruct model already knows this text: far below a random model's ln(49152) = 10.8.
    assert len(losses) == 2 and all(0 < loss < 4 for loss in losses), losses
    saved = out / "checkpoints" / "sft"
    base = load_file(MODEL / "model.safetensors")
    if lora:
        adapter = load_file(saved / "adapter_model.safetensors")
        b = [v for k, v in adapter.items() if "lora_B" in k]
        assert b and any(v.abs().sum() > 0 for v in b)  # B starts at zero: the adapters learnt
        assert json.loads((saved / "adapter_config.json").read_text())["r"] == 8
        from grpokit.models import load_model_and_tokenizer

        merged, _ = load_model_and_tokenizer(str(saved), dtype="fp32", device="cpu")  # the base, adapter merged in
        q_proj = merged.model.layers[0].self_attn.q_proj.weight
        assert not torch.equal(q_proj, base["model.layers.0.self_attn.q_proj.weight"])
    else:
        weights = load_file(saved / "model.safetensors")
        assert weights.keys() <= base.keys() | {"lm_head.weight"}
        moved = [k for k in weights if k in base and not torch.equal(weights[k].float(), base[k].float())]
        assert moved  # every weight trains in a full fine-tune


# --- GRPO and PPO ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_grpo_run(rows_file, tmp_path_factory) -> Path:
    """GRPO with LoRA r=8 in fp32, 3 steps, a checkpoint every step: the run the resume test
    compares a killed and resumed run against."""
    run = tmp_path_factory.mktemp("grpo-lora") / "run"
    cli("train", *rl_args(rows_file, run, steps=3), *LORA, "--grpo.save_steps=1")
    return run


def test_grpo_lora_fp32(lora_grpo_run):
    rows = assert_steps(lora_grpo_run, 3, "kl")
    assert all(r["completion/mean_length"] > 0 and r["reward/std"] > 0 for r in rows)
    assert rows[-1]["kl"] > 0  # the adapters moved the policy off the reference
    adapter = lora_grpo_run / "checkpoints" / "step-3" / "adapter_model.safetensors"
    assert adapter.is_file() and not (lora_grpo_run / "checkpoints" / "step-3" / "model.safetensors").exists()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_bf16(rows_file, tmp_path, lora):
    """bf16 compute over fp32 master weights (a full run's checkpoint carries them in master/)."""
    run = tmp_path / "run"
    cli("train", *rl_args(rows_file, run, dtype="bf16", steps=1), *(LORA if lora else []))
    assert_steps(run, 1, "kl")
    final = run / "checkpoints" / "step-1"
    if lora:
        assert (final / "adapter_model.safetensors").is_file()
    else:
        assert {t.dtype for t in load_file(final / "model.safetensors").values()} == {torch.bfloat16}
        assert {t.dtype for t in load_file(final / "master" / "model.safetensors").values()} == {torch.float32}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ppo_critic_on_the_real_backbone(rows_file, tmp_path, dtype):
    from transformers import AutoModelForTokenClassification

    run = tmp_path / "run"
    cli("train", "--algo=ppo", *rl_args(rows_file, run, dtype=dtype), *LORA, "--ppo.critic_learning_rate=1e-5")
    assert_steps(run, 2, "value/loss")
    critic = AutoModelForTokenClassification.from_pretrained(run / "checkpoints" / "step-2" / "critic")
    config = critic.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size, config.num_labels) \
        == ("llama", 576, 30, 49152, 1)
    # its backbone is SmolLM2's (two steps at lr 1e-5 move no weight far from it; a bf16 run saves the
    # critic in bf16, within one rounding, 2^-8 relative, of the fp32 weights)
    base = load_file(MODEL / "model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(critic.model.embed_tokens.weight.float(), base.float(), atol=1e-3,
                               rtol=2**-7 if dtype == "bf16" else 0)


# --- reward models on the real backbone ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


RM_ARGS = ["--model.dtype=fp32", "--model.device=cpu", "--reward_model.train.max_steps=2",
           "--reward_model.train.batch_size=4", "--reward_model.train.warmup_steps=0",
           "--reward_model.train.learning_rate=1e-5", "--reward_model.train.heldout_fraction=0.25", "--quiet"]


def backbone_is_smollm2(config) -> None:
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size, config.num_labels) \
        == ("llama", 576, 30, 49152, 1)


def test_outcome_reward_model_on_the_real_backbone(tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForSequenceClassification

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": chat_prompt(smollm2_tokenizer, f"What is {i} + {i + 1}?"),
                                        "chosen": f"{i} + {i + 1} = {2 * i + 1}. The answer is {2 * i + 1}.",
                                        "rejected": f"{i} + {i + 1} = {2 * i + 2}. The answer is {2 * i + 2}."})
                            + "\n" for i in range(8)))
    out = tmp_path / "rm"
    proc = cli("train-rm", "--data", str(data), MODEL_ARG, f"--output_dir={out}", *RM_ARGS)
    assert "pairwise_accuracy" in proc.stdout and "outcome reward model" in proc.stdout
    rm = AutoModelForSequenceClassification.from_pretrained(out / "reward_model")
    backbone_is_smollm2(rm.config)
    base = load_file(MODEL / "model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(rm.model.embed_tokens.weight.float(), base.float(), atol=1e-3, rtol=0)


def test_process_reward_model_on_the_real_backbone(tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForTokenClassification

    data = tmp_path / "steps.jsonl"
    rows = []
    for i in range(8):
        right = [f"{i} + 2 = {i + 2}.\n", f"{i + 2} * 3 = {3 * (i + 2)}.\n", f"The answer is {3 * (i + 2)}."]
        slip = [f"{i} + 2 = {i + 3}.\n", f"{i + 3} * 3 = {3 * (i + 3)}.\n", f"The answer is {3 * (i + 3)}."]
        prompt = chat_prompt(smollm2_tokenizer, f"What is ({i} + 2) * 3?")
        rows += [{"prompt": prompt, "steps": right, "labels": [True, True, True]},
                 {"prompt": prompt, "steps": slip, "labels": [False, False, False]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prm"
    proc = cli("train-rm", "--process", "--data", str(data), MODEL_ARG, f"--output_dir={out}", *RM_ARGS)
    assert "step_accuracy" in proc.stdout and "process reward model" in proc.stdout
    backbone_is_smollm2(AutoModelForTokenClassification.from_pretrained(out / "reward_model").config)


# --- grpokit eval: CoT and TIR through the chat template ---------------------------------------


def test_eval_cot_and_tir_through_the_chat_template(rows_file, tmp_path):
    out = tmp_path / "eval"
    cli("eval", str(MODEL), "--data", str(rows_file), "--mode", "cot,tir", "--max-rows", "2", "--grpo.max_completion_length",
        "32", "--device", "cpu", "--dtype", "fp32", "--output-dir", str(out), "--quiet")
    results = json.loads((out / "results.json").read_text())
    assert results["prompt_format"] == "chat template"
    (dataset,) = results["results"]
    assert set(results["results"][dataset]) == {"cot", "tir"}
    for mode, cell in results["results"][dataset].items():
        assert cell["total"] == 2 and 0 <= cell["correct"] <= 2
        records = [json.loads(line) for line in (out / f"completions-{dataset}-{mode}.jsonl").read_text().splitlines()]
        assert len(records) == 2
        for record in records:
            # SmolLM2's ChatML: its system turn, the user's turn with the mode's instruction, the assistant's cue
            assert record["prompt"].startswith("<|im_start|>system\n")
            assert record["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert ("programs" in record["prompt"]) == (mode == "tir")
            assert record["completion"] and "<|im_end|>" not in record["completion"]


# --- resume after SIGKILL, bit for bit, with LoRA ----------------------------------------------


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without wall-clock timings (perf/*), which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_sigkill_then_resume_with_lora_matches_the_uninterrupted_run_bit_for_bit(rows_file, tmp_path, lora_grpo_run):
    killed = tmp_path / "killed"
    proc = start("train", *rl_args(rows_file, killed, steps=3), *LORA, "--grpo.save_steps=1")
    wait_for_rows(killed / "metrics.jsonl", 2, proc, timeout=1200)  # step 2 done, step-1 (at least) saved
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "step-3").exists()

    resumed = cli("train", str(killed / "config.yaml"), "--resume")
    assert "resumed from" in resumed.stderr
    a = load_file(lora_grpo_run / "checkpoints" / "step-3" / "adapter_model.safetensors")
    b = load_file(killed / "checkpoints" / "step-3" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[name], b[name]) for name in a)  # bit for bit
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3]
    assert comparable(read_metrics(killed / "metrics.jsonl")) == comparable(read_metrics(lora_grpo_run / "metrics.jsonl"))


# --- tool rollouts, token in / token out, with three real tokenizers --------------------------

QUESTION = "What is 2+2?"
PROGRAM = "Let me compute it.\n```python\nprint(2+2)\n```\n```output"  # what the policy writes, up to the stop
OUTPUT = "\n4\n```\n"  # what the python tool appends after "```output"
ANSWER = "The answer is $\\boxed{4}$."


def load_with_tiny_model(name: str, folder: Path, eos_token: str | None = None):
    """The tokenizer of `name` with a tiny random Llama of its vocabulary size, saved to `folder` and
    loaded back through grpokit's loader (which sets EOS from the chat template). `eos_token`:
    what the saved tokenizer names as its EOS (a base model's <|endoftext|>, say)."""
    from transformers import AutoTokenizer

    from grpokit.models import build_tiny_model, load_model_and_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS[name])
    if eos_token:
        tokenizer.eos_token = eos_token
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model_and_tokenizer(str(folder), dtype="fp32", device="cpu")


def teach(model, sequence: list[int], labelled: list[bool]) -> None:
    """Train `model` on one sequence until greedy decoding writes every labelled token back (each
    wins by a logit margin of 2), checked on the weights as they end up, not one step before."""
    ids = torch.tensor([sequence])
    labels = torch.where(torch.tensor([labelled]), ids, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(1000):
        out = model(input_ids=ids, labels=labels)
        logits, targets = out.logits[0, :-1].detach(), labels[0, 1:]
        keep = targets != -100
        right = logits[keep].gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)
        rival = logits[keep].scatter(-1, targets[keep].unsqueeze(-1), -torch.inf).amax(-1)
        margin = (right - rival).min().item()
        if margin > 2:
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    model.eval()
    assert margin > 2, f"the tiny model did not learn the sequence: smallest logit margin {margin:.2f}"


class Recording:
    """An engine that passes continue_ids on to `engine` and keeps every context and continuation."""

    copies_weights = False

    def __init__(self, engine):
        self.engine, self.contexts, self.continuations = engine, [], []

    def continue_ids(self, contexts, budgets, params, seeds=None):
        out = self.engine.continue_ids(contexts, budgets, params, seeds)
        self.contexts.append([list(c) for c in contexts])
        self.continuations.append(out)
        return out


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def taught(request, tmp_path_factory):
    """(name, model, tokenizer, prompt, ids): a tiny model with the tokenizer `name`, taught to answer
    the TIR prompt of QUESTION with PROGRAM, and after the tool's OUTPUT with ANSWER and EOS; ids:
    the prompt's, the program's, the tool segment's and the answer's token ids (with EOS)."""
    from grpokit.data.templates import render_prompt
    from grpokit.rollout.multi_turn import tool_segment

    name = request.param
    torch.manual_seed(0)
    model, tokenizer = load_with_tiny_model(name, tmp_path_factory.mktemp(name))
    prompt = render_prompt(QUESTION, tokenizer, "tir")

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = {"prompt": encode(prompt), "program": encode(PROGRAM), "segment": tool_segment(tokenizer, OUTPUT),
           "answer": encode(ANSWER) + [tokenizer.eos_token_id]}
    labelled = [False] * len(ids["prompt"]) + [True] * len(ids["program"]) + [False] * len(ids["segment"]) \
        + [True] * len(ids["answer"])
    teach(model, ids["prompt"] + ids["program"] + ids["segment"] + ids["answer"], labelled)
    return name, model, tokenizer, prompt, ids


def test_each_tokenizer_writes_the_tools_stop_string_and_fences(taught):
    from grpokit.tools import check_tokenizer
    from grpokit.tools.python import PythonTool

    _, _, tokenizer, _, _ = taught
    tool = PythonTool()
    check_tokenizer(tool, tokenizer)  # raises a ConfigError for a tokenizer that cannot
    for text in (tool.stop, *tool.texts, PROGRAM, OUTPUT):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids


def test_tool_rollout_token_in_token_out(taught, tmp_path):
    """transformers' generate on the ids, the python tool in the sandbox: the tool's output is
    tokenised once, on its own, with no prefix token at either boundary; the next round continues
    from exactly the ids so far; the trainer scores exactly the sampled ids."""
    from grpokit.config import GRPOConfig
    from grpokit.rewards import WeightedReward
    from grpokit.rollout import HFEngine, SamplingParams, multi_turn_rollout
    from grpokit.tools.python import PythonTool
    from grpokit.train.grpo import GRPOTrainer

    name, model, tokenizer, prompt, ids = taught
    engine = Recording(HFEngine(model, tokenizer))
    result = multi_turn_rollout(engine, tokenizer, [prompt], 1, SamplingParams(64, temperature=0),
                                PythonTool(timeout_s=10.0), max_tool_calls=2)
    rollout = result.rollout
    assert result.stop_reasons == ["answer"] and result.tool_calls == [1]
    assert [o.text for o in result.tool_outputs[0]] == [OUTPUT]
    # round 1 sampled the program and stopped at "```output"; round 2 the answer and EOS
    (first,), (second,) = engine.continuations
    assert (first.ids, first.finish) == (ids["program"], "stop")
    assert (second.ids, second.finish) == (ids["answer"], "eos")
    # token in: round 2 continued from the prompt's ids, the sampled ids and the tool's segment as they were
    assert engine.contexts[1] == [ids["prompt"] + ids["program"] + ids["segment"]]
    # the tool's text tokenised once, on its own: no prefix token (a SentencePiece "▁") before its
    # newline, and it decodes to exactly what the tool wrote
    segment = ids["segment"]
    assert segment == tokenizer(OUTPUT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(segment[:1]) == "\n" and tokenizer.decode(segment) == OUTPUT
    # token out: the completion is the sampled ids and the segment in order, masked as such
    n = len(ids["program"]) + len(segment) + len(ids["answer"])
    assert rollout.completion_ids[0, :n].tolist() == ids["program"] + segment + ids["answer"]
    assert rollout.completion_mask[0].sum() == n
    assert rollout.sampled_mask[0, :n].tolist() == [1] * len(ids["program"]) + [0] * len(segment) \
        + [1] * len(ids["answer"])
    assert rollout.completions == [PROGRAM + OUTPUT + ANSWER]  # nothing added at a boundary
    # the trainer's log-probs are those of these ids after this prompt
    reward = WeightedReward("zero", lambda prompts, completions, **_: [0.0] * len(completions))
    config = GRPOConfig(num_generations=2, prompts_per_step=1, max_completion_length=64, max_steps=1,
                        temperature=1.0, micro_batch_size=8)
    trainer = GRPOTrainer(model, tokenizer, [reward], [{"prompt": prompt}], config, tmp_path, progress=False)
    logp = trainer.logprobs(model, rollout)[0, :n]
    completion = ids["program"] + segment + ids["answer"]
    with torch.no_grad():
        logits = model(torch.tensor([ids["prompt"] + completion])).logits[0, len(ids["prompt"]) - 1 : -1]
    direct = logits.double().log_softmax(-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logp.double(), direct, rtol=1e-4, atol=1e-4)


# --- chat-template prompts and EOS from the template's end-of-turn token ------------------------


@pytest.mark.parametrize("name, saved_eos", [("smollm2", None), ("qwen3", "<|endoftext|>")], ids=["smollm2", "qwen3"])
def test_chatml_prompts_end_a_completion_with_im_end(name, saved_eos, tmp_path):
    """SmolLM2's and Qwen3's ChatML: the prompt is the template's user turn and assistant cue, and
    <|im_end|>, which ends the template's assistant turn, is EOS for sampling and SFT, even where the
    saved tokenizer names another EOS (here Qwen3's with a base model's <|endoftext|>)."""
    from grpokit.data.templates import instruction_text, render_prompt
    from grpokit.rollout.sampler import _eos_ids
    from grpokit.train.sft import tokenize_examples

    model, tokenizer = load_with_tiny_model(name, tmp_path / name, eos_token=saved_eos)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and _eos_ids(model, tokenizer)[0] == im_end
    prompt = render_prompt(QUESTION, tokenizer, "cot")
    assert f"<|im_start|>user\n{instruction_text(QUESTION, 'cot')}<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    (example,) = tokenize_examples(tokenizer, [(prompt, ANSWER)])
    assert example[0][-1] == im_end  # SFT teaches the reply to end as the template ends a turn


def test_deepseek_without_a_chat_template_lays_prompts_out_as_plain_text(rows_file, tmp_path):
    from grpokit.data.templates import instruction_text, render_prompt
    from grpokit.rollout.sampler import _eos_ids

    model, tokenizer = load_with_tiny_model("deepseek-v4", tmp_path / "deepseek")
    assert not tokenizer.chat_template
    assert tokenizer.eos_token == "<｜end▁of▁sentence｜>" and _eos_ids(model, tokenizer)[0] == tokenizer.eos_token_id
    assert render_prompt(QUESTION, tokenizer, "cot") == instruction_text(QUESTION, "cot") + "\n"
    # asked for a chat template it does not have: one line naming the key, no traceback
    proc = cli("train", f"--model.name_or_path={tmp_path / 'deepseek'}", "--data.chat_template=on",
               f"--output_dir={tmp_path / 'run'}", f"--data.sources=[{{path: {rows_file}, format: gsm8k}}]",
               "--grpo.max_steps=1", "--quiet", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [  # the whole of what it says
        f"grpokit: config error: data.chat_template=on but the tokenizer of {tmp_path / 'deepseek'} has no chat "
        "template: set data.chat_template=auto (plain text for a tokenizer without one) or off"]
