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
