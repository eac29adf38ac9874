"""`grpokit train CONFIG.yaml` end to end on a tiny local checkpoint and GSM8K-format data that
the test writes, with the math-verify reward; the output reloads with transformers."""

import functools
import json
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.run.checkpoint import save_checkpoint, verify_checkpoint
from grpokit.checks import load_config
from grpokit.run.metrics import read_metrics
from grpokit.models import build_char_tokenizer, build_tiny_model
from run_helpers import cli

REPO = Path(__file__).resolve().parents[1]
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
     "answer": "2 boxes hold 2*12=<<2*12=24>>24 pens.\n#### 24"},
    {"question": "Sara had 1,200 dollars and spent 200. How much is left?",
     "answer": "She has 1200-200=<<1200-200=1000>>1000 left.\n#### 1,000"},
    {"question": "What is half of 9?", "answer": "Half of 9 is 9/2=<<9/2=4.5>>4.5.\n#### 4.5"},
]


grpokit = functools.partial(cli, cwd=REPO)


def test_train_from_a_yaml_config_on_gsm8k_format_data(tmp_path):
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    save_checkpoint(model, tokenizer, tmp_path / "tiny")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    config = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(tmp_path / "tiny"), "dtype": "fp32", "device": "cpu"},
        "data": {"sources": [{"path": str(data), "format": "gsm8k"}], "template": "cot"},
        "grpo": {"num_generations": 2, "prompts_per_step": 2, "max_completion_length": 8, "max_steps": 3,
                 "save_steps": 2, "learning_rate": 1e-3},
        "rewards": [{"name": "math_accuracy", "weight": 1.0}, {"name": "format", "weight": 0.1}],
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))

    grpokit("train", str(tmp_path / "config.yaml"), "--quiet")

    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("rewards/math_accuracy" in r and "rewards/format" in r for r in rows)
    assert all(r["rewards/failed"] == 0 for r in rows)  # the verifier scored every sample
    final = run / "checkpoints" / "step-3"
    assert verify_checkpoint(final) == [] and (run / "checkpoints" / "latest").resolve() == final.resolve()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert loaded.config.model_type == "llama" and tok.decode(tok("#### 7")["input_ids"]) == "#### 7"
    assert load_config(run / "config.yaml").data.sources[0].format == "gsm8k"


def test_example_configs_are_valid():
    for name in ("gsm8k_math_grpo.yaml", "gsm8k_math_tir_grpo.yaml", "cpu_gsm8k_sft.yaml", "cpu_gsm8k_grpo.yaml"):
        load_config(REPO / "examples" / name)
    paper = load_config(REPO / "examples" / "gsm8k_math_grpo.yaml").grpo
    assert (paper.learning_rate, paper.beta, paper.num_generations, paper.max_completion_length) == (1e-6, 0.04, 64, 1024)
    assert paper.num_generations * paper.prompts_per_step == 1024 and paper.num_iterations == 1
