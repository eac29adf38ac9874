"""Pages generated from the code at build time, so the docs cannot drift from it.

A page holds a marker line, an HTML comment such as `<!-- grpokit:config-keys -->`; when Sphinx
reads the page (the `source-read` event) the marker is replaced by Markdown made here:

- `config-keys`: every config key, parsed from the very text `grpokit train --help` prints
  (grpokit.cli.config_keys_help), with the choices of each Literal key from the schema's types and the
  demo preset's value where it differs;
- `commands`: every subcommand of `grpokit` with its one-line help (grpokit.cli's parser);
- `layers`: the import layers, top to bottom, from pyproject.toml's import-linter contracts;
- `modules`: every module of src/grpokit with the first sentence of its docstring, package by package.

The functions are plain (no Sphinx) so the tests can call them too (tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- grpokit:([a-z-]+) -->$", re.MULTILINE)


@dataclasses.dataclass
class Key:
    name: str  # dotted, as --help spells it
    default: str  # repr, as --help prints it
    type: str
    doc: str
    items: list[tuple[str, str, str]]  # a list of sections: (item key, default, doc) per item key


def help_keys(demo: bool = False) -> list[Key]:
    """The keys `grpokit train --help` (or `grpokit demo --help`, with the preset's values) lists,
    parsed from its epilog: `  --key=default  [type]`, the doc indented below, and for a list of
    sections (rewards, data.sources) one `        name: default  doc` line per item key."""
    from grpokit.cli import config_keys_help

    keys: list[Key] = []
    for line in config_keys_help(demo).splitlines()[1:]:
        if line.startswith("  --"):
            head, _, kind = line[4:].rpartition("  [")
            name, _, default = head.partition("=")
            keys.append(Key(name, default, kind.removesuffix("]"), "", []))
        elif line.startswith("        "):
            item, _, rest = line.strip().partition(": ")
            default, _, doc = rest.partition("  ")
            keys[-1].items.append((item, default, doc))
        elif line.startswith("      "):
            keys[-1].doc = line.strip()
        else:
            raise ValueError(f"config_keys_help: a line of an unknown shape: {line!r}")
    return keys


def _choices(name: str) -> list[str]:
    """The values a Literal key takes (also inside list[...] and Optional[...]), from the schema."""
    from grpokit.config.schema import Config, leaf_paths

    tp = leaf_paths(Config)[name][1]
    for inner in (tp, *typing.get_args(tp)):
        if typing.get_origin(inner) is Literal:
            return [str(c) for c in typing.get_args(inner)]
    return []


def _cell(text: str) -> str:
    """Text for a Markdown table cell: outside `code` spans the characters Markdown would read as
    markup are escaped; inside them only the table's `|`."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part.replace("|", "\\|") if part.startswith("`") else re.sub(r"([\\*_<>|\[\]])", r"\\\1", part)
                   for part in parts)


def _code(text: str) -> str:
    """Inline code that survives a Markdown table: backticks inside are doubled around."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def config_keys_markdown() -> str:
    """A section per part of the config tree, a table row per key."""
    demo = {k.name: k.default for k in help_keys(demo=True)}
    sections: dict[str, list[Key]] = {}
    for key in help_keys():
        section = key.name.rsplit(".", 1)[0] if "." in key.name else "top level"
        sections.setdefault(section, []).append(key)
    out = []
    for section, keys in sections.items():
        out += [f"## {section if section == 'top level' else '`' + section + '`'}", "",
                "| key | default | type | what it does |", "|---|---|---|---|"]
        for key in keys:
            choices = _choices(key.name)
            kind = " \\| ".join(f"`{c}`" for c in choices) if choices else _code(key.type)
            doc = _cell(key.doc)
            if demo.get(key.name, key.default) != key.default:
                doc += f" *(demo preset: {_code(demo[key.name])})*"
            out.append(f"| {_code(key.name)} | {_code(key.default)} | {kind} | {doc} |")
            for item, default, item_doc in key.items:
                out.append(f"| {_code(key.name + '[].' + item)} | {_code(default)} | | {_cell(item_doc)} |")
        out.append("")
    return "\n".join(out)


def subcommands() -> dict[str, str]:
    """`grpokit`'s subcommands and their one-line help, from its parser."""
    from grpokit.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in sub._choices_actions}


def commands_markdown() -> str:
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| `grpokit {name}` | {_cell(text)} |" for name, text in subcommands().items()]
    return "\n".join(rows) + "\n"


def layers() -> list[str]:
    """The layers contract of pyproject.toml, top (imports the rest) to bottom (imports nothing)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["type"] == "layers")["layers"]


def layers_markdown() -> str:
    rows = ["| layer (imports only those below) | modules, `\\|` = side by side, never importing each other |",
            "|---|---|"]
    for depth, layer in enumerate(layers(), 1):
        modules = " \\| ".join(f"`grpokit.{part.strip()}`" for part in layer.split("|"))
        rows.append(f"| {depth} | {modules} |")
    return "\n".join(rows) + "\n"


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring (its first paragraph when that has no sentence end)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s+[A-Z`(]|$)", first)
    return match.group(1) if match else first


def modules_markdown() -> str:
    """A table per package (the root's loose modules first): each module and what its docstring says."""
    src = ROOT / "src" / "grpokit"
    groups = {"grpokit": sorted(src.glob("*.py"))}
    for package in sorted(p for p in src.iterdir() if (p / "__init__.py").is_file()):
        groups[f"grpokit.{package.name}"] = sorted(package.rglob("*.py"))
    out = []
    for name, paths in groups.items():
        init = src / "__init__.py" if name == "grpokit" else src / name.split(".", 1)[1] / "__init__.py"
        out += [f"### `{name}`", "", _cell(_summary(init)), "", "| module | what it holds |", "|---|---|"]
        for path in paths:
            if path.name != "__init__.py":
                module = ".".join(path.relative_to(src.parent).with_suffix("").parts)
                out.append(f"| `{module}` | {_cell(_summary(path))} |")
        out.append("")
    return "\n".join(out)


GENERATORS = {"config-keys": config_keys_markdown, "commands": commands_markdown, "layers": layers_markdown,
              "modules": modules_markdown}


def expand(text: str) -> str:
    """`text` with every marker replaced by what its generator makes; an unknown marker is an error."""
    def one(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown docs marker <!-- grpokit:{name} -->; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(one, text)


def _on_source_read(app, docname: str, source: list[str]) -> None:
    source[0] = expand(source[0])


def setup(app):
    app.connect("source-read", _on_source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
