"""What is wrong with a line that is not one JSON object, in words that name the fix: the
invalid_json and not_an_object messages of `io/reader.py`."""

from __future__ import annotations

import re

import orjson

# A line starting `"key":`, i.e. the middle of an object spread over several lines.
_KEY_FRAGMENT = re.compile(rb'\s*"(?:[^"\\]|\\.)*"\s*:')


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words: "a JSON array", "JSON null" (not Python's
    "list", "NoneType")."""
    if value is None:
        return "JSON null"
    if isinstance(value, bool):
        return f"JSON {str(value).lower()}"
    kinds = {list: "array", str: "string", int: "number", float: "number"}
    return f"a JSON {kinds.get(type(value), type(value).__name__)}"


def json_problem(raw: bytes, line: int, err: orjson.JSONDecodeError) -> str:
    """The invalid_json message: where in the line (orjson counts the line itself as line 1,
    so only its column is named) and, for what Python and JavaScript write that JSON does not
    allow, the fix."""
    at = raw.decode("utf-8")[err.pos:]  # pos counts characters (past the sign of -Infinity)
    if at.startswith(("NaN", "Infinity")):
        hint = ("; NaN and Infinity are not JSON (Python's json.dumps writes them unless "
                "allow_nan=False): write null for \"not given\", or a finite number")
    elif "infinity" in err.msg:
        hint = "; a number past the float range (about 1.8e308): write a finite number"
    elif "surrogate" in err.msg:
        hint = ("; a \\ud800-\\udfff escape that is not half of a surrogate pair is no "
                "character (a string cut inside an emoji?): replace it, e.g. with \\ufffd")
    elif "depth" in err.msg:
        hint = "; objects and lists nested more than 1,024 levels: flatten them"
    elif "end of data" in err.msg:
        hint = _cut_short_hint(raw)
    elif "after document" in err.msg:
        hint = _content_after_hint(raw)
    else:
        hint = ""
    return f"line {line} is not valid JSON at column {err.colno}: {err.msg}{hint}"


def _content_after_hint(raw: bytes) -> str:
    """Why more follows a line's first JSON value, and the fix: lines that end with a lone
    carriage return (old Mac line ends) run together; a line that starts `"key":` continues an
    object begun on an earlier line; else two objects share the line."""
    if b"\r" in raw.rstrip(b"\r\n"):
        return ("; lines end with a lone carriage return (\\r, old Mac line ends): convert "
                "them, e.g. tr '\\r' '\\n'")
    if _KEY_FRAGMENT.match(raw):
        return ("; the line starts with a \"key\": value pair, so it continues an object "
                "begun on an earlier line: write each object on one line (jq -c)")
    return "; a second JSON value follows the first on this line: put each object on its own line"


def _cut_short_hint(raw: bytes) -> str:
    """Why a line can end before its JSON does, and the fix: the file's last line without a
    newline was cut off (a write or copy that did not finish); another line is part of an
    object spread over several lines, or was cut short by hand."""
    if not raw.endswith(b"\n"):
        return ("; the file ends inside this line (no newline after it): it was cut off while "
                "being written or copied: write the file again from its source, or complete "
                "or delete this line")
    return ("; the line ends before its JSON object does: write each object on one line "
            "(jq -c), or complete or delete this line")
