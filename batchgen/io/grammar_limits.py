"""Limits a response_format must keep before it reaches the grammar compiler (xgrammar, C++).
Some schemas crash it: a schema or regex nested a few thousand levels deep overflows its stack
and kills the whole worker. Others take minutes: its work grows with the square (or more) of a
regex repetition count, of an object's property count and of a chain of `$ref`s, and the job
(and `batchgen validate`) would wait for it. Such a line is refused up front as its own error
line. Each limit keeps the compiler within about a second on one CPU core (x{1000}: 0.05 s,
x{4000}: 0.9 s; an object of 256 string properties 0.13 s, of 2,000 16 s; a chain of 1,000
`$ref`s 0.4 s, of 6,000 74 s)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

MAX_GRAMMAR_BYTES = 256 << 10
"""Largest response_format accepted (its JSON, bytes): the grammar compiler's work grows with it."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a response_format's JSON schema (objects and lists)."""
MAX_REGEX_DEPTH = 128
"""Deepest nesting of groups and classes in a schema `pattern`: the grammar compiler recurses on
it in C++, and a few thousand levels overflow its stack (a crash of the whole worker)."""
MAX_REGEX_REPEAT = 1000
"""Largest count of a regex repetition (`{n}`, `{m,n}`, `{m,}`)."""
MAX_REGEX_UNITS = 20_000
"""Most regex units in all of a line's patterns: each character or class one unit, a
repetition multiplying the units it repeats (`(ab){100}` is 200)."""
MAX_OBJECT_PROPERTIES = 256
"""Most properties one object schema lists."""
MAX_SCHEMA_PROPERTIES = 2048
"""Most properties all the object schemas of a line list together."""
MAX_SCHEMA_REFS = 1024
"""Most `$ref`s in a line's schemas."""

_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")


class GrammarTooComplex(ValueError):
    """A response_format over the limits; the message names where and the limit."""


@dataclass
class _Tally:
    """What the limits count across all the schemas of one line."""
    regex_units: int = 0
    properties: int = 0
    refs: int = 0


def check_grammar_limits(response_format: Any, name: str = "response_format") -> None:
    """Raise GrammarTooComplex for a response_format over a limit (size, schema depth, regex
    nesting and repetition, properties, `$ref`s). `name`: what the message calls it."""
    check_grammars([(name, response_format)])


def check_grammars(named: list[tuple[str, Any]]) -> None:
    """check_grammar_limits for the schemas one grammar is built from (the functions a forced
    tool call may call), the counted limits over all of them together."""
    tally = _Tally()
    for name, value in named:
        size = json_size(value)
        if size is None or size > MAX_GRAMMAR_BYTES:
            said = "is nested past 254 levels" if size is None else f"is {size} bytes"
            raise GrammarTooComplex(f"{name} {said}; at most {MAX_GRAMMAR_BYTES} bytes "
                                    f"and {MAX_SCHEMA_DEPTH} levels: simplify the schema")
        _walk(value, name, tally)


def _walk(root: Any, name: str, tally: _Tally) -> None:
    stack = [(root, 1, name)]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarTooComplex(f"{where}: the schema is nested deeper than "
                                    f"{MAX_SCHEMA_DEPTH} levels: flatten it")
        items = (value.items() if isinstance(value, dict)
                 else enumerate(value) if isinstance(value, list) else ())
        for key, sub in items:
            if key == "pattern" and isinstance(sub, str):
                _check_regex(sub, f"{where}.pattern", tally)
            elif key == "patternProperties" and isinstance(sub, dict):
                for regex in sub:
                    _check_regex(regex, f"{where}.patternProperties key {regex[:40]!r}", tally)
            elif key == "properties" and isinstance(sub, dict):
                _count_properties(len(sub), f"{where}.properties", tally)
            elif key == "$ref" and isinstance(sub, str):
                tally.refs += 1
                if tally.refs > MAX_SCHEMA_REFS:
                    raise GrammarTooComplex(f"{where}: more than {MAX_SCHEMA_REFS} $refs in the "
                                            "schema: inline or merge definitions")
            stack.append((sub, depth + 1, f"{where}.{key}"))


def _count_properties(count: int, where: str, tally: _Tally) -> None:
    if count > MAX_OBJECT_PROPERTIES:
        raise GrammarTooComplex(f"{where} lists {count} properties, over the limit of "
                                f"{MAX_OBJECT_PROPERTIES} for one object: group them into "
                                "nested objects")
    tally.properties += count
    if tally.properties > MAX_SCHEMA_PROPERTIES:
        raise GrammarTooComplex(f"{where}: the schema lists more than {MAX_SCHEMA_PROPERTIES} "
                                "properties in all: split the request or simplify the schema")


def _check_regex(pattern: str, where: str, tally: _Tally) -> None:
    nested = regex_depth(pattern)
    if nested > MAX_REGEX_DEPTH:
        raise GrammarTooComplex(f"{where} nests groups {nested} deep, over the limit of "
                                f"{MAX_REGEX_DEPTH}: simplify the regex")
    units, largest = regex_units(pattern)
    if largest > MAX_REGEX_REPEAT:
        raise GrammarTooComplex(f"{where} repeats {largest} times, over the limit of "
                                f"{MAX_REGEX_REPEAT} for one repetition: bound the value with "
                                "minLength/maxLength, or use * or +")
    tally.regex_units += units
    if tally.regex_units > MAX_REGEX_UNITS:
        raise GrammarTooComplex(f"{where}: the schema's regexes expand to more than "
                                f"{MAX_REGEX_UNITS} characters and classes in all: use fewer "
                                "or smaller repetitions")


def regex_units(pattern: str) -> tuple[int, int]:
    """(units, the largest repetition count) of a regex: each character, escape or class is
    one unit, a group the units it holds, and a repetition `{m,n}` multiplies the units of
    what it repeats by its larger bound (`*`, `+` and `?` do not: the compiler loops)."""
    frames = [0]  # units of each open group, the whole pattern's first
    last = largest = 0  # units of the atom a repetition would repeat
    i, escaped, in_class = 0, False, False
    while i < len(pattern):
        char = pattern[i]
        i += 1
        if in_class:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == "]":
                in_class, last = False, 1
                frames[-1] += 1
            continue
        if escaped or char not in "\\[()|{*+?":
            escaped, last = False, 1
            frames[-1] += 1
        elif char == "\\":
            escaped = True
        elif char == "[":
            in_class = True
        elif char == "(":
            frames.append(0)
            last = 0
        elif char == ")" and len(frames) > 1:
            last = max(frames.pop(), 1)
            frames[-1] += last
        elif char == "|":
            last = 0
        elif char == "{" and (match := _REPEAT.match(pattern, i - 1)) and last:
            low, high = int(match.group(1)), match.group(3)
            count = max(low, int(high) if high else 0, 1)
            largest = max(largest, count)
            count = min(count, 1 << 32)  # past every limit already: keep the products small
            frames[-1] += last * (count - 1)
            last *= count
            i = match.end()
        elif char in "{)":
            last = 1
            frames[-1] += 1
    return sum(frames), largest


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
