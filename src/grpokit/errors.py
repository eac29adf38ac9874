"""ConfigError, at the bottom of the import layers: the modules below grpokit.config (models,
rollout, micro_batches) raise it for a config value that cannot work, and grpokit.config,
which validates the whole tree against the registries above them, raises it too. Also the
warning an old name gives for the one release it still works (renamed_names)."""

import warnings
from collections.abc import Callable, Mapping


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a wrong value."""

    key = ""  # the dotted key a type error is about, when known (load_config names where it was set)


class EvalError(ValueError):
    """Inputs `grpokit eval` cannot use as given; the message says what to change."""


def renamed_names(module: str, renamed: Mapping[str, tuple[object, str]]) -> Callable[[str], object]:
    """A module's __getattr__ for names that were renamed or moved (0.3: one name, one thing):
    renamed[old] = (the object, what to use instead); the old name still gives the object, for
    one release, with a FutureWarning saying what to use."""

    def __getattr__(name: str):
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        found, instead = renamed[name]
        warnings.warn(f"{module}.{name} is deprecated: use {instead} (the old name goes in the next release)",
                      FutureWarning, stacklevel=2)
        return found

    return __getattr__
