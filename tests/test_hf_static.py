"""rollout.engine=hf_static (rollout/hf_static.py): generate with a static KV cache and a compiled
decode step. On this CPU the static-cache code runs forced (StaticCacheDecoder(static=True)): its
greedy completions are plain generate's, token for token; its samples follow softmax(logits / T)
(a chi-square test that rejects the wrong temperature); the log-probs it reports are the sampled
tokens' under that distribution; compiled (dynamo, eager backend), an optimizer step does not
recompile it; a failed compile falls back to plain generate with one warning."""

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.rollout import HFEngine, SamplingParams, make_engine
from grpokit.rollout import hf_static
from grpokit.rollout.hf_static import SampledLogprobs, StaticCacheDecoder, StaticCacheEngine, _bucket
from grpokit.models.logprobs import token_logprobs
from run_helpers import brief_sft

ROOT = Path(__file__).resolve().parents[1]
REAL_CHECKPOINT = ROOT / "models" / "smollm2-135m-instruct"


def static_engine(model, tokenizer, **decoder):
    return StaticCacheEngine(model, tokenizer, StaticCacheDecoder(**{"static": True, "compile": False, **decoder}))


# --- the demo's pi_SFT: greedy completions equal plain generate's -----------------------------------

@pytest.fixture(scope="module")
def demo_policy(tmp_path_factory):
    """The demo's model after a brief SFT (so completions have steps and end with EOS), its tokenizer,
    and the demo task's 500 held-out prompts."""
    from grpokit.cli import DEMO_PRESET
    from grpokit.tasks import task_for

    path = brief_sft(tmp_path_factory)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    heldout = task_for(load_config([str(DEMO_PRESET)])).data(tokenizer, sft=False).heldout
    return model, tokenizer, [row["prompt"] for row in heldout]


def test_greedy_completions_equal_plain_generate_on_the_demos_500_heldout_questions(demo_policy):
    model, tokenizer, prompts = demo_policy
    assert len(prompts) == 500
    params = SamplingParams(96, temperature=0.0, batch_size=256)  # 256 + 244 rows: the second batch is padded
    plain = HFEngine(model, tokenizer).generate(prompts, 1, params)
    static = static_engine(model, tokenizer).generate(prompts, 1, params)
    assert static.completions == plain.completions
    assert torch.equal(static.completion_ids, plain.completion_ids)
    assert torch.equal(static.completion_mask, plain.completion_mask)
    assert torch.equal(static.truncated, plain.truncated)
    assert plain.sampling_logp is None  # hf reports none; hf_static reports the sampler's
    # The reported log-probs are the sampled tokens' under the model (greedy: at temperature 1).
    trainer_logp, _ = token_logprobs(model, static.input_ids, static.attention_mask, static.prompt_length)
    mask = static.completion_mask.bool()
    assert static.sampling_logp[~mask].abs().max() == 0
    torch.testing.assert_close(static.sampling_logp[mask], trainer_logp[mask], atol=1e-4, rtol=0)


def test_a_stop_string_ends_static_completions_as_it_ends_plain_ones(demo_policy):
    model, tokenizer, prompts = demo_policy
    params = SamplingParams(96, temperature=0.0, batch_size=16, stop=("\n",))
    plain = HFEngine(model, tokenizer).generate(prompts[:40], 1, params)
    static = static_engine(model, tokenizer).generate(prompts[:40], 1, params)
    assert static.completions == plain.completions and any(c.endswith("\n") for c in plain.completions)
    assert torch.equal(static.completion_mask, plain.completion_mask)


# --- sampling: the right distribution, the right log-probs ------------------------------------------

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs`; outcomes expected fewer than 5 times are
    pooled into one bin. The p-value is the regularized upper incomplete gamma Q(k/2, x/2)."""
    total = counts.sum()
    expected = probs * total
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum().reshape(1)]).double()
    expected = torch.cat([expected[~rare], expected[rare].sum().reshape(1)]).double()
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_chi_square_helper_golden():
    # counts (10, 30) against (0.5, 0.5): x = (10 - 20)^2/20 * 2 = 10, 1 dof: P(chi2_1 > 10) = 0.001565
    assert chi_square_p_value(torch.tensor([10.0, 30.0]), torch.tensor([0.5, 0.5])) == pytest.approx(0.0015654, 1e-4)


@pytest.mark.parametrize("engine_kind", ["static", "compiled"])
def test_sampled_tokens_follow_softmax_of_logits_over_temperature(tiny_model, tokenizer, engine_kind):
    """4,000 two-token samples of one prompt: the first token's counts against softmax(logits / T),
    the second's (after the commonest first token, decoded from the static cache) against the model's
    next-token distribution there. The same counts reject T = 1, so the test can fail."""
    temperature, n = 0.4, 4000
    decoder = dict(compile=True, backend="eager") if engine_kind == "compiled" else {}
    engine = static_engine(tiny_model, tokenizer, **decoder)
    prompt = "Q: 3+4-2\n"
    torch.manual_seed(1)
    rollout = engine.generate([prompt], n, SamplingParams(2, temperature=temperature, batch_size=512))
    first, second = rollout.completion_ids[:, 0], rollout.completion_ids[:, 1]
    prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = tiny_model(prompt_ids).logits[0, -1]
    vocab = logits.shape[0]
    counts = torch.bincount(first, minlength=vocab).float()
    assert chi_square_p_value(counts, torch.softmax(logits / temperature, -1)) > 1e-3
    assert chi_square_p_value(counts, torch.softmax(logits, -1)) < 1e-6  # the wrong temperature is caught

    common = int(counts.argmax())
    follow = first == common
    with torch.no_grad():
        next_logits = tiny_model(torch.cat([prompt_ids, torch.tensor([[common]])], 1)).logits[0, -1]
    second_counts = torch.bincount(second[follow], minlength=vocab).float()
    assert chi_square_p_value(second_counts, torch.softmax(next_logits / temperature, -1)) > 1e-3

    # Each reported log-prob is log softmax(logits / T) of the token sampled.
    expected_first = torch.log_softmax(logits / temperature, -1)[first]
    torch.testing.assert_close(rollout.sampling_logp[:, 0], expected_first, atol=1e-5, rtol=0)
    expected_second = torch.log_softmax(next_logits / temperature, -1)[second[follow]]
    torch.testing.assert_close(rollout.sampling_logp[follow, 1], expected_second, atol=1e-5, rtol=0)


def test_with_top_p_the_log_probs_are_those_of_the_renormalised_nucleus(tiny_model, tokenizer):
    temperature, top_p = 1.3, 0.6
    prompt = "Q: 1+2\n"
    torch.manual_seed(2)
    rollout = static_engine(tiny_model, tokenizer).generate([prompt], 300, SamplingParams(1, temperature, top_p))
    with torch.no_grad():
        logits = tiny_model(tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]).logits[0, -1]
    probs = torch.softmax(logits / temperature, -1)
    ordered, order = probs.sort(descending=True)
    # transformers' rule: keep the smallest set of top tokens whose mass reaches top_p
    keep = order[: int((ordered.cumsum(0) < top_p).sum()) + 1]
    sampled = rollout.completion_ids[:, 0]
    assert set(sampled.tolist()) <= set(keep.tolist()) and len(set(sampled.tolist())) > 1
    expected = torch.log(probs[sampled] / probs[keep].sum())
    torch.testing.assert_close(rollout.sampling_logp[:, 0], expected, atol=1e-5, rtol=0)


def test_sampled_logprobs_recorder_golden():
    """Two steps by hand: scores [[0, ln 3]] then [[ln 2, 0]], tokens 1 then 0:
    log(3/4) and log(2/3)."""
    recorder = SampledLogprobs()
    recorder(torch.tensor([[7]]), torch.tensor([[0.0, math.log(3)]]))
    recorder(torch.tensor([[7, 1]]), torch.tensor([[math.log(2), 0.0]]))
    logp = recorder.finish(torch.tensor([[1, 0]]))
    torch.testing.assert_close(logp, torch.tensor([[math.log(3 / 4), math.log(2 / 3)]]))


def test_buckets():
    assert [_bucket(n, 8, 256) for n in (1, 8, 9, 200, 256)] == [8, 8, 16, 256, 256]
    assert _bucket(3, 8, 4) == 4 and _bucket(24, 8, 24) == 24 and _bucket(300, 128) == 512


# --- compiled: weight updates do not recompile; a failed compile falls back ---------------------------

@pytest.fixture
def fresh_dynamo():
    """dynamo's caches emptied: another test's compiled decode step (same code, same shapes) would
    otherwise serve this test's first batch, which then compiles nothing."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_decoding_follows_weight_updates_without_recompiling(tiny_model, tokenizer, fresh_dynamo):
    """torch.compile (dynamo with the eager backend: its guards, not inductor's code) on the decode
    step; after each AdamW step (in place) the compiled engine's greedy completions are plain
    generate's with the new weights, and nothing was compiled again."""
    model = copy.deepcopy(tiny_model)
    engine = static_engine(model, tokenizer, compile=True, backend="eager")
    plain = HFEngine(model, tokenizer)
    prompts = ["Q: 1+2\n", "Q: 3+4-5\n", "Q: 9-8\n"]
    params = SamplingParams(12, temperature=0.0, batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    addresses = [p.data_ptr() for p in model.parameters()]
    outputs = []
    for step in range(3):
        static = engine.generate(prompts, 1, params)
        assert static.completions == plain.generate(prompts, 1, params).completions
        outputs.append(static.completions)
        report = engine.rollout_metrics()
        if step == 0:
            assert report["rollout/compiles"] >= 1 and report["rollout/recompiles"] == 0
        else:
            assert report["rollout/compiles"] == 0 and report["rollout/recompiles"] == 0, report
        batch = tokenizer(["Q: 1+2\n=3"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        model.train()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [p.data_ptr() for p in model.parameters()] == addresses  # updated in place
    assert outputs[0] != outputs[-1]  # the updates changed what it writes, and it saw them
    # a new row bucket compiles once more: counted as a compile, not a recompile
    engine.generate(prompts * 4, 1, SamplingParams(12, temperature=0.0, batch_size=16))
    report = engine.rollout_metrics()
    assert report["rollout/compiles"] >= 1 and report["rollout/recompiles"] == 0


def test_compiled_decoding_of_a_lora_policy_follows_its_adapters_without_recompiling(tiny_model, tokenizer,
                                                                                      fresh_dynamo):
    from grpokit.config import LoraConfig
    from grpokit.models.lora import apply_lora

    model = apply_lora(copy.deepcopy(tiny_model), LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    engine = static_engine(model, tokenizer, compile=True, backend="eager")
    prompts = ["Q: 1+2\n", "Q: 3+4-5\n"]
    params = SamplingParams(10, temperature=0.0, batch_size=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-1)
    for step in range(2):
        assert engine.generate(prompts, 1, params).completions == HFEngine(model, tokenizer).generate(
            prompts, 1, params).completions
        report = engine.rollout_metrics()
        assert report["rollout/recompiles"] == 0, report
        assert report["rollout/compiles"] >= 1 if step == 0 else report["rollout/compiles"] == 0, report
        batch = tokenizer(["Q: 1+2\n=3"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        model.train()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_failed_compile_falls_back_to_plain_generate_with_one_warning(tiny_model, tokenizer):
    def broken_backend(graph, example_inputs, **options):
        raise RuntimeError("no compiler here")

    hf_static._said.discard("compile-failed")
    engine = static_engine(tiny_model, tokenizer, compile=True, backend=broken_backend)
    prompts = ["Q: 1+2\n", "Q: 3+4-5\n"]
    params = SamplingParams(10, temperature=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = engine.generate(prompts, 1, params)
        second = engine.generate(prompts, 1, params)
    said = [w for w in caught if "compiling the decode step failed" in str(w.message)]
    assert len(said) == 1 and "no compiler here" in str(said[0].message)
    assert "plain generate for the rest of the run" in str(said[0].message)
    plain = HFEngine(tiny_model, tokenizer).generate(prompts, 1, params)
    assert first.completions == second.completions == plain.completions
    assert engine.decoder.path(tiny_model) == "plain" and first.sampling_logp is not None


# --- the engine as a run builds it --------------------------------------------------------------------

def test_on_cpu_the_engine_samples_with_plain_generate_and_says_so_once(tiny_model, tokenizer, capsys):
    config = load_config([], ["--rollout.engine=hf_static"])
    engine = make_engine(config.rollout, tiny_model, tokenizer)
    assert isinstance(engine, StaticCacheEngine) and engine.decoder.path(tiny_model) == "plain"
    hf_static._said.discard("cpu")
    params = SamplingParams(8, temperature=0.0)
    for _ in range(2):
        rollout = engine.generate(["Q: 1+2\n"], 2, params)
    assert capsys.readouterr().err.count("samples with plain generate") == 1
    assert rollout.completions == HFEngine(tiny_model, tokenizer).generate(["Q: 1+2\n"], 2, params).completions
    assert rollout.sampling_logp is not None


def test_an_installed_transformers_too_old_is_a_config_error_naming_the_key_and_version(monkeypatch):
    assert hf_static.transformers_problem() is None
    monkeypatch.setattr(hf_static.importlib.metadata, "version", lambda name: "5.9.1")
    with pytest.raises(ConfigError, match=r"rollout.engine=hf_static needs transformers>=5.17 .*5\.9\.1 is installed"):
        load_config([], ["--rollout.engine=hf_static"])


def test_the_training_loop_logs_its_compilations_and_the_log_prob_mismatch(tiny_model, tokenizer, tmp_path,
                                                                           fresh_dynamo):
    from grpokit.config import GRPOConfig
    from grpokit.rewards import WeightedReward
    from grpokit.train.grpo import GRPOTrainer

    reward = WeightedReward("length", lambda prompts, completions, **_: [len(c) / 10 for c in completions])
    config = GRPOConfig(num_generations=4, prompts_per_step=2, max_completion_length=12, max_steps=2,
                        micro_batch_size=8, temperature=1.0)
    model = copy.deepcopy(tiny_model)
    trainer = GRPOTrainer(model, tokenizer, [reward], [{"prompt": "Q: 2+2\n"}, {"prompt": "Q: 1+5\n"}], config,
                          tmp_path, progress=False)
    trainer.engine = static_engine(model, tokenizer, compile=True, backend="eager")
    records = [trainer.step(), trainer.step()]
    assert records[0]["rollout/compiles"] >= 1 and records[1]["rollout/compiles"] == 0
    assert all(r["rollout/recompiles"] == 0 for r in records)
    # the sampler's log-probs against the trainer's pi_old: the same model, so they agree closely
    assert all(0 <= r["rollout/logp_mismatch"] < 1e-4 for r in records)


# --- the real checkpoint -------------------------------------------------------------------------------

@pytest.mark.real
def test_greedy_completions_equal_plain_generate_on_the_real_checkpoint():
    """The real checkpoint (SmolLM2-135M-Instruct, fp32 on this CPU) on 20 of the demo task's
    held-out questions, chat-templated: static-cache greedy completions are plain generate's."""
    from grpokit.cli import DEMO_PRESET
    from grpokit.tasks import task_for

    if not (REAL_CHECKPOINT / "config.json").is_file():
        pytest.skip(f"{REAL_CHECKPOINT.relative_to(ROOT)} is absent: `make models` builds it")
    model = AutoModelForCausalLM.from_pretrained(REAL_CHECKPOINT).eval()
    tokenizer = AutoTokenizer.from_pretrained(REAL_CHECKPOINT)
    heldout = task_for(load_config([str(DEMO_PRESET)])).data(tokenizer, sft=False).heldout[:20]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Work out {row['prompt'].strip()[3:]} "
                                                                          "step by step."}],
                                             tokenize=False, add_generation_prompt=True) for row in heldout]
    params = SamplingParams(48, temperature=0.0, batch_size=20)
    plain = HFEngine(model, tokenizer).generate(prompts, 1, params)
    static = static_engine(model, tokenizer).generate(prompts, 1, params)
    assert static.completions == plain.completions
    assert torch.equal(static.completion_mask, plain.completion_mask)


def test_evaluation_never_touches_the_static_caches_training_rollouts_use(tiny_model, tokenizer):
    """A periodic evaluation between two training batches (other rows, longer prompts) leaves training's
    caches (same objects, same lengths) and its next batch exactly as without it; the evaluation
    runs on a decoder of its own (rollout/engine.py, evaluation_engine)."""
    from grpokit.rollout.engine import evaluation_engine

    params = SamplingParams(max_new_tokens=6, temperature=1.0, batch_size=8)

    def training_batches(with_eval: bool):
        engine = static_engine(tiny_model, tokenizer)
        torch.manual_seed(0)
        first = engine.generate(["1+2", "3+4"], 4, params)
        caches = dict(engine.decoder._caches)
        if with_eval:
            with torch.random.fork_rng():  # as the periodic evaluation forks the run's streams
                evaluated = evaluation_engine(engine)
                assert evaluated is not engine and evaluated.model is engine.model
                evaluated.generate(["9" * 300, "1+1", "2+2"], 1, SamplingParams(max_new_tokens=4, temperature=0))
            assert evaluated.decoder._caches and evaluated.decoder._positions > engine.decoder._positions
        assert engine.decoder._caches == caches  # the same cache objects, none grown or replaced
        second = engine.generate(["5+6", "7+8"], 4, params)
        return first.input_ids, second.input_ids

    plain, with_eval = training_batches(False), training_batches(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_eval))


def test_an_engine_built_directly_names_the_ignored_generation_defaults_once(capsys):
    """Training, iterative GRPO and evaluation build HFEngine themselves, not through make_engine: the
    note about the checkpoint's ignored sampling defaults comes from the engine's constructor all the same."""
    from transformers import GenerationConfig

    from grpokit.models import build_char_tokenizer, build_tiny_model
    from grpokit.rollout import sampler

    tokenizer = build_char_tokenizer("abc")
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    model.generation_config = GenerationConfig(do_sample=True, top_k=3, eos_token_id=tokenizer.eos_token_id)
    sampler._noted_defaults.clear()
    for build in (HFEngine, StaticCacheEngine, HFEngine):
        build(model, tokenizer)
    lines = [line for line in capsys.readouterr().err.splitlines() if "its generation_config sets" in line]
    assert len(lines) == 1 and "top_k=3" in lines[0] and "rollouts ignore them" in lines[0]
