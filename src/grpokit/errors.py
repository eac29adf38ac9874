"""ConfigError, at the bottom of the import layers: the modules below grpokit.config (models,
rollout, micro_batches) raise it for a config value that cannot work, and grpokit.config,
which validates the whole tree against the registries above them, raises it too."""


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a wrong value."""

    key = ""  # the dotted key a type error is about, when known (load_config names where it was set)


class EvalError(ValueError):
    """Inputs `grpokit eval` cannot use as given; the message says what to change."""
