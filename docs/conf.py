# The grpokit docs site: Sphinx with MyST (myst-parser) and the Furo theme. `make docs` builds it with
# warnings as errors (sphinx-build -W --keep-going) into docs/_build/html.
#
# Why Sphinx + MyST: the docs were Markdown (README, docs/algorithm.md, docs/async.md, BENCHMARKS.md)
# and stay Markdown, readable on GitHub and in an editor as they are, while Sphinx adds what plain
# Markdown lacks: a toctree and search, cross-page links checked at build time, autodoc for the
# grpokit.math API from its docstrings, and an extension that writes pages from the code (the config
# keys, the subcommands, the import layers: _ext/grpokit_docs.py), so those cannot drift from
# `--help` or pyproject.toml. verl, torchtune and NeMo-RL document themselves the same way.
# Furo: a maintained, readable theme with a light/dark mode and no JavaScript framework.

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "grpokit"
author = "grpokit authors"
copyright = "grpokit authors, Apache-2.0"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "grpokit_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# MyST: Markdown as GitHub writes it, plus `{directive}` fences; headings get anchors so that
# [text](page.md#heading) links are checked too.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings write code in single backticks, as Markdown does.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}

def _docstring_as_written(app, what, name, obj, options, lines):
    """grpokit's docstrings are plain text (formulas such as |o_i| and `code` in backticks, as
    Markdown writes it), not reStructuredText: show each as the literal block it is, so that its
    formulas and indentation survive and docutils never reads them as markup."""
    if lines:
        lines[:] = ["::", ""] + ["   " + line for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _docstring_as_written)


html_theme = "furo"
html_title = "grpokit"
html_static_path: list[str] = []
