"""Size measures of grpokit's source that keep a run readable (issue 52), counted with `ast`:

- functions longer than 80 lines (from `def` to the last line of the body, decorators left out);
- functions with more than 8 parameters (positional, keyword-only, *args and **kwargs; self and cls
  left out);
- imports of grpokit inside a function body (a lazy import should be for an optional dependency or
  start-up time);
- the length of pipeline/stages.py.

    python scripts/code_metrics.py [--list]

prints the counts (and with --list every offender); tests/test_code_metrics.py holds them to limits.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "grpokit"
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8


@dataclass
class Metrics:
    long_functions: list[tuple[str, int]] = field(default_factory=list)  # (where, lines)
    wide_functions: list[tuple[str, int]] = field(default_factory=list)  # (where, parameters)
    inner_imports: list[str] = field(default_factory=list)  # where
    stages_lines: int = 0


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _imports_grpokit(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "grpokit" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "grpokit"
    return False


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str, metrics: Metrics):
        self.path, self.metrics, self.scope, self.depth = path, metrics, [], 0

    def _function(self, node):
        where = f"{self.path}:{node.lineno} {'.'.join(self.scope + [node.name])}"
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            self.metrics.long_functions.append((where, lines))
        parameters = _parameters(node)
        if parameters > MAX_PARAMETERS:
            self.metrics.wide_functions.append((where, parameters))
        self.scope.append(node.name)
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def _import(self, node):
        if self.depth and _imports_grpokit(node):
            self.metrics.inner_imports.append(f"{self.path}:{node.lineno}")

    visit_Import = visit_ImportFrom = _import


def measure(src: Path = SRC) -> Metrics:
    metrics = Metrics()
    for path in sorted(src.rglob("*.py")):
        relative = str(path.relative_to(src))
        _Visitor(relative, metrics).visit(ast.parse(path.read_text(), filename=str(path)))
    metrics.stages_lines = len((src / "pipeline" / "stages.py").read_text().splitlines())
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name every offender")
    args = parser.parse_args(argv)
    m = measure()
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(m.long_functions)}")
    if args.list:
        print("".join(f"  {where} ({n} lines)\n" for where, n in m.long_functions), end="")
    print(f"functions with more than {MAX_PARAMETERS} parameters: {len(m.wide_functions)}")
    if args.list:
        print("".join(f"  {where} ({n})\n" for where, n in m.wide_functions), end="")
    print(f"grpokit imports inside functions: {len(m.inner_imports)}")
    if args.list:
        print("".join(f"  {where}\n" for where in m.inner_imports), end="")
    print(f"pipeline/stages.py: {m.stages_lines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
