"""The docs against the code, so neither drifts from the other (no training here: fast).

- every YAML block of README.md and docs/ loads through grpokit's config loader;
- every `grpokit ...` command in their code blocks names a real subcommand, real options and real
  config keys, with values of the right type (the config loads as the command would load it); a
  command the docs show being refused with a config error is refused with that very message;
- every message the "Bad input" reference quotes is one the code can print;
- the metrics reference lists every key the code can write to metrics.jsonl, and no other;
- the config reference is generated from the text `--help` prints, key for key;
- README.md is at most 250 lines, its links resolve, its file tree names every package, and (slow)
  its demo row is what `grpokit demo --seed 0` prints on this machine.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from grpokit.cli import COMMANDS, DEMO_PRESET, _parser, config_keys_help, demo_variant_overrides, own_options
from grpokit.checks import load_config
from grpokit.config import Config, ConfigError, resolve_key
from grpokit.config.loading import _renamed_override
from grpokit.config.schema import leaf_paths

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import grpokit_docs  # noqa: E402  (docs/_ext: the generator `make docs` runs)

PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*\{?([\w-]*)\}?")
SHELL = {"", "bash", "sh", "shell", "console", "text"}


def code_blocks(page: Path) -> list[tuple[str, list[str], int]]:
    """(language, lines, first line number) of every fenced block of a Markdown page, indented
    ones (inside a list item) included, each dedented by its fence's indentation."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.groups()
        body, start = [], i + 2
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        blocks.append((lang, body, start))
        i += 1
    return blocks


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


# ------------------------------------------------------------------------------------------- YAML


def yaml_blocks():
    return [pytest.param(page, body, id=where(page, start))
            for page in PAGES for lang, body, start in code_blocks(page) if lang in ("yaml", "yml")]


def test_the_docs_hold_yaml_examples():
    assert len(yaml_blocks()) >= 2


@pytest.mark.parametrize(("page", "body"), yaml_blocks())
def test_every_yaml_example_loads_through_the_config_loader(page, body, tmp_path, monkeypatch):
    # A custom reward the example names (`module:function`) is the page's own Python block that defines it.
    text = "\n".join(body)
    for module, function in re.findall(r"([A-Za-z_]\w*):([A-Za-z_]\w*)", text):
        for lang, code, _ in code_blocks(page):
            if lang == "python" and f"def {function}(" in "\n".join(code):
                (tmp_path / f"{module}.py").write_text("\n".join(code) + "\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "example.yaml").write_text(text + "\n")
    load_config(str(tmp_path / "example.yaml"))


# --------------------------------------------------------------------------------------- commands

INVOCATION = re.compile(r"(?:^|[\s/])grpokit\s+[\w-]")


def commands():
    """(page, line, the tokens after `grpokit`, the output lines that follow in its block) of every
    command in a shell-like block: `grpokit X`, `.venv/bin/grpokit X`, `python -m grpokit X`,
    `torchrun ... -m grpokit X`; continued lines joined, a `$ ` prompt and `# comments` dropped."""
    found = []
    for page in PAGES:
        for lang, body, start in code_blocks(page):
            if lang not in SHELL:
                continue
            joined: list[tuple[int, str]] = []
            for n, line in enumerate(body, start):
                if joined and joined[-1][1].endswith("\\"):
                    joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
                else:
                    joined.append((n, line))
            for k, (n, line) in enumerate(joined):
                command = line.strip().removeprefix("$ ")
                if not INVOCATION.search(command) or command.startswith(("grpokit:", "#")):
                    continue
                tokens = shlex.split(command, comments=True)
                at = next(i for i, t in enumerate(tokens) if t == "grpokit" or t.endswith("/grpokit"))
                rest = tokens[at + 1:]
                for stop in ("&&", "||", ";", "|", ">"):
                    rest = rest[:rest.index(stop)] if stop in rest else rest
                env = dict(t.split("=", 1) for t in tokens[:at] if re.fullmatch(r"[A-Z_]+=\S*", t))
                output = [text.strip() for _, text in joined[k + 1:k + 3]]
                found.append(pytest.param(rest, output, env, id=f"{where(page, n)} grpokit {' '.join(rest)[:60]}"))
    return found


def test_the_docs_hold_commands_of_every_config_subcommand():
    named = {param.values[0][0] for param in commands()}
    assert set(COMMANDS) | {"eval", "bench", "rollout-worker"} <= named


def _config_of(argv: list[str]):
    """The config `grpokit COMMAND ...` would run with, loaded as cli.main loads it (YAML files that
    exist in the repository; placeholders such as run.yaml are left out)."""
    from grpokit.cli import join_override_values

    parser = _parser()
    argv = join_override_values(argv)
    own = own_options(parser)
    overrides = [a for a in argv if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in own]
    args, unknown = parser.parse_known_args([a for a in argv if a not in overrides])
    overrides += unknown
    for key in overrides:  # every override is a real key (or an old one, still read)
        name = key.removeprefix("--").split("=", 1)[0]
        if _renamed_override(name, None, Config) is None:
            resolve_key(name)
    overrides += demo_variant_overrides(args)
    files = [str(ROOT / args.config)] if args.config and (ROOT / args.config).is_file() else []
    files = [str(DEMO_PRESET), *files] if args.command == "demo" else files
    config = load_config(files, overrides)
    return config


@pytest.mark.parametrize(("argv", "output", "env"), commands())
def test_every_command_example_is_real(argv, output, env, monkeypatch):
    subcommand = argv[0]
    if "PYTHONPATH" in env:  # e.g. PYTHONPATH=examples for a loss of one's own
        monkeypatch.syspath_prepend(str(ROOT / env["PYTHONPATH"]))
    for name, value in env.items():  # e.g. GRPOKIT_WORKER_SECRET=short, which the config checks read
        if name != "PYTHONPATH":
            monkeypatch.setenv(name, value)
    assert subcommand in grpokit_docs.subcommands(), f"no subcommand {subcommand!r}"
    if subcommand == "bench":
        assert argv[1:2] in (["cost"], ["memory"], ["limit"], ["--help"]), argv
        return
    if subcommand not in COMMANDS and subcommand != "eval":  # rollout-worker, convert-gguf: own arguments
        return
    if subcommand == "eval":
        from grpokit.eval.command import _parser as eval_parser

        try:
            eval_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"grpokit eval does not take {argv[1:]}")
        return
    if "--help" in argv:
        return
    refused = next((line.removeprefix("grpokit: config error: ") for line in output
                    if line.startswith("grpokit: config error: ")), None)
    if refused is not None:  # the Bad input reference: refused, with the message it quotes
        from grpokit.models.loading import check_model_config
        from grpokit.pipeline.inputs import check_reward_model_setup

        with pytest.raises(ConfigError) as err:  # the checks made before any model loads
            config = _config_of(argv)
            check_model_config(config)
            check_reward_model_setup(config)
        # `...` in a quoted message stands for a long list cut short
        assert re.fullmatch(".*?".join(map(re.escape, refused.split("..."))), str(err.value)), str(err.value)
        return
    try:
        _config_of(argv)
    except ConfigError as err:
        if "pip install" not in str(err):  # a real key whose extra (vllm, a tracker) is not installed here
            raise


# ------------------------------------------------------------------------------------ bad input

@functools.cache
def _literal_text() -> str:
    """Every string the code holds, f-strings with their fixed parts only, one per line."""
    return "\n".join("\x00".join(parts) for parts in _templates())


@functools.cache
def _templates() -> list[list[str]]:
    """Every string of src/grpokit as its fixed parts: one for a plain string, an f-string's parts
    between its values."""
    out = []
    for path in (ROOT / "src" / "grpokit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append([node.value])
            elif isinstance(node, ast.JoinedStr):
                out.append([v.value if isinstance(v, ast.Constant) else "" for v in node.values])
    return out


def quoted_messages():
    page = ROOT / "docs" / "reference" / "errors.md"
    return [pytest.param(line.strip(), id=where(page, start + n))
            for lang, body, start in code_blocks(page) for n, line in enumerate(body)
            if line.strip().startswith("grpokit: ")]


def test_the_bad_input_reference_quotes_messages():
    assert len(quoted_messages()) >= 20


@pytest.mark.parametrize("message", quoted_messages())
def test_every_quoted_message_is_one_the_code_prints(message):
    """Some string of the code, its values standing for anything, is found in the message with at
    least 20 characters of its fixed text, so a message reworded in the code (or in the docs) shows
    up here. The docs shorten paths and lists (`...`), so the whole message is not compared."""
    best = 0
    for parts in _templates():
        fixed = sum(map(len, parts))
        if fixed <= best or fixed < 20 or not all(p in message for p in parts):  # cheap first
            continue
        if re.search(".*?".join(re.escape(p) for p in parts if p), message):
            best = fixed
    assert best >= 20, f"no string of src/grpokit makes {message!r}"


METRIC = re.compile(r"[a-z_]+(/[a-zA-Z_<>]+)+")


def code_metrics() -> set[str]:
    """Every metric-shaped string in src/grpokit (`a/b`, f-strings with `<>` for their values) whose
    first part is a namespace metrics.jsonl uses; the bare keys (kl, loss, ...) are checked the other
    way, by test_every_documented_metric_is_written_by_the_code."""
    namespaces = {key.split("/")[0] for key in documented_metrics() if "/" in key}
    found = set()
    for path in (ROOT / "src" / "grpokit").rglob("*.py"):
        if "bench" in path.parts:  # its own tables, not metrics.jsonl
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<>" for v in node.values)
            else:
                continue
            if METRIC.fullmatch(text) and text.split("/")[0] in namespaces and not text.endswith(("/", "_")):
                found.add(text)
    # the importance-sampling corrections' own stats, logged as rollout/<their key>
    if "rollout/<>" in found:
        found.discard("rollout/<>")
        for path in (ROOT / "src" / "grpokit" / "math").glob("*.py"):
            found |= {f"rollout/{key}" for key in re.findall(r'"(is_[a-z_]+)":', path.read_text())}
    return found


def documented_metrics() -> list[str]:
    """The keys of the metrics reference's table, each cell's `key`s (several per row allowed)."""
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    keys = []
    for row in re.findall(r"^\| (.+?) \|", page, re.MULTILINE):
        keys += [k for k in re.findall(r"`([^`]+)`", row) if k != "key"]
    return keys


def _pattern(key: str) -> re.Pattern:
    """A documented key as a pattern: `<name>` is any value, a trailing `...` any rest."""
    text = re.escape(key).replace(r"\.\.\.", ".+")
    return re.compile(re.sub(r"<[a-z]+>", "[^/]+", text.replace(r"\<", "<").replace(r"\>", ">")))


def test_every_metric_the_code_writes_is_documented():
    documented = [_pattern(k) for k in documented_metrics()]
    missing = sorted(key for key in code_metrics()  # a value may hold a slash: mode/{mode}/{name}
                     if not any(p.fullmatch(key.replace("<>", x)) for p in documented for x in ("x", "x/y")))
    assert not missing, f"write these into docs/reference/metrics.md: {missing}"


def test_every_documented_metric_is_written_by_the_code():
    literals = _literal_text().replace("\x00", "<>")
    code = code_metrics()
    stale = []
    for key in documented_metrics():
        if "/" not in key:  # a bare key: a string of the code
            if not re.search(rf"(^|\n){re.escape(key)}(\n|$)", literals):
                stale.append(key)
        elif not any(_pattern(key).fullmatch(c.replace("<>", x)) or c == key for c in code for x in ("x", "x/y")):
            stale.append(key)
    assert not stale, f"docs/reference/metrics.md names keys the code never writes: {stale}"


# --------------------------------------------------------------------------------------- config


def test_the_config_reference_is_what_help_prints():
    train = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    assert train.epilog == config_keys_help(False)  # what the generator parses is the --help text
    keys = [k.name for k in grpokit_docs.help_keys()]
    assert keys == list(leaf_paths(Config))
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert "<!-- grpokit:config-keys -->" in page
    generated = grpokit_docs.expand(page)
    assert all(f"`{key}`" in generated for key in keys)


def test_the_generated_layers_are_the_import_contract():
    text = grpokit_docs.layers_markdown()
    assert "`grpokit.cli`" in text and "`grpokit.math`" in text
    assert "<!-- grpokit:layers -->" in (ROOT / "docs" / "concepts" / "architecture.md").read_text()


# --------------------------------------------------------------------------------------- README

README = ROOT / "README.md"


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_the_readme_tree_names_every_package():
    tree = next(body for lang, body, _ in code_blocks(README) if body and body[0] == "src/grpokit/")
    entries = [line.split()[0] for line in tree[1:] if line.startswith("  ")]
    named = {entry.rstrip("/") for entry in entries if entry.endswith("/")}
    packages = {p.name for p in (ROOT / "src" / "grpokit").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert named == packages


def readme_demo_row() -> list[str]:
    row = next(line for line in README.read_text().splitlines() if line.startswith("| 0 |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def demo_row(summary: dict) -> list[str]:
    """The README's row for a demo run's summary.json, as the demo prints its numbers."""
    sft, grpo = summary["sft"], summary["grpo"]
    tir = f"{sft['tir']['greedy_accuracy']:.1%} → {grpo['tir']['greedy_accuracy']:.1%}" if grpo.get("tir") else "-"
    return ["0", f"{sft['greedy_accuracy']:.1%}", f"{grpo['greedy_accuracy']:.1%}",
            f"**{100 * (grpo['greedy_accuracy'] - sft['greedy_accuracy']):+.1f} pt**",
            f"{sft['pass_at_k']:.1%}", f"{grpo['pass_at_k']:.1%}", f"{sft['maj_at_k']:.1%}", f"{grpo['maj_at_k']:.1%}",
            tir]


DEMO_MACHINE = Path(__file__).parent / "fixtures" / "readme_demo_machine.json"


def machine_fingerprint() -> dict:
    """What the demo's numbers depend on besides the code and the pinned versions: the processor's
    model and vector extensions (torch picks its kernels by them), torch's threads and version."""
    import platform

    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "machine": platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "vector_extensions": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))}


@pytest.mark.slow
def test_the_readme_demo_row_is_what_the_demo_prints(seed0_demo):
    measured_on = json.loads(DEMO_MACHINE.read_text())
    if machine_fingerprint() != measured_on:  # deterministic on one kind of machine, not across them
        pytest.skip(f"README's demo row was measured on {measured_on}; this machine is {machine_fingerprint()}")
    printed = demo_row(json.loads((seed0_demo / "summary.json").read_text()))
    assert readme_demo_row() == printed, (
        "README.md's seed-0 row is not what `grpokit demo --seed 0` printed on this machine; if the code "
        "changed the numbers, the row is now:\n| " + " | ".join(printed) + " |")


def test_the_demo_row_reads_a_summary_as_the_demo_prints_it():
    sft = {"greedy_accuracy": 0.548, "pass_at_k": 0.906, "maj_at_k": 0.634, "tir": {"greedy_accuracy": 0.442}}
    grpo = {"greedy_accuracy": 0.784, "pass_at_k": 0.906, "maj_at_k": 0.774, "tir": {"greedy_accuracy": 0.438}}
    summary = {"sft": sft, "grpo": grpo}
    assert demo_row(summary) == ["0", "54.8%", "78.4%", "**+23.6 pt**", "90.6%", "90.6%", "63.4%", "77.4%",
                                 "44.2% → 43.8%"]
    assert len(readme_demo_row()) == len(demo_row(summary))  # the README's row has the columns it fills
