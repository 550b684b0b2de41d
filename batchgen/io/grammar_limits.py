"""Limits a response_format must keep before it reaches the grammar compiler (xgrammar, C++):
a schema or regex nested a few thousand levels deep overflows the compiler's stack and kills
the whole worker, so such a line is refused up front as its own error line."""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_GRAMMAR_BYTES = 256 << 10
"""Largest response_format accepted (its JSON, bytes): the grammar compiler's work grows with it."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a response_format's JSON schema (objects and lists)."""
MAX_REGEX_DEPTH = 128
"""Deepest nesting of groups and classes in a schema `pattern`: the grammar compiler recurses on
it in C++, and a few thousand levels overflow its stack (a crash of the whole worker)."""


class GrammarTooComplex(ValueError):
    """A response_format over the limits; the message names where and the limit."""


def check_grammar_limits(response_format: Any, name: str = "response_format") -> None:
    """Raise GrammarTooComplex for a response_format over the size, schema depth or regex
    nesting limits. `name`: what the message calls it (a forced tool's parameters, too)."""
    size = json_size(response_format)
    if size is None or size > MAX_GRAMMAR_BYTES:
        said = "is nested past 254 levels" if size is None else f"is {size} bytes"
        raise GrammarTooComplex(f"{name} {said}; at most {MAX_GRAMMAR_BYTES} bytes "
                                f"and {MAX_SCHEMA_DEPTH} levels: simplify the schema")
    stack = [(response_format, 1, name)]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarTooComplex(f"{where}: the schema is nested deeper than "
                                    f"{MAX_SCHEMA_DEPTH} levels: flatten it")
        items = (value.items() if isinstance(value, dict)
                 else enumerate(value) if isinstance(value, list) else ())
        for key, sub in items:
            if key == "pattern" and isinstance(sub, str):
                nested = regex_depth(sub)
                if nested > MAX_REGEX_DEPTH:
                    raise GrammarTooComplex(f"{where}.pattern nests groups {nested} deep, over "
                                            f"the limit of {MAX_REGEX_DEPTH}: simplify the regex")
            stack.append((sub, depth + 1, f"{where}.{key}"))


def json_size(value: Any) -> int | None:
    """Bytes of `value` as JSON; None when it is nested past 254 levels (orjson's limit) and
    past the json module's recursion. orjson also refuses integers beyond 64 bits, which JSON
    allows (`"maximum": 1e20` written out): those are measured with the json module."""
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        pass
    try:
        return len(json.dumps(value).encode())
    except (RecursionError, TypeError, ValueError):
        return None


def regex_depth(pattern: str) -> int:
    """How deeply a regex nests its groups and character classes (escapes counted out)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
            depth -= not in_class
        elif char in "([":
            depth += 1
            deepest = max(deepest, depth)
            in_class = char == "["
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest
