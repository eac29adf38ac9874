"""The package layout: at most 8 modules at the root, and each module that moved still imports from
its old path for one release, as the same module object, with a warning naming the new path."""

import importlib
import sys
from pathlib import Path

import pytest

import grpokit

ROOT = Path(grpokit.__file__).parent


def test_the_package_root_holds_at_most_eight_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 8, modules


@pytest.mark.parametrize("old", sorted(grpokit.MOVED_MODULES))
def test_an_old_import_path_warns_and_gives_the_moved_module(old):
    new = grpokit.MOVED_MODULES[old]
    assert not ROOT.joinpath(*old.split(".")[1:]).with_suffix(".py").exists()  # no file left at the old path
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=rf"{old} is deprecated: import {new} instead"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_grpokit_import_an_old_name_warns_too():
    sys.modules.pop("grpokit.sandbox", None)
    if hasattr(grpokit, "sandbox"):
        delattr(grpokit, "sandbox")
    with pytest.warns(FutureWarning, match="grpokit.tools.sandbox"):
        from grpokit import sandbox
    assert sandbox.__name__ == "grpokit.tools.sandbox"


def test_the_changelog_lists_every_moved_module():
    changelog = (ROOT.parents[1] / "docs" / "changelog.md").read_text()
    for old, new in grpokit.MOVED_MODULES.items():
        assert f"| `{old}` | `{new}` |" in changelog


RENAMED = [  # (module, old name, new home, new name): one name, one thing (0.3)
    ("grpokit.rollout", "token_logprobs", "grpokit.models.logprobs", "token_logprobs"),
    ("grpokit.rollout", "position_ids_for", "grpokit.models.logprobs", "position_ids_for"),
    ("grpokit.train.update", "micro_batches", "grpokit.train.update", "split_minibatch"),
    ("grpokit.train.sft", "micro_batches", "grpokit.train.sft", "sft_micro_batches"),
    ("grpokit.eval.benchmark", "score_completions", "grpokit.eval.benchmark", "grade_completion_file"),
    ("grpokit.eval", "score_completions", "grpokit.eval.benchmark", "grade_completion_file"),
]


@pytest.mark.parametrize("module, old, home, new", RENAMED)
def test_an_old_name_warns_and_gives_the_renamed_function(module, old, home, new):
    with pytest.warns(FutureWarning, match=rf"{old} is deprecated"):
        found = getattr(importlib.import_module(module), old)
    assert found is getattr(importlib.import_module(home), new)


@pytest.mark.parametrize("old, new", [("load_config", "read_config"), ("validate", "check_values")])
def test_the_configs_own_load_config_and_validate_have_new_names(old, new):
    """grpokit.checks' load_config and validate check the registries' names too; grpokit.config's skip
    them, so they are read_config and check_values, and the old names warn for one release."""
    import grpokit.config

    with pytest.warns(FutureWarning, match=rf"grpokit.config.{old} is deprecated: use grpokit.config.{new}"):
        found = getattr(grpokit.config, old)
    assert found is getattr(grpokit.config, new)
