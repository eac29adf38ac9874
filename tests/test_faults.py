"""The fault suite: bad data, misbehaving rewards and NaN training each give a clear message
and lose no data."""

import json
import math
import subprocess
import sys
import time
import warnings

import pytest
import torch
from test_grpo_trainer import length_reward, make_trainer

from grpokit.run.checkpoint import verify_checkpoint
from grpokit.data.files import DatasetError, filter_long_prompts, load_prompt_rows
from grpokit.run.metrics import read_metrics
from grpokit.rewards import WeightedReward, score_completions
from grpokit.train.failures import NonFiniteTraining


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = [json.dumps({"question": f"Q: {i}+1\n", "answer": str(i + 1)}) for i in range(5)]


# --------------------------------------------------------------------------- data


def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GOOD[:2] + ['{"question": "Q: 1+1\\n", "answer": '] + GOOD[2:])
    with pytest.raises(DatasetError, match=rf"{path}:3: not valid JSON .*data.skip_malformed_lines=true"):
        load_prompt_rows(path, "question", "answer")
    loaded = load_prompt_rows(path, "question", "answer", skip_malformed=True)
    assert len(loaded.rows) == 5 and loaded.num_skipped == 1 and loaded.skipped[0].startswith(f"{path}:3:")
    assert loaded.rows[0]["prompt"] == "Q: 0+1\n" and loaded.rows[0]["question"] == "Q: 0+1\n"


def test_a_missing_column_names_the_line_the_column_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GOOD[:3] + [json.dumps({"question": "Q: 2+2\n"})])
    with pytest.raises(DatasetError, match=rf"{path}:4: no column 'answer' .*prompt_column / answer_column on that "
                                           r"entry of data.sources"):
        load_prompt_rows(path, "question", "answer")
    with pytest.raises(DatasetError, match=rf"{path}:1: no column 'problem'"):
        load_prompt_rows(path, "problem", "answer")


def test_empty_prompts_and_non_objects_are_rejected_or_skipped(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GOOD[:1] + [json.dumps({"question": "  ", "answer": "1"}), "[1, 2]"])
    with pytest.raises(DatasetError, match=rf"{path}:2: column 'question' is empty"):
        load_prompt_rows(path, "question", "answer")
    loaded = load_prompt_rows(path, "question", "answer", skip_malformed=True)
    assert len(loaded.rows) == 1 and loaded.num_skipped == 2 and "expected a JSON object" in loaded.skipped[1]


def test_an_empty_dataset_and_a_missing_file_are_errors(tmp_path):
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompt_rows(write_jsonl(tmp_path / "empty.jsonl", []), "question", "answer")
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompt_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompt_rows(tmp_path / "x.csv")


def test_json_list_files_name_the_row(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"question": "Q: 1+1\n", "answer": "2"}, {"answer": "3"}]))
    with pytest.raises(DatasetError, match=r"train.json\[row 1\]: no column 'question'"):
        load_prompt_rows(path, "question", "answer")


def test_over_long_prompts_are_skipped_and_counted_truncated_or_refused(tokenizer):
    rows = [{"prompt": "Q: 1+2\n"}, {"prompt": "Q: " + "1+" * 40 + "1\n"}, {"prompt": "Q: 3+4\n"}]
    kept, n = filter_long_prompts(rows, tokenizer, 16, "skip", "train.jsonl")
    assert n == 1 and [r["prompt"] for r in kept] == ["Q: 1+2\n", "Q: 3+4\n"]
    kept, n = filter_long_prompts(rows, tokenizer, 16, "truncate")
    assert n == 1 and len(kept) == 3 and len(tokenizer(kept[1]["prompt"])["input_ids"]) == 16
    assert kept[1]["prompt"].endswith("+1\n")  # the end of the prompt, where the question's cue is, survives
    with pytest.raises(DatasetError, match=r"train.jsonl: 1 prompts are longer than data.max_prompt_length=16 "
                                           r"tokens \(first: row 1, 85 tokens\)"):
        filter_long_prompts(rows, tokenizer, 16, "error", "train.jsonl")


def test_a_bad_data_file_stops_the_cli_before_any_model_loads(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GOOD[:1] + ["not json"])
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train",
                           f"--data.sources=[{{path: '{path}', prompt_column: question}}]", f"--output_dir={run}",
                           "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"grpokit: error: {path}:2: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()


def test_training_from_a_prompt_file_with_skipped_rows(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl",
                       [json.dumps({"question": f"Q: {i}+2\n", "answer": str(i + 2)}) for i in range(8)]
                       + ["{broken", json.dumps({"question": "Q: " + "1+" * 60 + "1\n", "answer": "61"})])
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train",
                           f"--data.sources=[{{path: '{path}', prompt_column: question}}]", "--data.template=none",
                           "--data.skip_malformed_lines=true",
                           "--data.max_prompt_length=32", f"--output_dir={run}", "--grpo.max_steps=1",
                           "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=4",
                           "--model.tiny.hidden_size=32", "--model.tiny.num_layers=1", "--model.tiny.num_heads=2",
                           "--model.tiny.intermediate_size=64", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"skipped {path}:9: not valid JSON" in proc.stderr
    assert "skipped 1 malformed rows" in proc.stderr
    assert ("grpokit: 1 of 9 RL questions are over data.max_prompt_length=32 tokens and were dropped "
            "(data.long_prompts=skip); raise data.max_prompt_length to keep them") in proc.stderr
    assert len(read_metrics(run / "metrics.jsonl")) == 1


# --------------------------------------------------------------------------- rewards


def test_a_reward_that_raises_fails_only_its_samples_and_names_itself():
    def broken(prompts, completions, **_):
        raise RuntimeError("verifier crashed")

    rewards = [WeightedReward("broken", broken), WeightedReward("length", length_reward)]
    with pytest.warns(UserWarning, match="'broken' failed on this batch: RuntimeError: verifier crashed"):
        result = score_completions(rewards, ["p"] * 4, ["a", "bb", "c", "d"], {})
    assert not result.valid.any() and result.errors["broken"] == "RuntimeError: verifier crashed"
    assert result.function_means()["length"] == pytest.approx(0.125)


def test_a_reward_that_hangs_times_out_and_is_counted():
    def hangs(prompts, completions, **_):
        time.sleep(30)
        return [1.0] * len(completions)

    rewards = [WeightedReward("slow", hangs, 1.0, timeout_s=0.2), WeightedReward("length", length_reward)]
    started = time.monotonic()
    with pytest.warns(UserWarning, match="'slow' failed on this batch: RewardTimeout: no result within 0.2s"):
        result = score_completions(rewards, ["p"] * 4, ["a"] * 4, {})
    assert time.monotonic() - started < 5
    assert result.timeouts == {"slow": 4} and not result.valid.any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "x"])
def test_nan_inf_or_non_numbers_mask_the_sample_never_a_silent_zero(bad):
    def partly_bad(prompts, completions, **_):
        return [1.0, bad, 0.0, 1.0]

    result = score_completions([WeightedReward("r", partly_bad)], ["p"] * 4, ["a"] * 4, {})
    assert result.valid.tolist() == [True, False, True, True]
    assert math.isnan(result.total[1]) and "1 of 4 samples" in result.errors["r"]


def test_a_hanging_reward_in_training_masks_the_step_and_the_run_goes_on(tiny_model, tokenizer, chain_rows, tmp_path):
    calls = []

    def hangs_once(prompts, completions, **_):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(30)
        return [1.0] * len(completions)

    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, max_steps=2,
                           rewards=[WeightedReward("hangs_once", hangs_once, 1.0, timeout_s=0.3),
                                    WeightedReward("length", length_reward)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = trainer.train()
    assert history[0]["rewards/timeouts"] == 8 and history[0]["rewards/failed"] == 8
    assert history[1]["rewards/timeouts"] == 0 and history[1]["rewards/failed"] == 0


# --------------------------------------------------------------------------- NaN / inf training


def poison_training_forward(model, steps):
    """Make the training forward pass (grad enabled) produce NaN logits on the given calls: the
    decoder runs once per forward (the LM head runs once per chunk of positions), and NaN hidden
    states make NaN logits."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if steps is None or calls["n"] in steps:
                output.last_hidden_state = output.last_hidden_state * float("nan")
        return output

    return model.get_decoder().register_forward_hook(hook)


def test_a_nan_loss_skips_the_update_and_training_continues(tiny_model, tokenizer, chain_rows, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, max_steps=3)
    poison_training_forward(tiny_model, steps={2})
    history = trainer.train()
    assert [r["skipped_updates"] for r in history] == [0, 1, 0]
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-3") == []


def test_nan_every_step_stops_the_run_with_the_last_good_checkpoint_kept(tiny_model, tokenizer, chain_rows,
                                                                          tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, max_steps=10, max_nonfinite_steps=3)
    trainer.step()  # step 1 is clean
    good = trainer.save_checkpoint()
    good_weights = (good / "model.safetensors").read_bytes()
    poison_training_forward(tiny_model, steps=None)
    with pytest.raises(NonFiniteTraining, match=rf"NaN/inf in 3 consecutive steps .*Last good checkpoint: {good}"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())
    assert (good / "model.safetensors").read_bytes() == good_weights and verify_checkpoint(good) == []
