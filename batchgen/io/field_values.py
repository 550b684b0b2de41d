"""What a request field's value may hold beyond its type.

JSON text: Parquet (and some JSONL writers) store nested fields (body, messages, tools) as JSON
strings, decoded here; a string that does not parse is named with why (maybe_json, text_problem).

Nesting: a line reaches the worker pickled (io/parsed_input) and its chat template walks what it
carries (tools, chat_template_kwargs, messages' other keys), both recursing once per level within
Python's limit of 1,000 frames, so a field nested deeper than MAX_FIELD_DEPTH is refused as that
line's error, by name, before anything recurses into it (too_deep)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

MAX_FIELD_DEPTH = 128
"""Deepest nesting (objects and lists) of one request field; JSON schemas and template
arguments need a few tens at most."""


def deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests objects and lists more than `limit` levels (iterative: no
    recursion, whatever the depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def too_deep(fields: Iterable[tuple[str, Any]], limit: int = MAX_FIELD_DEPTH) -> str | None:
    """The name of the first of the (name, value) `fields` nested deeper than `limit`, or
    None."""
    for name, value in fields:
        if deeper_than(value, limit):
            return name
    return None


def request_fields(data: dict) -> list[tuple[str, Any]]:
    """A line's request fields as OpenAI names them (an OpenAI line's body fields, a plain
    line's own), each chat message's keys as `messages[i].key`."""
    body = data.get("body") if isinstance(data.get("body"), dict) else data
    named = [(k, v) for k, v in body.items() if k != "messages"]
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            named += ([(f"messages[{i}].{k}", v) for k, v in message.items()]
                      if isinstance(message, dict) else [(f"messages[{i}]", message)])
    elif messages is not None:
        named.append(("messages", messages))
    if body is not data:
        named += [(k, v) for k, v in data.items() if k != "body"]
    return named


def maybe_json(value: Any) -> Any:
    """`value` decoded when it is JSON text of an object or a list; else unchanged."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def text_problem(value: Any) -> str:
    """Why a string that looks like a JSON object or list (`maybe_json` left it a string) does
    not parse, with the fix, to add to a field's error message; "" for any other value."""
    if not isinstance(value, str) or value.lstrip()[:1] not in ("[", "{"):
        return ""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError as err:
        said = f"; it is text that does not parse as JSON ({err.msg} at character {err.pos + 1})"
        if value[err.pos:err.pos + 1] == "'":
            said += (": single quotes are Python's str() of a dict or list, not JSON; write "
                     "the cells with json.dumps")
        return said
    return ""
