"""Model-free checks of a request's `tool_choice`, `tools` and `response_format`: the shapes
OpenAI accepts and what the grammar engine can enforce. Intake runs them on every line (so
`batchgen validate` and a job refuse the same lines, before any model loads); the grammar
builders (engine/structured.py, engine/tool_choice.py) use the same functions."""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A response_format that cannot be enforced; the request becomes an error line."""


class ToolChoiceError(ValueError):
    """A tool_choice that cannot be enforced; the request becomes an error line."""


def forced_functions(tools, tool_choice) -> list[dict] | None:
    """The functions (`{"name", "parameters"}`) a call must be made to, or None when
    tool_choice leaves the model free ("auto", "none", absent)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise ToolChoiceError("tool_choice \"required\" needs a non-empty tools list")
        return functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolChoiceError("tool_choice {\"type\": \"function\"} needs \"function\": "
                                  f"{{\"name\": ...}} naming one of the tools, got {function!r}")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools")
        return chosen
    raise ToolChoiceError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                          f"{tool_choice!r}")


def check_tools(tools) -> None:
    """Raise ToolChoiceError unless `tools` (when given) is a list of function tools."""
    if tools is not None and not isinstance(tools, list):
        raise ToolChoiceError("tools must be a list of {\"type\": \"function\", \"function\": "
                              "{\"name\", \"parameters\"}} objects")
    _functions(tools)


def forces_call(extra: dict) -> bool:
    """Whether a request's tool_choice forces a call (a bad one is no request: False)."""
    try:
        return forced_functions(extra.get("tools"), extra.get("tool_choice")) is not None
    except ToolChoiceError:
        return False


def grammar_constrained(extra: dict) -> bool:
    """Whether a grammar decides the answer from its first token: a tool_choice that forces a
    call, or a JSON response_format (runner/worker/grammars.py compiles them)."""
    response_format = extra.get("response_format")
    return forces_call(extra) or (isinstance(response_format, dict) and
                                  response_format.get("type") in ("json_object", "json_schema"))


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list):
        return []
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolChoiceError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\", \"parameters\"}}")
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": fn["name"], "parameters": params})
    return out


# Assertion keywords the grammar cannot enforce (see _is_permissive for harmless values).
_UNENFORCED = {
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "additionalItems",
    "$dynamicRef",
    "$recursiveRef",
}
# Keywords whose values are data or names, not subschemas.
_DATA_KEYWORDS = {
    "enum",
    "const",
    "default",
    "examples",
    "required",
    "type",
    "title",
    "description",
}
# Keywords whose values map names to subschemas.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def response_format_schema(response_format) -> tuple[dict | None, bool]:
    """(schema, strict) of a response_format; (None, False) for plain text. Raises
    StructuredOutputError for a shape or a schema keyword the grammar cannot enforce."""
    if response_format is None:
        return None, False
    if not isinstance(response_format, dict):
        raise StructuredOutputError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None, False
    if kind == "json_object":
        return {"type": "object"}, False
    if kind != "json_schema":
        raise StructuredOutputError(
            f"response_format.type {kind!r} is not supported; use text, json_object or json_schema"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredOutputError("response_format.json_schema must be an object")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: schema is optional
    if not isinstance(schema, dict):
        raise StructuredOutputError("response_format.json_schema.schema must be an object")
    _check_enforceable(schema, "#")
    return schema, bool(spec.get("strict", False))


def _check_enforceable(schema, path: str) -> None:
    """Raise for keywords the grammar would silently ignore, naming where they are."""
    if not isinstance(schema, dict):
        return  # boolean subschemas are fine
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _UNENFORCED and not _is_permissive(key, value):
            raise StructuredOutputError(f"JSON schema keyword {key!r} at {where} is not supported")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise StructuredOutputError(f"allOf with several schemas at {where} is not supported")
        if key == "multipleOf" and schema.get("type") != "integer":
            # xgrammar enforces it on integers only; on numbers it warns and ignores it.
            raise StructuredOutputError(f"multipleOf at {where} is supported with \"type\": "
                                        "\"integer\" only")
        if key == "pattern" and isinstance(value, str) and any(s in value for s in _LOOKAROUND):
            raise StructuredOutputError(f"regex lookaround in pattern at {where} is not supported")
        if key in _DATA_KEYWORDS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_enforceable(sub, f"{where}/{name}")
        elif isinstance(value, dict):
            _check_enforceable(value, where)
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                _check_enforceable(sub, f"{where}/{i}")


def _is_permissive(key: str, value) -> bool:
    """A keyword value that constrains nothing, e.g. ``additionalItems: true``."""
    if key == "uniqueItems":
        return value is False
    return value is True or value == {}
