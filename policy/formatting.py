"""``fleet policy fmt``: the layout of Rego modules, made uniform without changing what they say.

The engine the fleet embeds (regorus) has no formatter, and OPA's cannot be installed here, so this is
the part of ``opa fmt`` that needs no parser of its own: indentation with tabs (each four spaces of a
line's leading whitespace become one), no whitespace at the end of a line, at most one blank line in a
row and none at the start, one newline at the end. Whatever it does is checked: the module is parsed
before and after, and a change that would make its syntax tree differ (for example inside a raw string
that spans lines) is not made: :func:`format_module` says so, and the file is left as it was.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import regorus

from policy.errors import PolicyError

_LEADING = re.compile(r"^[ \t]+")


@dataclass(frozen=True, slots=True)
class Formatted:
    """What formatting one module gave: its new text, and whether it was left alone (``kept``:
    the change would have changed its syntax tree, so it was not made)."""

    text: str
    kept: bool = False


def _layout(text: str) -> str:
    lines: list[str] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        line = line.rstrip()
        indent = _LEADING.match(line)
        if indent is not None:
            spaces = indent.group().replace("\t", "    ")
            line = "\t" * (len(spaces) // 4) + " " * (len(spaces) % 4) + line[indent.end() :]
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def _tree(name: str, text: str) -> Any:
    """The module's syntax tree without positions (what formatting may change)."""
    engine = regorus.Engine()
    try:
        engine.add_policy(name, text)
    except RuntimeError as exc:
        raise PolicyError(f"{name} does not parse: {str(exc).split('Stack backtrace')[0].strip()}") from exc
    return _positionless(json.loads(engine.get_ast_as_json())[0]["ast"])


def _positionless(node: Any) -> Any:
    if isinstance(node, dict):
        if set(node) == {"line", "col", "start", "end"}:
            return None
        return {key: _positionless(value) for key, value in node.items() if key != "span"}
    if isinstance(node, list):
        return [_positionless(item) for item in node]
    return node


def format_module(name: str, text: str) -> Formatted:
    """``text`` (the module ``name``) laid out as above; :class:`PolicyError` if it does not parse."""
    before = _tree(name, text)
    laid_out = _layout(text)
    if laid_out == text:
        return Formatted(text)
    if _tree(name, laid_out) != before:
        return Formatted(text, kept=True)
    return Formatted(laid_out)
