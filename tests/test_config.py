"""Config tree: YAML + overrides, validation that names the key, round-trip to config.yaml."""

import subprocess
import sys
import time

import pytest
import yaml

from grpokit.checks import load_config
from grpokit.config import Config, ConfigError, describe, save_config, to_dict


def test_defaults_and_overrides():
    c = load_config(overrides=["--beta=0.1", "--grpo.num_generations=4", "--model.tiny.hidden_size=64"])
    assert c.grpo.beta == 0.1 and c.grpo.num_generations == 4 and c.model.tiny.hidden_size == 64


def test_yaml_file_with_trl_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"grpo": {"num_generations": 64, "learning_rate": "1e-6", "beta": 0.04,
                                             "epsilon_high": 0.28, "loss_aggregation": "token"},
                                    "rewards": [{"name": "chain_accuracy", "weight": 2}]}))
    c = load_config(path, ["--max_completion_length=1024"])
    assert c.grpo.num_generations == 64 and c.grpo.learning_rate == 1e-6 and c.grpo.epsilon_high == 0.28
    assert c.grpo.max_completion_length == 1024 and c.rewards[0].weight == 2.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--grpo.betta=1"], "unknown config key 'grpo.betta'.*did you mean 'grpo.beta'"),
        (["--beta=abc"], "grpo.beta: expected a number"),
        (["--grpo.num_generations=2.5"], "grpo.num_generations: expected an integer"),
        (["--loss_aggregation=mean"], r"grpo.loss_aggregation: 'mean' is not one of \['sequence', 'token', 'constant'\]"),
        (["--scale_rewards=maybe"], "grpo.scale_rewards: expected true or false"),
        (["--num_generations=1"], "num_generations must be >= 2"),
        (["--learning_rate=0.1"], "ambiguous"),
        (["beta"], "must look like --key=value"),
        (["--model.tiny.alphabet=arithmetic"], "num_sft_tir_examples > 0 writes python programs.*arithmetic-tir"),
        (["--eval.max_tool_calls=0"], "eval.max_tool_calls must be >= 1"),
        (["--reward_model.hard_negatives=-1"], "reward_model.hard_negatives must be >= 0"),
        (["--grpo.learning_rate=-1"], r"grpo.learning_rate must be > 0, got -1 \(the default is 3e-05\)"),
        (["--sft.learning_rate=0"], "sft.learning_rate must be > 0, got 0"),
        (["--ppo.critic_learning_rate=-1e-4"], "ppo.critic_learning_rate must be > 0"),
        (["--reward_model.learning_rate=0"], "reward_model.learning_rate must be > 0"),
        (["--grpo.max_grad_norm=0"], "grpo.max_grad_norm must be > 0"),
        (["--eval.temperature=0"], "eval.temperature must be > 0"),
        (["--sft.max_steps=0"], r"sft.max_steps must be >= 1, got 0 \(the default is 1500\)"),
        (["--sft.batch_size=0"], "sft.batch_size must be >= 1"),
        (["--eval.batch_size=0"], "eval.batch_size must be >= 1"),
        (["--grpo.warmup_steps=-1"], "grpo.warmup_steps must be >= 0"),
        (["--grpo.weight_decay=-0.1"], "grpo.weight_decay must be >= 0"),
        (["--rewards=[{name: math_acuracy}]"], r"rewards\[0\]: unknown reward function 'math_acuracy' \(did you mean "
                                               r"'math_accuracy'\?\); the built-in ones are chain_accuracy, chain_steps, format, "),
        (["--rewards=[{name: format, args: {x: 1}}]"], "reward 'format' scores completions itself and takes no args"),
        (["--rollout.gpu_memory_utilization=1.5"],
         r"rollout.gpu_memory_utilization must lie in \(0, 1\), got 1.5: .*e.g. 0.5"),
        (["--rollout.gpu_memory_utilization=0"], r"rollout.gpu_memory_utilization must lie in \(0, 1\), got 0"),
        (["--rollout.kv_cache_gb=0"], r"rollout.kv_cache_gb must be > 0 \(or unset\), got 0"),
        (["--rollout.enforce_eager=maybe"],
         r"rollout.enforce_eager: 'maybe' is not one of \['auto', 'true', 'false'\]"),
        (["--rollout.max_model_len=64", "--grpo.max_completion_length=64"],
         r"rollout.max_model_len=64 leaves no room for a prompt before grpo.max_completion_length=64 tokens: raise it"),
        (["--rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size must be >= 1, got 0"),
        (["--rollout.tensor_parallel_size=2"],
         r"rollout.tensor_parallel_size=2 applies to rollout.engine=vllm only \(rollout.engine=hf\): set it to 1"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_zero_stays_valid_where_it_means_none():
    c = load_config(overrides=["--grpo.warmup_steps=0", "--sft.weight_decay=0", "--grpo.beta=0", "--save_steps=0",
                               "--reward_model.warmup_steps=0"])
    assert c.grpo.warmup_steps == 0 and c.sft.weight_decay == 0 and c.grpo.beta == 0 and c.grpo.save_steps == 0


def test_a_bad_value_names_the_override_that_set_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo:\n  beta: 0.1\n")
    with pytest.raises(ConfigError, match=r"^grpo.beta: expected a number, got str 'x' \(from the command-line "
                                          r"override --beta=x\)$"):
        load_config(path, ["--beta=x"])
    with pytest.raises(ConfigError, match=r"^rewards\[0\].weight: expected a number.*\(from the command-line "
                                          r"override --rewards=\[\{name: format, weight: w\}\]\)$"):
        load_config(path, ["--rewards=[{name: format, weight: w}]"])
    path.write_text("grpo:\n  beta: x\n")
    with pytest.raises(ConfigError, match=r"c.yaml: grpo.beta: expected a number"):
        load_config(path, ["--seed=1"])


def test_one_name_where_a_list_of_names_goes_is_a_list_of_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stages: sft\nmodel:\n  lora:\n    target_modules: all-linear\n")
    c = load_config(path)
    assert c.stages == ["sft"] and c.model.lora.target_modules == ["all-linear"]
    with pytest.raises(ConfigError, match="data.sources"):  # a list of sections is not a list of names
        load_config(overrides=["--data.sources=file.jsonl"])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  num_generation: 8\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'grpo.num_generation'.*num_generations"):
        load_config(path)


def test_on_and_off_stay_words_where_the_key_takes_them(tmp_path):
    """YAML 1.1 reads on/off (and yes/no) as booleans; the keys whose values are on/off still get the word."""
    c = load_config(overrides=["--distributed.fsdp=on", "--data.chat_template=off"])
    assert c.distributed.fsdp == "on" and c.data.chat_template == "off"
    path = tmp_path / "c.yaml"
    path.write_text("distributed:\n  fsdp: off\ndata:\n  chat_template: yes\n")
    c = load_config(path)
    assert c.distributed.fsdp == "off" and c.data.chat_template == "on"
    with pytest.raises(ConfigError, match="eval.before"):  # a real boolean key is left alone
        load_config(overrides=["--eval.before=maybe"])
    assert load_config(overrides=["--eval.before=off"]).eval.before is False


def test_round_trip(tmp_path):
    c = load_config(overrides=["--epsilon_high=0.3", "--seed=7"])
    save_config(c, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == c


def test_help_lists_every_key_with_its_doc():
    text = describe(Config)
    for key in ("grpo.num_generations", "grpo.beta", "grpo.epsilon_high", "grpo.loss_aggregation", "sft.max_steps"):
        assert f"--{key}=" in text
    assert "KL coefficient toward the frozen reference" in text


def test_cli_reports_config_errors_before_loading_any_model():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--grpo.betaa=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'grpo.betaa'" in proc.stderr
    assert "parameters" not in proc.stdout  # nothing was built
    assert time.perf_counter() - start < 60


def test_a_run_saved_before_a_key_existed_resumes_without_a_difference():
    from grpokit.config import resume_differences

    current = to_dict(load_config(None, ["--rewards=[{name: math_accuracy}]"]))
    saved = to_dict(load_config(None, ["--rewards=[{name: math_accuracy}]"]))
    for reward in saved["rewards"]:
        del reward["args"]  # what a run saved before rewards[].args existed holds
    del saved["grpo"]["beta"]
    assert resume_differences(saved, current) == []
    saved["grpo"]["beta"] = 0.5  # a real change is still found
    assert resume_differences(saved, current) == ["grpo.beta: 0.5 -> 0.04"]


def test_rollout_sizing_defaults_suit_a_colocated_engine():
    rollout = load_config().rollout
    assert rollout.kv_cache_gb is None and rollout.gpu_memory_utilization == 0.5
    assert rollout.enforce_eager == "auto" and rollout.max_model_len == 0


def test_max_model_len_is_the_longest_prompt_plus_completion_unless_overridden():
    from grpokit.rollout import run_max_model_len

    what = "the longest prompt (40 tokens) + 64 completion tokens"
    assert run_max_model_len(load_config().rollout, 104, what) == 104
    assert run_max_model_len(load_config(overrides=["--rollout.max_model_len=200"]).rollout, 104, what) == 200
    short = load_config(overrides=["--rollout.max_model_len=100"]).rollout
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=100 is shorter than the longest prompt \(40 tokens\) "
                                          r"\+ 64 completion tokens = 104 tokens: raise it to at least 104"):
        run_max_model_len(short, 104, what)


def test_rollout_engine_names_a_registered_engine():
    import importlib.util

    from grpokit.rollout import ENGINES

    assert {"hf", "hf_static", "vllm"} <= set(ENGINES)  # each registered by its own module
    with pytest.raises(ConfigError, match=r"rollout.engine: unknown engine 'vlm' \(did you mean 'vllm'\?\); "
                                          r"registered: hf, hf_static, vllm"):
        load_config(overrides=["--rollout.engine=vlm"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"rollout.engine=vllm but vllm is not installed: .*make \.venv-vllm"):
            load_config(overrides=["--rollout.engine=vllm"])


OLD_REWARD_MODEL = {  # reward_model as a run's config.yaml held it before its keys were grouped
    "kind": "outcome", "path": "", "weight": 1.0, "step_delimiter": "\n", "device": "auto", "batch_size": 64,
    "learning_rate": 0.0002, "max_steps": 50, "train_batch_size": 4, "warmup_steps": 20, "heldout_fraction": 0.1,
    "num_questions": 1000, "samples_per_question": 8, "sample_temperature": 0.9, "max_pairs_per_prompt": 8,
    "replay_fraction": 0.25, "label": "rollouts", "label_rollouts": 8, "hard_negatives": 0,
    "balance_step_labels": False, "label_skip_uniform": True,
}
NEW_KEYS = ["--reward_model.kind=outcome", "--reward_model.train.max_steps=50", "--reward_model.train.batch_size=4",
            "--reward_model.data.temperature=0.9", "--iterative.replay_fraction=0.25",
            "--reward_model.label.method=rollouts"]


@pytest.fixture
def fresh_notices(monkeypatch):
    """Each old key is named on stderr once per process: forget those already named."""
    from grpokit.config import loading

    monkeypatch.setattr(loading, "_announced", set())


def test_an_old_key_in_yaml_still_works_and_names_its_new_key(tmp_path, capsys, fresh_notices):
    path = tmp_path / "c.yaml"
    path.write_text("reward_model:\n  kind: outcome\n  train_batch_size: 4\n  label: rollouts\n"
                    "  label_rollouts: 2\n  replay_fraction: 0.25\n")
    c = load_config(path)
    assert c.reward_model.train.batch_size == 4 and c.iterative.replay_fraction == 0.25
    assert c.reward_model.label.method == "rollouts" and c.reward_model.label.rollouts == 2
    load_config(path)  # a second read names them no more
    lines = capsys.readouterr().err.splitlines()
    assert "grpokit: reward_model.train_batch_size is now reward_model.train.batch_size (the old key still works)" \
        in lines
    assert "grpokit: reward_model.replay_fraction is now iterative.replay_fraction (the old key still works)" in lines
    assert "grpokit: reward_model.label is now reward_model.label.method (the old key still works)" in lines
    assert len(lines) == 4
    path.write_text("reward_model:\n  label_rollouts: 2\n  label:\n    rollouts: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: reward_model.label_rollouts and reward_model.label.rollouts are "
                                          r"both set.*keep only reward_model.label.rollouts"):
        load_config(path)


def test_an_old_override_still_works_and_names_its_new_key(capsys, fresh_notices):
    c = load_config(overrides=["--reward_model.train_batch_size=4", "--reward_model.label=rollouts",
                               "--sample_temperature=0.5"])
    assert c.reward_model.train.batch_size == 4 and c.reward_model.label.method == "rollouts"
    assert c.reward_model.data.temperature == 0.5
    err = capsys.readouterr().err
    assert "grpokit: reward_model.sample_temperature is now reward_model.data.temperature" in err
    assert err.count("reward_model.train_batch_size is now") == 1
    assert c == load_config(overrides=["--reward_model.train.batch_size=4", "--reward_model.label.method=rollouts",
                                       "--reward_model.data.temperature=0.5"])
    with pytest.raises(ConfigError, match=r"^reward_model.train_batch_size: expected an integer, got str 'x' \(from "
                                          r"the command-line override --reward_model.train_batch_size=x\)$"):
        load_config(overrides=["--reward_model.train_batch_size=x"])


def test_an_old_saved_config_loads_and_resumes_as_the_same_settings_under_new_keys(tmp_path):
    from grpokit.config import resume_differences

    current = load_config(overrides=NEW_KEYS)
    saved = to_dict(current)
    saved["reward_model"], saved["iterative"] = dict(OLD_REWARD_MODEL), {"iterations": 1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved, sort_keys=False))
    assert load_config(path) == current
    assert resume_differences(yaml.safe_load(path.read_text()), to_dict(current)) == []
    saved["reward_model"]["batch_size"] = 16  # scoring batch: a resumed run may change it
    assert resume_differences(saved, to_dict(current)) == []
    saved["reward_model"]["train_batch_size"] = 8  # a real change, named by its new key
    assert resume_differences(saved, to_dict(current)) == ["reward_model.train.batch_size: 8 -> 4"]


def test_interval_bounds_include_their_closed_ends_only():
    from grpokit.config.schema import _interval_test

    assert [_interval_test("[0, 1)")(v) for v in (-0.1, 0, 0.5, 1)] == [False, True, True, False]
    assert [_interval_test("(0, 1]")(v) for v in (0, 1e-9, 1, 1.1)] == [False, True, True, False]
    assert [_interval_test("[0, 1]")(v) for v in (0, 1)] == [True, True]


@pytest.mark.parametrize("override, message", [
    ("--iterative.replay_fraction=2", r"iterative.replay_fraction must lie in \[0, 1\], got 2 \(the default is 0.1\)"),
    ("--ppo.lam=1.5", r"ppo.lam must lie in \[0, 1\], got 1.5 \(the default is 0.95\)"),
    ("--grpo.epsilon_high=-1", r"grpo.epsilon_high must be >= 0, got -1 \(the default is None\)"),
    ("--rollout.workers=-1", r"rollout.workers must be >= 0, got -1 \(the default is 0\)"),
])
def test_range_checks_name_the_key_the_value_and_the_default(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_config_is_a_leaf_that_imports_no_registry():
    """grpokit.config is read by every layer, so it imports none of the registries above it."""
    code = ("import sys, grpokit.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['grpokit', 'rewards'], ['grpokit', 'rollout'], "
            "['grpokit', 'tasks'], ['grpokit', 'tools'], ['grpokit', 'run'], ['grpokit', 'checks'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_names_are_checked_above_the_config():
    """grpokit.config checks the values alone; grpokit.checks adds the names, as a run reads a config."""
    from grpokit import checks
    from grpokit import config as leaf

    bad = ["--rewards=[{name: math_acuracy}]"]
    assert leaf.load_config(overrides=bad).rewards[0].name == "math_acuracy"
    with pytest.raises(ConfigError, match=r"rewards\[0\]: unknown reward function 'math_acuracy'"):
        load_config(overrides=bad)
    config = Config()
    config.rollout.engine = "hff"
    leaf.validate(config)
    with pytest.raises(ConfigError, match="rollout.engine: unknown engine 'hff'"):
        checks.validate(config)
    config = Config()
    config.task.name = "countdown"  # the task's own reward replaces the default one
    checks.check_names(config)
    assert [r.name for r in config.rewards] == ["grpokit.tasks.countdown:countdown_accuracy"]


def test_the_chain_tasks_keys_default_to_its_spec():
    """config/ imports nothing of data/: the task section repeats ChainSpec's defaults, and this holds them equal."""
    import dataclasses

    from grpokit.config import TaskConfig
    from grpokit.data.arithmetic import ChainSpec

    task = TaskConfig()
    ours = {f.name: getattr(task, f.name) for f in dataclasses.fields(ChainSpec)}
    spec = dataclasses.asdict(ChainSpec())
    # the one deliberate difference: a run keeps 5% of the questions for validation, while a ChainSpec
    # built by hand keeps none (its draws are the ones from before the validation split)
    assert (ours.pop("validation_percent"), spec.pop("validation_percent")) == (5, 0)
    assert ours == spec
