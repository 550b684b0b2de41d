"""Schemas the grammar engine (xgrammar) would only partly enforce are refused per line, for
response_format and for the parameters of a tool a tool_choice forces; a forced call whose
string argument holds "</tool_call>" is still parsed. Model-free and fast."""

import json

import pytest

from batchgen.engine.structured import schema_problem
from batchgen.io.intake import IntakeError, ParsedRequest, parse_record
from batchgen.io.parsers import parse_output
from batchgen.io.reader import RawRecord

USER = [{"role": "user", "content": "hi"}]


def rf(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def parse(**body):
    return parse_record(RawRecord(1, {"messages": USER, **body}))


def S(**kw):
    return {"type": "object", "properties": {"a": kw}, "required": ["a"],
            "additionalProperties": False}


# Each of these compiled, and the grammar then matched a value the schema forbids (noted).
DROPPED = {
    "pattern+maxLength": S(type="string", pattern="^[a-z]+$", maxLength=3),  # "abcdef"
    "format+maxLength": S(type="string", format="email", maxLength=5),  # "abcdef@ex.com"
    "format+pattern": S(type="string", format="uuid", pattern="^0"),  # "1111...-1111"
    "ref+sibling": {"$defs": {"S": {"type": "string"}}, **S(**{"$ref": "#/$defs/S",
                                                              "maxLength": 3})},
    "anyOf+sibling": {"type": "object", "properties": {"a": {"type": "string"}},
                      "anyOf": [{"required": ["a"]}]},  # {}
    "untyped minimum": S(minimum=5),  # 3
    "external ref": S(**{"$ref": "https://example.com/s.json"}),  # anything
    "required undeclared": {"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a", "b"]},  # {"a": 1}
    "not {}": S(type="integer", **{"not": {}}),  # 1 (not {} excludes every value)
    "format+short maxLength": S(type="string", format="uri", maxLength=20),
    "pattern+minLength 1, empty allowed": S(type="string", pattern="^[a-z]*$", minLength=1),
    # enum / const values are generated as listed, whatever the keywords beside them say
    "enum+maxLength": S(type="string", enum=["abc", "x"], maxLength=2),  # "abc"
    "enum+pattern": S(type="string", enum=["abc", "x"], pattern="^a"),  # "x"
    "enum+type": S(type="string", enum=["a", 1]),  # 1
    "const+maximum": S(type="integer", const=50, maximum=10),  # 50
    # integer steps the grammar engine warns about and drops
    "integer multipleOf 0.5": S(type="integer", multipleOf=0.5),  # -93
    "integer multipleOf past 1024": S(type="integer", multipleOf=2048),  # -93
    # empty lists no value satisfies, which the grammar read as "anything" (or nothing)
    "empty anyOf": S(anyOf=[]),  # "" (no JSON at all) at the root
    "empty oneOf": S(oneOf=[]),
    "empty type list": S(type=[]),  # any value
}


@pytest.mark.parametrize("name", sorted(DROPPED))
def test_response_format_keywords_the_grammar_would_drop_are_refused(name):
    parsed = parse(response_format=rf(DROPPED[name]))
    assert isinstance(parsed, IntakeError), name
    assert (parsed.code, parsed.param) == ("unsupported_response_format", "response_format")
    assert parsed.message.startswith("line 1: response_format: "), parsed.message


def test_keywords_the_grammar_would_drop_are_refused():
    assert schema_problem(rf(DROPPED["pattern+maxLength"])) is not None


ACCEPTED = {  # what pydantic's model_json_schema() and OpenAI's examples write
    "ref+annotations": {"$defs": {"S": {"type": "integer"}},
                        **S(**{"$ref": "#/$defs/S", "description": "d", "default": 1})},
    "nullable anyOf": S(anyOf=[{"type": "integer", "minimum": 0}, {"type": "null"}],
                        default=None, title="A"),
    "root ref": {"$defs": {"N": {"type": "object", "properties": {"v": {"type": "integer"}},
                                 "required": ["v"]}}, "$ref": "#/$defs/N"},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "unknown format + maxLength": S(type="string", format="phone", maxLength=3),
    "not false": S(type="integer", **{"not": False}),
    # pydantic's model_json_schema(): a discriminated union, HttpUrl, Optional[AnyUrl],
    # json_schema_extra beside a $ref, constr(pattern=..., min_length=1)
    "discriminated union": {"$defs": {"C": {"type": "object", "properties": {
        "kind": {"const": "cat", "type": "string"}}, "required": ["kind"]}, "D": {
        "type": "object", "properties": {"kind": {"const": "dog", "type": "string"}},
        "required": ["kind"]}}, **S(oneOf=[{"$ref": "#/$defs/C"}, {"$ref": "#/$defs/D"}],
                                    discriminator={"propertyName": "kind", "mapping": {
                                        "cat": "#/$defs/C", "dog": "#/$defs/D"}},
                                    title="Pet")},
    "HttpUrl": S(type="string", format="uri", minLength=1, maxLength=2083, title="Url"),
    "Optional[AnyUrl]": S(anyOf=[{"type": "string", "format": "uri", "minLength": 1},
                                 {"type": "null"}], default=None),
    "ref + x-order": {"$defs": {"T": {"type": "integer"}},
                      **S(**{"$ref": "#/$defs/T", "description": "d", "x-order": 1})},
    "pattern + minLength 1": S(type="string", pattern="^[A-Z]+$", minLength=1),
    "Literal": S(const="cat", type="string"),
    "Optional enum": S(enum=["a", None], type=["string", "null"]),
    "enum within its bounds": S(type="string", enum=["ab", "cd"], minLength=2, maxLength=2),
    "enum matching its pattern": S(type="string", enum=["ab", "ac"], pattern="^a"),
    "IntEnum with bounds": S(type="integer", enum=[1, 2.0, 3], minimum=1, maximum=3),
    "integer multipleOf 1024": S(type="integer", multipleOf=1024),
    "integer multipleOf 2.0": S(type="integer", multipleOf=2.0),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_schemas_users_write_are_accepted(name):
    assert isinstance(parse(response_format=rf(ACCEPTED[name])), ParsedRequest), name
    assert schema_problem(rf(ACCEPTED[name])) is None


@pytest.mark.parametrize("key, bound", [("minimum", -1e20), ("maximum", 1e20),
                                        ("maximum", 2**63), ("exclusiveMinimum", -2**63 - 1)])
@pytest.mark.parametrize("kind", ["integer", ["integer", "null"]])
def test_integer_bounds_beyond_64_bits_are_refused_by_name(key, bound, kind):
    parsed = parse(response_format=rf(S(type=kind, **{key: bound})))
    assert isinstance(parsed, IntakeError) and parsed.code == "unsupported_response_format"
    assert f"{key} {bound!r} at #/properties/a is beyond the 64-bit integers" in parsed.message
    assert "Check failed" not in parsed.message


@pytest.mark.parametrize("schema", [S(type="integer", minimum=-2**63, maximum=2**63 - 1),
                                    S(type="integer", exclusiveMaximum=2**63 - 1),
                                    S(type="number", minimum=-1e20, maximum=1e300)])
def test_bounds_the_grammar_engine_takes_are_accepted(schema):
    assert isinstance(parse(response_format=rf(schema)), ParsedRequest)
    assert schema_problem(rf(schema)) is None


def tool(parameters):
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("parameters", [
    S(type="array", items={"type": "string"}, uniqueItems=True),  # duplicates were generated
    S(type="number", multipleOf=0.5),  # -67667652.526 was generated
    S(type="string", pattern="(" * 50_000 + "a" + ")" * 50_000),  # segfaulted the worker
])
def test_forced_tool_parameters_get_the_response_format_checks(parameters):
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        parsed = parse(tools=tool(parameters), tool_choice=choice)
        assert isinstance(parsed, IntakeError)
        assert (parsed.code, parsed.param) == ("invalid_tool_choice", "tools")
    # a call the model is free to make is not built into a grammar: no refusal
    assert isinstance(parse(tools=tool(parameters), tool_choice="auto"), ParsedRequest)


@pytest.mark.parametrize("parameters", [[], "", 0, False, "{}"])
def test_tool_parameters_that_are_not_a_schema_are_refused(parameters):
    """An empty list or string was read as "no parameters" and the call forced to `{}`, while a
    non-empty string was refused: anything but a schema object (or `{}` / absent) is refused."""
    parsed = parse(tools=tool(parameters))
    assert isinstance(parsed, IntakeError)
    assert (parsed.code, parsed.param) == ("invalid_tools", "tools")
    assert "tools[0].function.parameters must be a JSON schema object" in parsed.message
    for none in ({}, None):
        assert isinstance(parse(tools=tool(none), tool_choice="required"), ParsedRequest)


def test_forced_hermes_call_with_a_closing_tag_in_a_string_is_parsed():
    arguments = {"code": "print('</tool_call>')"}
    text = ("<tool_call>\n" + json.dumps({"name": "f", "arguments": arguments})
            + "\n</tool_call>")
    message = parse_output(text, reasoning_style=None, tool_parser="hermes")
    assert message.content is None
    assert [json.loads(c["function"]["arguments"]) for c in message.tool_calls] == [arguments]


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"response_format": rf(S(type="string"))},
    {"tools": tool({"type": "object", "properties": {}}), "tool_choice": "required"},
])
def test_stop_strings_do_not_cut_a_grammar_constrained_answer(body):
    """A stop inside the JSON left it cut and invalid, with finish_reason "stop": such an
    answer ends where its grammar does; a free answer keeps its stops."""
    parsed = parse(stop=["\n", ","], stop_token_ids=[5], **body)
    assert isinstance(parsed, ParsedRequest)
    assert parsed.sampling.stop == () and parsed.sampling.stop_token_ids == ()
    free = parse(stop=["\n", ","], stop_token_ids=[5])
    assert free.sampling.stop == ("\n", ",") and free.sampling.stop_token_ids == (5,)


@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "f"}}])
def test_a_tool_choice_without_tools_is_refused(tools, choice):
    """OpenAI refuses a tool_choice given without tools ("tool_choice is only allowed when
    tools are specified"); "auto" was accepted silently. "none" chooses nothing: it passes."""
    parsed = parse(tools=tools, tool_choice=choice)
    assert isinstance(parsed, IntakeError), parsed
    assert (parsed.code, parsed.param) == ("invalid_tool_choice", "tool_choice")
    assert "only allowed when tools are specified" in parsed.message
    assert "give tools, or drop tool_choice" in parsed.message
    assert isinstance(parse(tools=tools, tool_choice="none"), ParsedRequest)


@pytest.mark.parametrize("parameters, said", [
    ({"type": "string"}, '"string"'),
    ({"type": "array", "items": {"type": "integer"}}, '"array"'),
    ({"type": ["object", "null"]}, '["object", "null"]'),
])
def test_tool_parameters_of_a_type_other_than_object_are_refused(parameters, said):
    """A forced call to `{"type": "array"}` parameters came back as text (`"arguments": []` is
    no call a parser reads), without tool_calls: OpenAI refuses such a schema, and so does the
    line, whatever its tool_choice."""
    for choice in ("required", "auto", None):
        parsed = parse(tools=tool(parameters), tool_choice=choice)
        assert isinstance(parsed, IntakeError), parsed
        assert (parsed.code, parsed.param) == ("invalid_tools", "tools")
        assert 'must be a schema of "type": "object"' in parsed.message
        assert f'got "type": {said}' in parsed.message
    for fine in ({"type": "object"}, {"properties": {"a": {"type": "string"}}}):
        assert isinstance(parse(tools=tool(fine), tool_choice="required"), ParsedRequest)


@pytest.mark.parametrize("tools, says", [
    ([{"type": "retrieval", "function": {"name": "f", "parameters": {}}}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "", "parameters": {}}}], "non-empty name"),
    ([{"type": "function", "function": {"name": "f"}},
      {"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tools[1] repeats the function name 'f'"),
    ([{"type": "function", "function": {"name": "has space!"}}],
     "tools[0].function.name 'has space!' must be 1 to 64 letters, digits, underscores or "
     "dashes"),
    ([{"type": "function", "function": {"name": "f" * 65}}], "must be 1 to 64 letters"),
])
def test_tools_of_another_kind_without_a_name_or_named_twice_are_refused(tools, says):
    """A call names the tool it calls: a name given twice left the forced call's grammar free to
    take either schema, an empty one names nothing, and a tool of another type is no function."""
    parsed = parse(tools=tools, tool_choice="required")
    assert isinstance(parsed, IntakeError) and parsed.code == "invalid_tools", parsed
    assert says in parsed.message
    assert isinstance(parse(tools=[{"function": {"name": "f"}}], tool_choice="required"),
                      ParsedRequest)  # "type" left out: a function, as before


@pytest.mark.parametrize("pattern", ['^say "[a-z]{2}"$', r"^C:\\[a-z]{3}$", r"^\\frac\{\d\}$",
                                     r"^a[\\]b$", r"^a\u0022b$", r"^a\x5Cb$", r'^["x]+$'])
def test_a_pattern_matching_a_quote_or_a_backslash_is_refused(pattern):
    """The grammar applies a pattern to the string's JSON text, where quotes and backslashes
    are escaped: it wrote `{"s": "say "ab""}` (invalid JSON, finish_reason stop) and
    `"C:\\gel"` (a JSON escape \\g), and never the escaped forms."""
    for schema in (S(type="string", pattern=pattern),
                   {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}):
        parsed = parse(response_format=rf(schema))
        assert isinstance(parsed, IntakeError) and parsed.code == "unsupported_response_format"
        assert f"pattern {pattern!r} at #" in parsed.message, parsed.message
        assert "matches a quote or a backslash" in parsed.message
    tool = {"type": "function", "function": {"name": "f", "parameters": S(type="string",
                                                                          pattern=pattern)}}
    forced = parse(tools=[tool], tool_choice="required")
    assert isinstance(forced, IntakeError) and "matches a quote or a backslash" in forced.message


@pytest.mark.parametrize("pattern", [r"^\d{3}-\d{4}$", r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$",
                                     r"^\w+( \w+)*$", r"^[A-Z]\.\s?$", r"^(?:\+|-)?\d+$"])
def test_patterns_users_write_are_accepted(pattern):
    assert isinstance(parse(response_format=rf(S(type="string", pattern=pattern))), ParsedRequest)


@pytest.mark.parametrize("schema, says", [
    (S(type="string", minLength=-1),
     "minLength at #/properties/a must be a non-negative integer, got -1"),
    (S(type="string", maxLength=-1), "maxLength at #/properties/a must be a non-negative integer"),
    (S(type="array", items=S(type="integer"), minItems=-1), "minItems at #/properties/a must be"),
    (S(type="string", minLength=2.0), "minLength at #/properties/a must be a non-negative "
                                      "integer, got 2.0"),
    (S(type="string", maxLength=True), "got True"),
])
def test_negative_or_fractional_length_bounds_are_refused_as_validate_refuses_them(schema, says):
    """The grammar engine took maxLength or minItems -1 for no bound, and a minLength of -1
    failed only when the worker compiled it (a C++ check's message; validate said valid)."""
    parsed = parse(response_format=rf(schema))
    assert isinstance(parsed, IntakeError) and parsed.code == "unsupported_response_format"
    assert says in parsed.message, parsed.message
    assert isinstance(parse(response_format=rf(S(type="string", minLength=0, maxLength=0))),
                      ParsedRequest)
