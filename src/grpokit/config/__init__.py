"""One config tree of dataclasses: YAML in, `--key=value` overrides, validated before any model loads.

A leaf that every layer reads: it imports no registry. Its validation covers what the values
themselves say; whether the names in it (rewards, grpo.loss, rollout.engine, task.name, ...) name
registered pieces is checked above the registries, by grpokit.checks, whose load_config is this
package's read_config with those checks added (the CLI, grpokit.train(...) and resumed runs read a config so).

Every field carries a one-line doc, the single source for `--help`, YAML keys and the
config.yaml saved in each run directory. Names follow TRL's GRPOConfig where the concept
is the same (num_generations, max_completion_length, learning_rate, beta, epsilon, ...).

schema.py holds the sections, each with its own rules (`problems()`); validation.py the rules
that span sections; loading.py reads YAML and overrides; resume.py says what a resumed run may change.
"""

from grpokit.config.loading import (
    RENAMED_KEYS,
    apply_overrides,
    from_dict,
    read_config,
    renamed_keys,
    resolve_key,
    save_config,
)
from grpokit.config.resume import RESUME_SAFE_KEYS, resume_differences
from grpokit.config.schema import (
    Config,
    DataConfig,
    DataSource,
    DistributedConfig,
    EvalConfig,
    GRPOConfig,
    IterativeConfig,
    LoraConfig,
    ModelConfig,
    PPOConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelDataConfig,
    RewardModelTrainConfig,
    RolloutConfig,
    SFTConfig,
    StepLabelConfig,
    TaskConfig,
    TinyModelConfig,
    describe,
    opt,
    to_dict,
)
from grpokit.config.validation import check_values, check_world_size, cross_section_problems
from grpokit.errors import ConfigError, renamed_names

__all__ = [
    "RENAMED_KEYS", "RESUME_SAFE_KEYS", "Config", "ConfigError", "DataConfig", "DataSource", "DistributedConfig",
    "EvalConfig", "GRPOConfig", "IterativeConfig", "LoraConfig", "ModelConfig", "PPOConfig", "RewardConfig",
    "RewardModelConfig", "RewardModelDataConfig", "RewardModelTrainConfig", "RolloutConfig", "SFTConfig",
    "StepLabelConfig", "TaskConfig", "TinyModelConfig", "apply_overrides", "check_world_size",
    "check_values", "cross_section_problems", "describe", "from_dict", "opt", "read_config", "renamed_keys",
    "resolve_key", "resume_differences", "save_config", "to_dict",
]

# 0.3, one name, one thing: load_config and validate are grpokit.checks' (the names checked against the
# registries too); this package's own are read_config and check_values. The old names still work here
# for one release, with a warning.
__getattr__ = renamed_names(__name__, {
    "load_config": (read_config, "grpokit.config.read_config (its own values only) or grpokit.checks.load_config"),
    "validate": (check_values, "grpokit.config.check_values (its own values only) or grpokit.checks.validate"),
})
