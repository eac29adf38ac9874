"""Tools a policy calls mid-completion (tools/registry.py): the Python sandbox tool of
tool-integrated reasoning (tools/python.py) and whatever else registers itself.

Every module of this package is imported with it, so a new tool is one module."""

import importlib as _importlib
import pkgutil as _pkgutil

from grpokit.tools.registry import (TOOLS, Tool, ToolOutput, appended_text, check_tokenizer, make_tool, register_tool,
                                    run_calls, stopped_at)

for _module in _pkgutil.iter_modules(__path__):  # tool registrations, one module each
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TOOLS", "Tool", "ToolOutput", "appended_text", "check_tokenizer", "make_tool", "register_tool", "run_calls",
           "stopped_at"]
