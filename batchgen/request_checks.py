"""Model-free checks of a request's `tool_choice`, `tools` and `response_format`: the shapes
OpenAI accepts and what the grammar engine can enforce. Intake runs them on every line (so
`batchgen validate` and a job refuse the same lines, before any model loads); the grammar
builders (engine/structured.py, engine/tool_choice.py) use the same functions."""

from __future__ import annotations

import json
import re
import reprlib


class StructuredOutputError(ValueError):
    """A response_format that cannot be enforced; the request becomes an error line."""


class ToolChoiceError(ValueError):
    """A tool_choice that cannot be enforced; the request becomes an error line."""


def forced_functions(tools, tool_choice) -> list[dict] | None:
    """The functions (`{"name", "parameters"}`) a call must be made to, or None when
    tool_choice leaves the model free ("auto", "none", absent). A tool_choice other than
    "none" without tools is refused, as OpenAI refuses it: there is nothing to choose from."""
    if tool_choice is None or tool_choice == "none":
        return None
    name = _chosen_name(tool_choice)
    functions = _functions(tools)
    if not functions:
        said = json.dumps(tool_choice if name is None
                          else {"type": "function", "function": {"name": name}})
        raise ToolChoiceError(f"tool_choice {said} needs a non-empty tools list (tool_choice is "
                              "only allowed when tools are specified): give tools, or drop "
                              "tool_choice")
    if tool_choice == "auto":
        return None
    if tool_choice == "required":
        return functions
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools")
    return chosen


def _chosen_name(tool_choice) -> str | None:
    """The function a named tool_choice picks (None for "auto" / "required"); ToolChoiceError
    for a tool_choice of another shape."""
    if tool_choice in ("auto", "required"):
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolChoiceError("tool_choice {\"type\": \"function\"} needs \"function\": "
                                  f"{{\"name\": ...}} naming one of the tools, got {function!r}")
        return name
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
    return forces_call(extra) or json_response_format(extra)


def json_response_format(extra: dict) -> bool:
    """Whether a request's response_format asks for JSON (json_object or json_schema)."""
    response_format = extra.get("response_format")
    return (isinstance(response_format, dict) and
            response_format.get("type") in ("json_object", "json_schema"))


def no_parameters() -> dict:
    """The parameters schema of a function that gives none (or `{}`): its arguments are `{}`
    (OpenAI: "omitting parameters defines a function with an empty parameter list")."""
    return {"type": "object", "properties": {}, "additionalProperties": False}


FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name, as OpenAI allows it."""


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list):
        return []
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise ToolChoiceError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\", \"parameters\"}} with a non-empty name (function "
                                  "tools are the only kind)")
        if not FUNCTION_NAME.fullmatch(fn["name"]):
            raise ToolChoiceError(f"tools[{i}].function.name {fn['name'][:80]!r} must be 1 to "
                                  "64 letters, digits, underscores or dashes, as OpenAI "
                                  "requires (a parser reads a call's name as such)")
        if fn["name"] in names:
            raise ToolChoiceError(f"tools[{i}] repeats the function name {fn['name']!r}: each "
                                  "tool needs its own name (a call names the tool it calls)")
        names.add(fn["name"])
        params = fn.get("parameters")
        params = no_parameters() if params is None or params == {} else params
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object")
        if params.get("type", "object") not in ("object", ["object"]):
            # A call's arguments are a JSON object: another type's value is no call a parser
            # reads, so a forced call would come back as text, without tool_calls.
            said = json.dumps(params["type"], default=str)[:80]
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a schema of \"type\": "
                                  "\"object\" (a call's arguments are a JSON object), got "
                                  f"\"type\": {said}: put the values in properties of an object")
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
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        # bool("false") is True: a string would silently turn strict mode on.
        raise StructuredOutputError("response_format.json_schema.strict must be true or false "
                                    f"(or be dropped), got {reprlib.repr(strict)}")
    _check_enforceable(schema, "#")
    return schema, bool(strict)


def check_parameters_schema(parameters, where: str) -> None:
    """Raise StructuredOutputError for a forced tool's `parameters` schema the grammar would
    not enforce (the same rules as a response_format's schema)."""
    try:
        _check_enforceable(parameters, "#")
    except StructuredOutputError as err:
        raise StructuredOutputError(f"{where}: {err}") from None


# Keywords that assert something of a value: beside $ref or anyOf/oneOf/allOf the grammar
# drops them. Any other key there (title, description, default, pydantic's discriminator, an
# x-* extension) asserts nothing and is left alone.
_ASSERTIONS = {"type", "enum", "const", "properties", "required", "additionalProperties",
               "patternProperties", "propertyNames", "minProperties", "maxProperties", "items",
               "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
               "contains", "minContains", "maxContains", "minLength", "maxLength", "pattern",
               "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
               "multipleOf", "not", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "$ref",
               "anyOf", "oneOf", "allOf"}
UNENFORCED_MAX_LENGTH = 256
"""A maxLength at least this long beside a `format` is accepted unenforced (pydantic's HttpUrl
says 2,083): the formats' strings (URLs, e-mail addresses, dates, ids) stay far shorter."""
_COMBINATORS = ("anyOf", "oneOf", "allOf")
# Keywords the grammar enforces only where the node names its "type".
_TYPED_KEYWORDS = {"minLength", "maxLength", "pattern", "minimum", "maximum",
                   "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems"}
# `format` values the grammar builds a string grammar for; beside one of them (or a pattern),
# minLength / maxLength are not enforced, and a pattern beside such a format is not either.
_GRAMMAR_FORMATS = {"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6",
                    "hostname", "uri", "uri-reference", "uri-template", "json-pointer",
                    "relative-json-pointer"}


def _length_implied(key: str, value, fmt: str | None, schema: dict) -> bool:
    """A length bound beside a format or pattern that holds anyway: minLength 1 where the
    string cannot be empty (a format's, or a pattern that does not match ""), a maxLength of
    UNENFORCED_MAX_LENGTH or more beside a format."""
    if not isinstance(value, int):
        return False
    if key == "minLength":
        if value <= 0:
            return True
        return value == 1 and (fmt is not None or _never_empty(schema.get("pattern")))
    return fmt is not None and "pattern" not in schema and value >= UNENFORCED_MAX_LENGTH


def _never_empty(pattern) -> bool:
    try:
        return isinstance(pattern, str) and re.search(pattern, "") is None
    except re.error:
        return False


def _check_node(schema: dict, path: str) -> None:
    """Combinations of keywords in one schema node of which the grammar silently keeps one."""
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise StructuredOutputError(f"$ref {ref!r} at {path}/$ref is not supported: only "
                                    "references into the schema itself (\"#/$defs/...\")")
    for key in ("anyOf", "oneOf", "type"):
        if schema.get(key) == []:
            raise StructuredOutputError(f"an empty {key} list at {path}/{key} accepts no value "
                                        "(JSON Schema needs at least one entry): list at least "
                                        f"one {'type' if key == 'type' else 'schema'}, or drop it")
    for head in ("$ref",) + _COMBINATORS:
        if head not in schema:
            continue
        others = sorted(k for k in schema if k != head and k in _ASSERTIONS
                        and not (k == "type" and head != "$ref"))
        if others:
            raise StructuredOutputError(
                f"{', '.join(others)} beside {head} at {path} is not supported (the grammar "
                f"would enforce only {head}): move {'them' if len(others) > 1 else 'it'} "
                f"into {'the referenced schema' if head == '$ref' else f'each {head} branch'}")
    # (a propertyNames schema is a string's: its pattern is enforced without a type)
    if ("type" not in schema and not {"enum", "const"} & schema.keys()
            and not path.endswith("/propertyNames")):
        untyped = sorted(_TYPED_KEYWORDS & schema.keys())
        if untyped:
            raise StructuredOutputError(f"{', '.join(untyped)} at {path} needs a \"type\" "
                                        "beside it to be enforced")
    fmt = schema.get("format") if schema.get("format") in _GRAMMAR_FORMATS else None
    lengths = sorted(k for k in ("minLength", "maxLength")
                     if k in schema and not _length_implied(k, schema[k], fmt, schema))
    if lengths and (fmt or "pattern" in schema):
        beside = f"format {fmt!r}" if fmt else "pattern"
        raise StructuredOutputError(f"{', '.join(lengths)} beside {beside} at {path} is not "
                                    "supported: write the length into the pattern instead")
    if fmt and "pattern" in schema:
        raise StructuredOutputError(f"pattern beside format {fmt!r} at {path} is not "
                                    "supported: keep one of them")
    _check_patterns(schema, path)
    _check_counts(schema, path)
    _check_integer_bounds(schema, path)
    if "enum" in schema or "const" in schema:
        _check_listed_values(schema, path)
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        declared = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in declared]
        if missing:
            raise StructuredOutputError(f"required {missing!r} at {path} not declared in "
                                        "properties is not supported: declare each required "
                                        "property")


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _check_counts(schema: dict, path: str) -> None:
    """Length and size bounds are non-negative integers in JSON Schema: the grammar engine
    takes a maxLength or minItems of -1 for no bound and fails on a minLength of -1 only
    when it compiles (a message of its C++ internals, where `validate` saw nothing)."""
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and not (isinstance(value, int) and not isinstance(value, bool)
                                  and value >= 0):
            raise StructuredOutputError(f"{key} at {path} must be a non-negative integer, got "
                                        f"{reprlib.repr(value)}")


def _check_patterns(schema: dict, path: str) -> None:
    """A pattern that matches a quote or a backslash: the grammar engine applies a pattern to
    the JSON text of the string, where both are escaped, so it would write them bare (invalid
    JSON) and never their escaped form. Refused, as for patternProperties' keys."""
    named = [(f"{path}/pattern", schema.get("pattern"))]
    keyed = schema.get("patternProperties")
    if isinstance(keyed, dict):
        named += [(f"{path}/patternProperties", key) for key in keyed]
    for where, pattern in named:
        if isinstance(pattern, str) and _matches_escaped(pattern):
            raise StructuredOutputError(
                f"pattern {pattern!r} at {where} matches a quote or a backslash, which JSON "
                "escapes inside a string: the grammar would write them unescaped (invalid "
                "JSON); reword the pattern without them")


_ESCAPED_CODES = re.compile(r"(?i)(?:u00(?:22|5c)|x(?:22|5c))")
"""A regex escape (after its backslash) naming a quote or a backslash by its code."""


def _matches_escaped(pattern: str) -> bool:
    """Whether `pattern` holds a literal quote or backslash (`"`, `\\\\`, `\\x22`, ...)."""
    if '"' in pattern:
        return True
    i = pattern.find("\\")
    while i != -1 and i + 1 < len(pattern):
        if pattern[i + 1] == "\\" or _ESCAPED_CODES.match(pattern, i + 1):
            return True
        i = pattern.find("\\", i + 2)
    return False


INT64_RANGE = (-(1 << 63), (1 << 63) - 1)
"""The integers the grammar engine bounds: an "integer" node's bounds must lie within them."""


def _check_integer_bounds(schema: dict, path: str) -> None:
    """The bounds of an "integer" node beyond 64-bit integers, which the grammar engine
    refuses with its internal check's text."""
    if "integer" not in (_declared_types(schema) or []):
        return
    low, high = INT64_RANGE
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = schema.get(key)
        if _is_type(bound, "number") and not low <= bound <= high:
            raise StructuredOutputError(
                f"{key} {bound!r} at {path} is beyond the 64-bit integers ({low} to {high}) "
                "that an \"integer\" bound may be: give a bound within them, or drop it")


def _check_listed_values(schema: dict, path: str) -> None:
    """`enum` / `const` beside other keywords: the grammar generates the listed values as they
    are, so a value the keywords beside it refuse (a `maxLength`, a `pattern`, a `type`, a
    bound) would be generated unchecked."""
    listed = [("enum", v) for v in schema["enum"]] if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        listed.append(("const", schema["const"]))
    for key, value in listed:
        failed = _refusing_keyword(schema, value)
        if failed is not None:
            raise StructuredOutputError(
                f"{key} value {reprlib.repr(value)} at {path} does not satisfy {failed} "
                "beside it (the grammar generates the listed values as they are): drop the "
                f"value or {failed}")


_JSON_TYPES = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}


def _declared_types(schema: dict) -> list | None:
    """A node's `type` as a list of names (None when it declares none)."""
    types = schema.get("type")
    return [types] if isinstance(types, str) else types if isinstance(types, list) else None


def _is_type(value, name) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "number":
        return number
    if name == "integer":
        return number and (isinstance(value, int) or value.is_integer())
    kind = _JSON_TYPES.get(name)
    return kind is None or isinstance(value, kind)


def _refusing_keyword(schema: dict, value) -> str | None:
    """The first of the scalar keywords of `schema` (type, string lengths and pattern, number
    bounds) that `value` does not satisfy, or None."""
    types = _declared_types(schema)
    if types is not None and not any(_is_type(value, t) for t in types):
        return "type"
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            return "minLength"
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            return "maxLength"
        try:
            if isinstance(schema.get("pattern"), str) and not re.search(schema["pattern"], value):
                return "pattern"
        except re.error:
            pass  # a dialect Python does not read: left to the grammar engine
    elif _is_type(value, "number"):
        bounds = {"minimum": lambda b: value >= b, "maximum": lambda b: value <= b,
                  "exclusiveMinimum": lambda b: value > b, "exclusiveMaximum": lambda b: value < b}
        for key, holds in bounds.items():
            bound = schema.get(key)
            if _is_type(bound, "number") and not holds(bound):
                return key
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0 and _is_type(value, "integer") and value % step:
            return "multipleOf"
    return None


def _check_enforceable(schema, path: str) -> None:
    """Raise for keywords the grammar would silently ignore, naming where they are."""
    if not isinstance(schema, dict):
        return  # boolean subschemas are fine
    _check_node(schema, path)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _UNENFORCED and not _is_permissive(key, value):
            raise StructuredOutputError(f"JSON schema keyword {key!r} at {where} is not supported")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise StructuredOutputError(f"allOf with several schemas at {where} is not supported")
        if key == "multipleOf":
            _check_integer_step(schema, value, where)
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


MAX_INTEGER_STEP = 1024
"""The largest `multipleOf` the grammar engine enforces (past it, it warns and drops it)."""


def _check_integer_step(schema: dict, step, where: str) -> None:
    """`multipleOf` is enforced on an "integer" node only, and only as a whole step of at most
    MAX_INTEGER_STEP: on numbers, or with a step such as 0.5 or 5000, the grammar engine warns
    and drops it (a step of 0 or less it refuses itself)."""
    if schema.get("type") != "integer":
        raise StructuredOutputError(f"multipleOf at {where} is supported with \"type\": "
                                    "\"integer\" only")
    if _is_type(step, "integer") and step > MAX_INTEGER_STEP:
        raise StructuredOutputError(f"multipleOf {step!r} at {where} is not supported: the "
                                    f"largest step enforced is {MAX_INTEGER_STEP}")
    if _is_type(step, "number") and step > 0 and not _is_type(step, "integer"):
        raise StructuredOutputError(f"multipleOf {step!r} at {where} is not supported on an "
                                    "\"integer\": give a whole step (an integer >= 1)")


def _is_permissive(key: str, value) -> bool:
    """A keyword value that constrains nothing, e.g. ``additionalItems: true``."""
    if key == "uniqueItems":
        return value is False
    if key == "not":  # not: false excludes nothing; not: true / {} excludes everything
        return value is False
    if key == "contains":  # contains: true / {} still needs one item
        return False
    return value is True or value == {}
