"""Imports run one way: pyproject.toml's import-linter contracts (the layers from cli down to
config and the leaf modules; math importing nothing of grpokit) hold, and break on a forbidden import."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MATH_CONTRACT = "math imports nothing of grpokit outside grpokit.math"

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.is_file(),
    reason="import-linter is not installed in this Python's environment (pip install 'grpokit[test]')")


def lint_imports(config: Path, src: Path, cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports with `config`, grpokit imported from `src`, and its caches kept out of the repo."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_its_import_contracts(tmp_path):
    result = lint_imports(REPO / "pyproject.toml", REPO / "src", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and MATH_CONTRACT in result.stdout


def test_a_forbidden_import_breaks_them(tmp_path):
    shutil.copytree(REPO / "src" / "grpokit", tmp_path / "grpokit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    losses = tmp_path / "grpokit" / "math" / "losses.py"
    text = losses.read_text()
    assert "\nimport torch\n" in text
    losses.write_text(text.replace("\nimport torch\n", "\nimport torch\n\nimport grpokit.train\n", 1))
    result = lint_imports(REPO / "pyproject.toml", tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert MATH_CONTRACT in broken and "grpokit.math.losses -> grpokit.train" in broken
    assert "layers: cli on top" in broken  # the layers contract catches it too
