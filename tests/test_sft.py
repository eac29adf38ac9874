"""SFT: packed batches hold the same examples and give the loss padded batches give."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from grpokit.config import SFTConfig
from grpokit.data import arithmetic
from grpokit.models import build_tiny_model
from grpokit.models.precision import set_compute_dtype
from grpokit.train.schedule import make_optimizer, warmup_cosine
from grpokit.train.sft import (
    TokenizedExamples,
    collate,
    forward_dtype,
    pack_rows,
    packed_batch,
    padded_batch,
    packing_matches_padding,
    sft_train,
    tokenize_examples,
)


@pytest.fixture(scope="module")
def sft_pairs():
    task = arithmetic.ChainSpec()
    rows = arithmetic.make_sft_rows(arithmetic.sample_questions(96, 0, task, "train"), 0.5, 0)
    return [(r["prompt"], r["solution"]) for r in rows]


def test_pack_rows_first_fit_decreasing_by_hand():
    # Longest first: 5 fills a row; 4 opens a row with 1 free; 3 opens one with 2 free;
    # 2 fits beside the 3; 1 fits beside the 4.
    assert pack_rows([5, 3, 2, 4, 1]) == [[0], [3, 4], [1, 2]]
    assert pack_rows([2, 2, 2]) == [[0], [1], [2]]  # nothing fits beside an example of full width
    assert pack_rows([4, 1, 1, 1, 1]) == [[0], [1, 2, 3, 4]]


@pytest.mark.parametrize("seed", range(20))
def test_pack_rows_places_every_example_once_within_the_width(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 70))]
    rows = pack_rows(lengths)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max(lengths) for row in rows)
    # First-fit never leaves two rows that could be merged.
    loads = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(loads) < 2 or loads[0] + loads[1] > max(lengths)


def test_packed_batch_layout_by_hand():
    data = TokenizedExamples.of([([1, 2, 3], 1), ([4, 5], 1), ([6, 7, 8, 9, 10], 2), ([11, 12], 1)])
    batch = packed_batch(data, [0, 1, 2, 3], pad_id=0)
    # Width 5: [6..10] fills row 0; [1, 2, 3] opens row 1 and [4, 5] fills it; [11, 12] opens
    # row 2 and padding (its own positions, no labels) fills the rest.
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5], [11, 12, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 8, 9, 10], [-100, 2, 3, -100, 5], [-100, 12, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert set(batch) == {"input_ids", "labels", "position_ids"}


def test_tokenized_examples_keep_the_tokens_collate_uses(tokenizer, sft_pairs):
    data = tokenize_examples(tokenizer, sft_pairs[:8])
    flat = TokenizedExamples.of(data)
    padded = collate(data, tokenizer.pad_token_id)
    for i, (seq, prompt_len) in enumerate(data):
        s, n = flat.starts[i], flat.lengths[i]
        assert flat.ids[s : s + n].tolist() == seq == padded["input_ids"][i, :n].tolist()
        assert flat.labels[s : s + n].tolist() == padded["labels"][i, :n].tolist()
        assert flat.labels[s : s + prompt_len].eq(-100).all()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_packed_loss_and_gradients_equal_padded_ones_in_float64(architecture, tokenizer, sft_pairs):
    model = build_tiny_model(tokenizer, architecture, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0).double()
    data = tokenize_examples(tokenizer, sft_pairs[:32])
    padded = collate(data, tokenizer.pad_token_id)
    packed = packed_batch(TokenizedExamples.of(data), list(range(32)), tokenizer.pad_token_id)
    assert packed["input_ids"].numel() < 0.8 * padded["input_ids"].numel()  # less padding to compute

    def loss_and_grads(batch):
        # The mean next-token NLL over labelled tokens, in float64 (transformers' own loss
        # casts logits to float32).
        model.zero_grad(set_to_none=True)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        labelled = targets != -100
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        loss = -(logp * labelled).sum() / labelled.sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    padded_loss, padded_grads = loss_and_grads(padded)
    packed_loss, packed_grads = loss_and_grads(packed)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-12, atol=1e-12)
    for packed_grad, padded_grad in zip(packed_grads, padded_grads):
        torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-10, atol=1e-12)


def test_packing_check_accepts_transformers_attention(tiny_model, tokenizer, sft_pairs):
    data = TokenizedExamples.of(tokenize_examples(tokenizer, sft_pairs[:32]))
    assert packing_matches_padding(tiny_model, data, list(range(32)), tokenizer.pad_token_id)
    assert tiny_model.training  # the check restores train mode


class AttentionThatIgnoresPositions(torch.nn.Module):
    """A real model behind a forward that drops position_ids, as code that does not know
    packed sequences would: packed examples then attend to each other."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_packing_check_rejects_attention_that_mixes_examples(tiny_model, tokenizer, sft_pairs):
    data = TokenizedExamples.of(tokenize_examples(tokenizer, sft_pairs[:32]))
    assert not packing_matches_padding(AttentionThatIgnoresPositions(tiny_model), data, list(range(32)),
                                       tokenizer.pad_token_id)
    assert not packing_matches_padding(AttentionThatIgnoresPositions(tiny_model.to(torch.bfloat16)), data,
                                       list(range(32)), tokenizer.pad_token_id)


def demo_policy(dtype: str):
    """The demo's own pi_SFT-to-be, built as `grpokit demo --model.dtype=...` builds it (fp32 master weights)."""
    from grpokit.pipeline.build import load_policy
    from grpokit.cli import DEMO_PRESET
    from grpokit.checks import load_config

    return load_policy(load_config(str(DEMO_PRESET), [f"--model.dtype={dtype}", "--output_dir=unused"]))


def test_bf16_compute_packs_on_the_demo_model(sft_pairs):
    # bf16 compute over fp32 master weights: packed and padded log-probs differ by bf16 rounding
    # (about 2e-3 here), which fp32's tolerance took for a leak, so SFT padded one example per row.
    model, tokenizer = demo_policy("bf16")
    assert next(model.parameters()).dtype == torch.float32 and forward_dtype(model) == torch.bfloat16
    data = TokenizedExamples.of(tokenize_examples(tokenizer, sft_pairs[:64]))
    assert packing_matches_padding(model, data, list(range(64)), tokenizer.pad_token_id)
    # The same model whose attention sees across examples is still refused in bf16 compute.
    leaking = set_compute_dtype(AttentionThatIgnoresPositions(model), torch.bfloat16)
    assert not packing_matches_padding(leaking, data, list(range(64)), tokenizer.pad_token_id)


def padded_reference_losses(model, tokenizer, examples, config: SFTConfig, seed: int = 0) -> list[float]:
    """The SFT loop with one right-padded example per row, the way it was written before packing."""
    data = tokenize_examples(tokenizer, examples)
    optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
    scheduler = warmup_cosine(optimizer, config.warmup_steps, config.max_steps)
    rng, order, losses = random.Random(seed), [], []
    model.train()
    for _ in range(config.max_steps):
        if len(order) < config.batch_size:
            order += rng.sample(range(len(data)), len(data))
        batch = collate([data[i] for i in order[: config.batch_size]], tokenizer.pad_token_id)
        del order[: config.batch_size]
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_sft_train_follows_the_padded_loop_in_float64(tokenizer, sft_pairs):
    config = SFTConfig(learning_rate=3e-3, max_steps=6, batch_size=16, warmup_steps=2)

    def fresh():
        return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                seed=0).double()

    losses = sft_train(fresh(), tokenizer, sft_pairs, config, seed=3, progress=False)
    reference = padded_reference_losses(fresh(), tokenizer, sft_pairs, config, seed=3)
    # transformers' loss rounds to float32; the float64 weights keep the two loops together.
    assert losses == pytest.approx(reference, rel=1e-6)
    assert losses[-1] < losses[0]


def test_sft_train_pads_when_packing_would_mix_examples(tokenizer, sft_pairs, capsys):
    config = SFTConfig(learning_rate=3e-3, max_steps=3, batch_size=16, warmup_steps=1)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    reference_model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                       seed=0)
    losses = sft_train(AttentionThatIgnoresPositions(model), tokenizer, sft_pairs, config, progress=False)
    assert "pads one example per row" in capsys.readouterr().err
    # Padded rows: the loop that ran before packing. Its loss is transformers' cross-entropy over
    # float32 logits; sft_train's is the same sum taken tile by tile, equal to float32 rounding.
    assert losses == pytest.approx(padded_reference_losses(reference_model, tokenizer, sft_pairs, config), rel=1e-6)



# --------------------------------------------------------------------------- tool output in demonstrations


def test_tool_output_in_a_demonstration_is_unlabelled():
    """sft.mask_tool_output: the tokens of a TIR demonstration's output block (after ```output,
    through the closing fence) are left out of the loss; the program before it and the answer after
    it are trained on, and the ids are the completion's as one text. Worked by hand, one token per
    character."""
    from grpokit.models import build_char_tokenizer
    from grpokit.tools.python import PythonTool

    tok = build_char_tokenizer(arithmetic.TIR_ALPHABET)
    prompt, completion = "Q: 2+2 (with python)\n", arithmetic.format_tir_solution("2+2")
    assert completion == "```python\nprint(2+2)\n```\n```output\n4\n```\nA: 4"
    assert PythonTool().output_spans(completion) == [(34, 41)] and completion[34:41] == "\n4\n```\n"
    [(ids, prompt_len, trained)] = tokenize_examples(tok, [(prompt, completion)], PythonTool().output_spans)
    assert ids == tok(prompt + completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert trained == [1] * (prompt_len + 34) + [0] * 7 + [1] * 5  # "A: 4" and EOS
    labels = TokenizedExamples.of([(ids, prompt_len, trained)]).labels
    assert labels.eq(-100).sum() == prompt_len + 7
    padded = padded_batch(TokenizedExamples.of([(ids, prompt_len, trained)]), [0], tok.pad_token_id)
    assert padded["labels"][0].tolist() == labels.tolist()
    # CoT demonstrations hold no output block: unchanged, two elements as before
    assert tokenize_examples(tok, [("Q: 2+2\n", "4\nA: 4")], PythonTool().output_spans)[0][1:] == (7,)
    # a second block, and one the text ends inside
    two = "```output\n1\n```\nso ```output\n22"
    assert PythonTool().output_spans(two) == [(9, 16), (28, 31)]


def test_sft_never_trains_on_tool_output_its_gradient_there_is_zero():
    """The loss over a TIR demonstration does not depend on the logits that predict the output
    block's tokens: their gradient is exactly zero, and the rest's is not."""
    from grpokit.models import build_char_tokenizer
    from grpokit.tools.python import PythonTool

    tok = build_char_tokenizer(arithmetic.TIR_ALPHABET)
    prompt, completion = "Q: 2+2 (with python)\n", arithmetic.format_tir_solution("2+2")
    data = tokenize_examples(tok, [(prompt, completion)], PythonTool().output_spans)
    batch = padded_batch(TokenizedExamples.of(data), [0], tok.pad_token_id)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    logits.requires_grad_(True)
    targets = batch["labels"][:, 1:]
    labelled = targets != -100
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    (-(logp * labelled).sum() / labelled.sum()).backward()
    predicts_output = torch.zeros_like(labelled)
    start = data[0][1] + 34  # the output block's first token; position t - 1 predicts token t
    predicts_output[0, start - 1 : start + 6] = True
    assert logits.grad[0, :-1][predicts_output[0]].abs().sum() == 0
    assert (logits.grad[0, :-1][labelled[0]].abs().sum(-1) > 0).all()


def test_sft_masks_tool_output_by_default_and_the_key_keeps_the_old_behaviour():
    from grpokit.checks import load_config
    from grpokit.pipeline.stages import _demonstration_tool_spans

    spans = _demonstration_tool_spans(load_config(None, []))
    assert spans("```output\n4\n```\nA: 4") == [(9, 16)]
    assert _demonstration_tool_spans(load_config(None, ["--sft.mask_tool_output=false"])) is None


def test_sft_with_lora_trains_adapters_over_a_saved_model_and_the_tiny_model_whole(tmp_path):
    """model.lora.r > 0: `grpokit sft` of a model directory trains LoRA adapters over the frozen base
    and saves the adapter, which loads with its base (merged); the built-in tiny model, random and
    without files to load an adapter with, trains whole as before."""
    from safetensors.torch import load_file

    from grpokit.run.checkpoint import save_checkpoint
    from grpokit.models import build_char_tokenizer, load_model_and_tokenizer
    from run_helpers import cli

    tok = build_char_tokenizer(arithmetic.TIR_ALPHABET)
    base_dir = save_checkpoint(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                               tok, tmp_path / "base")
    run = ["--model.lora.r=4", "--model.lora.alpha=8", "--sft.max_steps=2", "--sft.batch_size=8",
           "--num_sft_examples=16", "--sft.warmup_steps=0", "--quiet"]
    proc = cli("sft", f"--model.name_or_path={base_dir}", f"--output_dir={tmp_path / 'lora'}", *run)
    assert "trainable of" in proc.stdout and "(LoRA adapters; the base is frozen)" in proc.stdout
    saved = tmp_path / "lora" / "checkpoints" / "sft"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    merged, _ = load_model_and_tokenizer(str(saved), dtype="fp32", device="cpu")
    base = load_file(base_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base)  # the adapter learnt
    proc = cli("sft", "--model.tiny.hidden_size=32", "--model.tiny.num_layers=1", "--model.tiny.num_heads=2",
               "--model.tiny.intermediate_size=64", f"--output_dir={tmp_path / 'tiny'}", *run)
    assert "all trainable" in proc.stdout
    assert (tmp_path / "tiny" / "checkpoints" / "sft" / "model.safetensors").is_file()
