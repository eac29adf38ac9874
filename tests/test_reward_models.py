"""Reward models: their losses, step-end alignment, process advantages on a PRM-scored batch,
training that learns, the built-in task's step labels, and the replay buffer."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.config import RewardModelConfig, RewardModelTrainConfig
from grpokit.data import arithmetic
from grpokit.data.reward_data import PreferencePair, StepLabelledSample
from grpokit.math import bradley_terry_loss, step_bce_loss
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.rewards.learned import (
    OutcomeRewardModel,
    ProcessRewardModel,
    RewardModelInfo,
    StepScores,
    encode,
    load_reward_model,
    new_reward_model,
    policy_step_ends,
    save_reward_model,
)
from grpokit.train.grpo import step_advantages
from grpokit.train.reward_model import (
    ReplayBuffer,
    evaluate_reward_model,
    fit_reward_model,
    split_by_prompt,
)


def ascii_tokenizer():
    return build_char_tokenizer(ASCII_ALPHABET)


def bpe_tokenizer():
    """A real byte-level BPE trained here on a tiny corpus: tokens span several characters,
    and the corpus makes '\\n\\n' and '<step>' single or multi-character merges."""
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["First we add the numbers.\n\nThen we subtract.<step>So the answer is 12."] * 50
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


# --------------------------------------------------------------------------- losses


def test_bradley_terry_golden():
    # -log sigma(1 - 0) = log(1 + e^-1) = 0.3132617; -log sigma(0.5 - 2) = 1.7014133
    loss = bradley_terry_loss(torch.tensor([1.0, 0.5], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64))
    assert loss.item() == pytest.approx((0.3132616875 + 1.7014132780) / 2, abs=1e-9)


def test_bradley_terry_properties():
    torch.manual_seed(0)
    c, r = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    # Shift invariance: only the margin matters.
    assert bradley_terry_loss(c + 3, r + 3).item() == pytest.approx(bradley_terry_loss(c, r).item(), abs=1e-12)
    # Finite for huge margins, where log(sigmoid(x)) would underflow.
    assert torch.isfinite(bradley_terry_loss(torch.tensor([-1e4]), torch.tensor([1e4])))
    # Always positive, and equal to log 2 at zero margin.
    assert bradley_terry_loss(torch.zeros(3), torch.zeros(3)).item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="must both be"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_step_bce_golden():
    # logit 0 -> p 0.5 -> log 2 whatever the label; logit 2, label 1 -> log(1 + e^-2) = 0.1269280
    loss = step_bce_loss(torch.tensor([0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert loss.item() == pytest.approx((math.log(2) + 0.1269280110) / 2, abs=1e-9)


def test_balanced_step_bce_golden():
    # per-step BCE: label 1 at logit 2 -> log(1 + e^-2) = 0.1269280; label 1 at 0 -> log 2;
    # label 0 at -1 -> log(1 + e^-1) = 0.3132617. Balanced: mean(right mean, wrong mean).
    logits = torch.tensor([2.0, 0.0, -1.0], dtype=torch.float64)
    labels = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    right, wrong = (0.1269280110 + math.log(2)) / 2, 0.3132616875
    assert step_bce_loss(logits, labels, balance=True).item() == pytest.approx((right + wrong) / 2, abs=1e-9)
    assert step_bce_loss(logits, labels).item() == pytest.approx((0.1269280110 + math.log(2) + wrong) / 3, abs=1e-9)
    # One class only: balancing has nothing to weigh, the plain mean.
    ones = torch.ones(3, dtype=torch.float64)
    assert step_bce_loss(logits, ones, balance=True).item() == pytest.approx(step_bce_loss(logits, ones).item())


def test_hard_negative_examples_pair_or_label_each_right_solution_with_its_twins():
    from grpokit.config import RewardModelConfig, RewardModelDataConfig
    from grpokit.tasks.chain import chain_hard_negative, chain_step_labeller
    from grpokit.train.reward_model import hard_negative_examples

    rows = [{"prompt": "Q: 7+5-3+9\n", "answer": "18"}] * 3 + [{"prompt": "Q: 3+4\n", "answer": "7"}]
    completions = ["12-3+9\n9+9\nA: 18", "12-3+9\n9+9\nA: 18", "A: 17", "A: 7"]  # a repeat, a wrong one
    config = RewardModelConfig(data=RewardModelDataConfig(hard_negatives=3))
    pairs = hard_negative_examples("outcome", rows, completions, chain_hard_negative, None, config, seed=0)
    assert {p.chosen for p in pairs} == {"12-3+9\n9+9\nA: 18", "A: 7"}  # right solutions only, each once
    assert all(p.rejected != p.chosen and arithmetic.extract_answer(p.rejected) not in ("18", "7") for p in pairs)
    assert 2 <= len(pairs) <= 6 and len({(p.chosen, p.rejected) for p in pairs}) == len(pairs)  # distinct twins
    assert pairs == hard_negative_examples("outcome", rows, completions, chain_hard_negative, None, config, seed=0)
    samples = hard_negative_examples("process", rows, completions, chain_hard_negative, chain_step_labeller,
                                     config, seed=0)
    assert [(x.prompt, "".join(x.steps)) for x in samples] == [(p.prompt, p.rejected) for p in pairs]
    for x in samples:  # the rule's labels: right up to the slip, wrong from it on
        assert x.labels == tuple(chain_step_labeller({"prompt": x.prompt, "answer": "18" if "7+5" in x.prompt
                                                      else "7"}, list(x.steps)))
        assert not x.labels[-1]
    with pytest.raises(ValueError, match="hard_negatives needs a task"):
        hard_negative_examples("outcome", rows, completions, None, None, config, seed=0)


# --------------------------------------------------------------------------- step ends


def test_step_ends_map_exactly_to_tokens_with_a_multi_token_delimiter_and_a_final_step_without_one():
    """The golden test of process advantages on a PRM-scored batch (docs/algorithm.md, eq. 6).

    Character tokenizer, delimiter "<step>" (6 tokens). Group of G = 2:
      completion 1 "ab<step>c" + EOS: tokens a b < s t e p > c EOS (10); steps "ab<step>" and "c"
        -> step 1 ends at token 7 ('>', the delimiter's last token), step 2 (no delimiter, final)
           at token 9 (EOS, the completion's last token).
      completion 2 "xyz" + EOS (4 tokens): one step, no delimiter -> ends at token 3.
    PRM step rewards [0.9, 0.2] and [0.5]: mean 0.53333, unbiased std 0.351188; with eps 1e-4
      r~ = 1.0437766, -0.9488878, -0.0948888.
    Tokens 0..7 of completion 1 carry r~1 + r~2 = 0.0948888, tokens 8..9 carry r~2; completion 2
    carries r~3 on all four tokens; padding carries 0.
    """
    tok = ascii_tokenizer()
    prm = ProcessRewardModel(None, tok, delimiter="<step>")
    completions = ["ab<step>c", "xyz"]
    steps = [prm.split(c) for c in completions]
    assert steps == [["ab<step>", "c"], ["xyz"]]
    rows = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(map(len, rows)) + 2  # trailing padding, as in a rollout
    ids = torch.full((2, width), tok.pad_token_id)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    scores = [StepScores([0.9, 0.2], [8, 9], True), StepScores([0.5], [3], False)]

    assert policy_step_ends(tok, rows[0], [8, 9]) == [7, 9]
    assert tok.decode(rows[0][7]) == ">"
    assert policy_step_ends(tok, rows[1], [3]) == [3]

    adv = step_advantages(tok, ids, lengths, scores, group_size=2)
    a, b, c = 1.0437765827, -0.9488878024, -0.0948887802
    expected = torch.zeros(2, width)
    expected[0, :8] = a + b
    expected[0, 8:10] = b
    expected[1, :4] = c
    assert adv.shape == (2, width)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_policy_step_ends_on_a_bpe_tokenizer_land_on_each_delimiter():
    """Multi-character tokens: the end token is the one that completes the step's last character,
    so decoding the completion up to it gives exactly the steps so far."""
    tok = bpe_tokenizer()
    completion = "First we add the numbers.\n\nThen we subtract.\n\nSo the answer is 12."
    ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    steps = ProcessRewardModel(None, tok, delimiter="\n\n").split(completion)
    assert len(steps) == 3
    char_ends = [len("".join(steps[: j + 1])) for j in range(3)]
    ends = policy_step_ends(tok, ids, char_ends)
    assert ends[-1] == len(ids) - 1  # the final step ends at EOS
    for j in range(2):
        decoded = tok.decode(ids[: ends[j] + 1], skip_special_tokens=True)
        assert decoded.startswith("".join(steps[: j + 1]))
        # ... and one token fewer does not yet hold the whole delimiter.
        assert not tok.decode(ids[: ends[j]], skip_special_tokens=True).startswith("".join(steps[: j + 1]))


@pytest.mark.parametrize("make_tokenizer", [ascii_tokenizer, bpe_tokenizer], ids=["char", "bpe"])
def test_reward_model_inputs_read_each_step_at_its_last_token(make_tokenizer):
    """A reward model re-tokenizes text with its own tokenizer; each step position must hold
    the step's last character (its delimiter's last one), whatever that tokenizer is."""
    tok = make_tokenizer()
    prompt = "Then we "
    steps = [["First we add the numbers.\n\n", "Then we subtract.<step>", "So the answer is 12."], ["12."]]
    inputs = encode(tok, [prompt, prompt], steps)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    for i, (row, pieces, positions) in enumerate(zip(inputs.input_ids, steps, inputs.step_positions)):
        assert len(positions) == len(pieces)
        assert positions[-1] == int(inputs.attention_mask[i].sum()) - 1  # the final step: the last real token
        for j, pos in enumerate(positions):
            so_far = "".join(pieces[: j + 1])
            assert tok.decode(row[prompt_len : pos + 1].tolist()).startswith(so_far)
            assert not tok.decode(row[prompt_len:pos].tolist()).startswith(so_far)


def test_a_completion_without_a_delimiter_is_one_step_and_is_counted():
    tok = ascii_tokenizer()
    model = new_reward_model(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             tok, "process")
    prm = ProcessRewardModel(model, tok, delimiter="\n")
    scores = prm.score_steps(["Q: 1+1\n", "Q: 1+1\n"], ["A: 2", "1+1\nA: 2"])
    assert [len(s.rewards) for s in scores] == [1, 2]
    assert [s.has_delimiter for s in scores] == [False, True]
    assert scores[0].char_ends == [4] and scores[1].char_ends == [4, 8]
    assert all(r == pytest.approx(0.5) for s in scores for r in s.rewards)  # zero head: sigmoid(0)


# --------------------------------------------------------------------------- training


def _tiny_rm(kind: str):
    tok = build_char_tokenizer(arithmetic.ALPHABET)
    policy = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return tok, new_reward_model(policy, tok, kind)


def _marked_solutions(n: int, seed: int) -> list[tuple[str, list[str], list[str], int]]:
    """(prompt, worked steps, the same steps with one step marked wrong by an '=', that step's index).
    A learnable signal that needs no arithmetic from an untrained model, but does need the model
    to read the right positions: a step is wrong when it or any step before it holds the mark."""
    rng = random.Random(seed)
    out = []
    for q in arithmetic.sample_questions(n, seed, arithmetic.ChainSpec(min_ops=3, max_ops=3), "train"):
        steps, answer = arithmetic.solve(q)
        good = [s + "\n" for s in steps] + [f"A: {answer}"]
        k = rng.randrange(len(good) - 1)
        bad = list(good)
        bad[k] = good[k].replace("+", "=", 1).replace("-", "=", 1) if "=" not in good[k] else good[k]
        out.append((arithmetic.format_prompt(q), good, bad, k))
    return out


def test_outcome_reward_model_learns_to_rank_and_saves_in_hugging_face_format(tmp_path):
    tok, model = _tiny_rm("outcome")
    orm = OutcomeRewardModel(model, tok, batch_size=32)
    pairs = [PreferencePair(p, "".join(good), "".join(bad)) for p, good, bad, _ in _marked_solutions(80, 0)]
    train, heldout = split_by_prompt(pairs, 0.25, seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    assert evaluate_reward_model(orm, heldout)["pairwise_accuracy"] == 0.0  # zero head: all ties, no wins
    cfg = RewardModelConfig(kind="outcome", train=RewardModelTrainConfig(learning_rate=3e-3, max_steps=40,
                                                                         batch_size=16, warmup_steps=5))
    losses = fit_reward_model(orm, train, cfg, progress=False)
    assert sum(losses[-5:]) < sum(losses[:5])
    after = evaluate_reward_model(orm, heldout)
    assert after["pairwise_accuracy"] >= 0.9 and after["mean_margin"] > 0
    # Saved as a Hugging Face sequence classifier, reloadable with its kind.
    path = save_reward_model(model, tok, RewardModelInfo("outcome"), tmp_path / "rm", after)
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(path).config.num_labels == 1
    model2, tok2, info = load_reward_model(path, device="cpu")
    assert info.kind == "outcome"
    prompts, chosen = [p.prompt for p in heldout[:4]], [p.chosen for p in heldout[:4]]
    torch.testing.assert_close(OutcomeRewardModel(model2, tok2).scores(prompts, chosen), orm.scores(prompts, chosen))


def test_process_reward_model_learns_step_labels():
    tok, model = _tiny_rm("process")
    prm = ProcessRewardModel(model, tok, "\n", batch_size=32)
    samples = []
    for prompt, good, bad, k in _marked_solutions(80, 1):
        samples.append(StepLabelledSample(prompt, tuple(good), (True,) * len(good)))
        samples.append(StepLabelledSample(prompt, tuple(bad), tuple(j < k for j in range(len(bad)))))
    train, heldout = split_by_prompt(samples, 0.25, seed=0)
    cfg = RewardModelConfig(kind="process", train=RewardModelTrainConfig(learning_rate=3e-3, max_steps=40,
                                                                         batch_size=16, warmup_steps=5))
    fit_reward_model(prm, train, cfg, progress=False)
    metrics = evaluate_reward_model(prm, heldout)
    assert metrics["step_accuracy"] >= 0.9
    assert metrics["step_accuracy_on_wrong_steps"] >= 0.8 and metrics["step_accuracy_on_right_steps"] >= 0.8


def test_a_reward_model_refuses_data_of_the_other_kind():
    tok, model = _tiny_rm("process")
    with pytest.raises(ValueError, match="cannot train on PreferencePair"):
        fit_reward_model(ProcessRewardModel(model, tok), [PreferencePair("q", "a", "b")],
                         RewardModelConfig(train=RewardModelTrainConfig(max_steps=1)), progress=False)


# --------------------------------------------------------------------------- labels and replay


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (["12-3+9\n", "9+9\n", "A: 18"], [True, True, True]),  # all right
        (["12-3+9\n", "8+9\n", "A: 17"], [True, False, False]),  # the second step slips; all after are wrong
        (["13-3+9\n", "10+9\n", "A: 19"], [False, False, False]),  # the first slips; later steps follow it
        (["12-3+9\n", "9+9\n", "A: 17"], [True, True, False]),  # right steps, wrong answer
        (["A: 18"], [True]),  # a direct answer, right
        (["A: 17"], [False]),  # a direct answer, wrong
        (["A: 18\n", "junk"], [True, False]),  # nothing may follow the answer
    ],
)
def test_step_labels_mark_the_first_wrong_step_and_all_after(steps, expected):
    assert arithmetic.step_labels("7+5-3+9", steps, "18") == expected


def test_replay_buffer_keeps_its_share_of_each_round_and_persists(tmp_path):
    buffer = ReplayBuffer(tmp_path / "replay.jsonl", fraction=0.1, seed=0)
    first = [PreferencePair(f"q{i}", "a", "b") for i in range(50)]
    second = [PreferencePair(f"r{i}", "a", "b") for i in range(30)]
    buffer.add(first, 0)
    buffer.add(second, 1)
    assert len(buffer.items) == 5 + 3
    assert {p.prompt[0] for p in buffer.items} == {"q", "r"}
    reloaded = ReplayBuffer(tmp_path / "replay.jsonl", fraction=0.1)
    reloaded.load()
    assert reloaded.items == buffer.items
    steps = ReplayBuffer(tmp_path / "steps.jsonl", fraction=1.0)
    steps.add([StepLabelledSample("q", ("a\n", "b"), (True, False))], 0)
    again = ReplayBuffer(tmp_path / "steps.jsonl", fraction=1.0)
    again.load()
    assert again.items == steps.items


def test_replay_buffer_reads_back_exactly_what_it_wrote(tmp_path):
    """Its own file: a custom delimiter is not re-split, and an empty sampled completion survives."""
    items = [StepLabelledSample("q", ("a<s>", "b\nc"), (True, False)), StepLabelledSample("q2", ("",), (False,))]
    buffer = ReplayBuffer(tmp_path / "steps.jsonl", fraction=1.0)
    buffer.add(items, 0)
    again = ReplayBuffer(tmp_path / "steps.jsonl", fraction=1.0)
    again.load()
    assert again.items == buffer.items and set(again.items) == set(items)
    pairs = ReplayBuffer(tmp_path / "pairs.jsonl", fraction=1.0)
    pairs.add([PreferencePair("q", "A: 1", "")], 0)
    pairs_again = ReplayBuffer(tmp_path / "pairs.jsonl", fraction=1.0)
    pairs_again.load()
    assert pairs_again.items == pairs.items


def test_an_outcome_score_does_not_depend_on_what_else_is_in_the_batch():
    """Right padding and the sequence head's pad id agree: a short completion scores the same alone
    and beside a long one (the head reads the rightmost non-pad token)."""
    tok, model = _tiny_rm("outcome")
    with torch.no_grad():
        model.score.weight.normal_()  # a non-zero head, so scores differ by position
    orm = OutcomeRewardModel(model, tok)
    alone = orm.scores(["Q: 1+1\n"], ["A: 2"])
    batched = orm.scores(["Q: 1+1\n", "Q: 12+3-4+5\n"], ["A: 2", "15-4+5\n11+5\nA: 16"])
    torch.testing.assert_close(batched[:1], alone)
