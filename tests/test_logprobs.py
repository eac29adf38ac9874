"""token_logprobs: the chunked completion-only path against the model's own full logits."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from grpokit.models.logprobs import PLAIN_HEAD_MODEL_TYPES, backbone_and_head, position_ids_for, token_logprobs

VOCAB, PAD, EOS = 53, 0, 1
PROMPT, COMPLETION = 6, 7


def tiny_lm(architecture: str = "llama", tied: bool = True, **extra) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        tie_word_embeddings=tied,
    )
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[architecture](**common, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    if not tied:  # untie for real: different values, so a mixed-up head would show
        torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.3)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model.eval()


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Five rows: prompts left-padded to PROMPT, completions ending in EOS then right-padded to COMPLETION."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = [6, 3, 1, 4, 6], [7, 2, 5, 1, 4]
    ids = torch.full((5, PROMPT + COMPLETION), PAD)
    mask = torch.zeros_like(ids)
    for row, (p, t) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[row, PROMPT - p : PROMPT + t] = torch.randint(2, VOCAB, (p + t,), generator=g)
        if t < COMPLETION:
            ids[row, PROMPT + t - 1] = EOS
        mask[row, PROMPT - p : PROMPT + t] = 1
    return ids, mask


def full_logits_logprobs(model, ids, mask, temperature=1.0):
    """The plain computation: every position's logits from the model's forward, then slice."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False).logits
    logits = logits[:, PROMPT - 1 : -1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, ids[:, PROMPT:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    padding = mask[:, PROMPT:] == 0  # token_logprobs gives 0 there: no row computes past its end
    return logp.masked_fill(padding, 0.0), entropy.detach().masked_fill(padding, 0.0)


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10, 15, 1024])
def test_matches_full_logits(architecture, tied, temperature, chunk_size):
    model = tiny_lm(architecture, tied)
    assert backbone_and_head(model) is not None  # the chunked path, not the fallback
    ids, mask = padded_batch()
    with torch.no_grad():
        expected, expected_entropy = full_logits_logprobs(model, ids, mask, temperature)
        logp, entropy = token_logprobs(model, ids, mask, PROMPT, temperature, micro_batch_size=2,
                                       with_entropy=True, chunk_size=chunk_size)
    assert logp.shape == entropy.shape == (5, COMPLETION)
    close(logp, expected)
    close(entropy, expected_entropy)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_gradients_match_full_logits(architecture, tied, chunk_size):
    model = tiny_lm(architecture, tied)
    ids, mask = padded_batch(1)
    weights = torch.randn(5, COMPLETION, generator=torch.Generator().manual_seed(2)) * mask[:, PROMPT:]

    def grads(logp):
        model.zero_grad(set_to_none=True)
        (logp * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected_logp, _ = full_logits_logprobs(model, ids, mask, temperature=0.8)
    expected = grads(expected_logp)
    logp, entropy = token_logprobs(model, ids, mask, PROMPT, 0.8, micro_batch_size=2, with_entropy=True,
                                   chunk_size=chunk_size)
    assert logp.requires_grad and not entropy.requires_grad
    got = grads(logp)
    close(logp.detach(), expected_logp.detach())
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_no_grad_outputs_carry_no_graph():
    model = tiny_lm()
    ids, mask = padded_batch()
    with torch.no_grad():
        logp, entropy = token_logprobs(model, ids, mask, PROMPT, with_entropy=True, chunk_size=4)
    assert not logp.requires_grad and not entropy.requires_grad
    assert logp.device == entropy.device == next(model.parameters()).device
    assert token_logprobs(model, ids, mask, PROMPT)[1] is None


def test_head_sees_only_completion_positions_a_chunk_at_a_time():
    model = tiny_lm()
    ids, mask = padded_batch()
    head_positions, forward_calls = [], []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: head_positions.append(out.shape[:-1].numel()))
    model.register_forward_hook(lambda *_: forward_calls.append(1))
    with torch.no_grad():
        token_logprobs(model, ids, mask, PROMPT, micro_batch_size=3, chunk_size=4)
    assert not forward_calls  # the full model's forward (all P + T logits) never runs
    assert max(head_positions) <= 4
    # Rows by completion length [1, 2, 4 | 5, 7] in micro-batches of 3, each cut to its longest
    # row: 3 x 4 + 2 x 7 = 26 positions, where uncut right-padded rows would take 5 x 7 = 35.
    assert sum(head_positions) == 3 * 4 + 2 * 7


def test_micro_batch_size_and_chunk_size_do_not_change_results():
    model = tiny_lm("qwen2")
    ids, mask = padded_batch(3)
    with torch.no_grad():
        a, ea = token_logprobs(model, ids, mask, PROMPT, 1.3, micro_batch_size=1, with_entropy=True, chunk_size=2)
        b, eb = token_logprobs(model, ids, mask, PROMPT, 1.3, micro_batch_size=64, with_entropy=True, chunk_size=1024)
    close(a, b)
    close(ea, eb)
    assert (ea >= 0).all() and (ea <= math.log(VOCAB) + 1e-5).all()


def test_logit_softcapping_is_applied():
    config = AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        final_logit_softcapping=0.5,  # small enough that a missing cap changes every log-prob
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    assert backbone_and_head(model)[2] == 0.5
    ids, mask = padded_batch()
    with torch.no_grad():
        expected, expected_entropy = full_logits_logprobs(model, ids, mask, 0.9)
        logp, entropy = token_logprobs(model, ids, mask, PROMPT, 0.9, with_entropy=True, chunk_size=3)
    close(logp, expected)
    close(entropy, expected_entropy)


def small_config(model_type: str, **extra):
    try:
        return AutoConfig.for_model(
            model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, **extra,
        )
    except ValueError:
        pytest.skip(f"this transformers has no {model_type!r} models")


@pytest.mark.parametrize("model_type", sorted(PLAIN_HEAD_MODEL_TYPES))
def test_every_plain_head_type_matches_its_own_forward(model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(model_type)).float().eval()
    assert backbone_and_head(model) is not None
    ids, mask = padded_batch()
    with torch.no_grad():
        expected, _ = full_logits_logprobs(model, ids, mask, 0.7)
        logp, _ = token_logprobs(model, ids, mask, PROMPT, 0.7, chunk_size=5)
    close(logp, expected)


@pytest.mark.parametrize("model_type, extra", [("granite", {"logits_scaling": 4.0}), ("cohere", {"logit_scale": 0.25})])
def test_models_that_rescale_logits_use_their_own_forward(model_type, extra):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(model_type, **extra)).float().eval()
    assert backbone_and_head(model) is None
    ids, mask = padded_batch()
    expected, expected_entropy = full_logits_logprobs(model, ids, mask, 0.7)
    logp, entropy = token_logprobs(model, ids, mask, PROMPT, 0.7, with_entropy=True, chunk_size=4)
    close(logp, expected)
    close(entropy, expected_entropy)
    weights = torch.randn(5, COMPLETION, generator=torch.Generator().manual_seed(4))
    expected_grad = torch.autograd.grad((expected * weights).sum(), model.get_output_embeddings().weight)[0]
    grad = torch.autograd.grad((logp * weights).sum(), model.get_output_embeddings().weight)[0]
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)


class PlainForward(torch.nn.Module):
    """A causal LM behind a forward that knows nothing of logits_to_keep: the all-logits path."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=use_cache)


def test_a_model_without_logits_to_keep_still_works():
    lm = tiny_lm("qwen2", tied=False)
    ids, mask = padded_batch()
    with torch.no_grad():
        expected, expected_entropy = full_logits_logprobs(lm, ids, mask, 0.5)
        logp, entropy = token_logprobs(PlainForward(lm), ids, mask, PROMPT, 0.5, with_entropy=True, chunk_size=6)
    close(logp, expected)
    close(entropy, expected_entropy)


class FixedLogits(torch.nn.Module):
    """Every row gets the same logits table [L, V]: log-probs and their gradients follow by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return type("Output", (), {"logits": self.table.expand(input_ids.shape[0], -1, -1)})


def test_golden_values_and_gradient_by_hand():
    # Column 1 predicts token 2 (the only completion token); its logits are ln 1, ln 2, ln 3 times 2.
    table = torch.zeros(3, 3)
    table[1] = 2 * torch.log(torch.tensor([1.0, 2.0, 3.0]))
    model = FixedLogits(table)
    ids = torch.tensor([[0, 0, 2], [0, 0, 1]])
    logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), 2, temperature=2.0, with_entropy=True)
    # At temperature 2 the distribution is (1, 2, 3) / 6.
    close(logp.detach(), torch.tensor([[math.log(3 / 6)], [math.log(2 / 6)]]))
    h = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))
    close(entropy, torch.tensor([[h], [h]]))
    # d logp / d logits = (onehot(target) - p) / temperature, summed over both rows.
    logp.sum().backward()
    p = torch.tensor([1 / 6, 2 / 6, 3 / 6])
    expected_grad = torch.zeros(3, 3)
    expected_grad[1] = (torch.tensor([0.0, 0.0, 1.0]) - p + torch.tensor([0.0, 1.0, 0.0]) - p) / 2
    close(model.table.grad, expected_grad)


def test_arguments_are_checked():
    model = tiny_lm()
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="chunk_size=0"):
        token_logprobs(model, ids, mask, PROMPT, chunk_size=0)
    with pytest.raises(ValueError, match="prompt_length=13"):
        token_logprobs(model, ids, mask, 13)
    with pytest.raises(ValueError, match="differ"):
        token_logprobs(model, ids, mask[:, 1:], PROMPT)


def test_target_log_softmax_gradient_in_float64():
    from grpokit.models.logprobs import _TargetLogSoftmax

    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(2, 3, 11, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (2, 3), generator=g)
    torch.testing.assert_close(
        _TargetLogSoftmax.apply(logits, targets),
        torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1),
    )
    assert torch.autograd.gradcheck(lambda x: _TargetLogSoftmax.apply(x, targets), (logits,))


def test_bfloat16_model_matches_its_own_logits_and_trains():
    model = tiny_lm("qwen2", tied=False).to(torch.bfloat16)
    ids, mask = padded_batch()
    expected, _ = full_logits_logprobs(model, ids, mask, 0.7)
    logp, _ = token_logprobs(model, ids, mask, PROMPT, 0.7, chunk_size=4)
    assert logp.dtype == torch.float32
    # Same bfloat16 ops as the forward; only matmul shapes differ, which may round differently.
    torch.testing.assert_close(logp, expected, atol=1e-3, rtol=1e-3)
    logp.sum().backward()
    head_grad = model.get_output_embeddings().weight.grad
    assert head_grad.dtype == torch.bfloat16 and torch.isfinite(head_grad).all() and head_grad.abs().sum() > 0


@pytest.mark.parametrize("pack", [False, True])
def test_a_lora_llama_runs_its_lm_head_at_completion_positions_only(pack):
    """SmolLM2 is a llama trained through LoRA: through the PEFT wrapper the head still sees only the
    positions that predict completion tokens (the head is about a fifth of SmolLM2's forward)."""
    from grpokit.models.lora import apply_lora
    from grpokit.config.schema import LoraConfig

    model = apply_lora(tiny_lm("llama"), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert backbone_and_head(model) is not None
    ids, mask = padded_batch()
    positions = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: positions.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        token_logprobs(model, ids, mask, PROMPT, micro_batch_size=ids.shape[0], pack=pack)
    hook.remove()
    assert 0 < sum(positions) <= ids.shape[0] * COMPLETION
