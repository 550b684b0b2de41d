"""Hostile input lines: each one is an error line naming its field (never a traceback that stops
the job), and `batchgen validate` refuses exactly what a job refuses."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli_help import run_app
from batchgen.io.intake import IntakeError, ParsedRequest, parse_record
from batchgen.io.reader import RawRecord, read_records

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def parse(data: dict, line: int = 3):
    return parse_record(RawRecord(line, data))


@pytest.mark.parametrize("function", ["get_weather", ["get_weather"], 5, None])
def test_a_named_tool_choice_whose_function_is_not_an_object_is_an_error_line(function):
    err = parse({"custom_id": "t", "messages": USER, "tools": [WEATHER],
                 "tool_choice": {"type": "function", "function": function}})
    assert isinstance(err, IntakeError), err
    assert err.code == "invalid_tool_choice" and err.param == "tool_choice"
    assert "line 3" in err.message and '{"name": ...}' in err.message


def test_a_forced_call_with_a_response_format_is_refused_at_intake():
    err = parse({"custom_id": "t", "messages": USER, "tools": [WEATHER],
                 "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert isinstance(err, IntakeError) and err.code == "invalid_tool_choice"
    ok = parse({"custom_id": "t", "messages": USER, "tools": [WEATHER],
                "tool_choice": "required", "response_format": {"type": "text"}})
    assert isinstance(ok, ParsedRequest)


BAD_SCHEMAS = [
    ({"type": "wat"}, "Unsupported type"),
    ({"$ref": "#/$defs/missing"}, "$defs"),
    ({"type": "string", "pattern": "[a-"}, "Unclosed"),
    ({"type": "object", "required": "a"}, "required must be an array"),
    ({"enum": []}, "enum"),
]


def _schema_line(cid: str, schema: dict) -> dict:
    return {"custom_id": cid, "messages": USER, "max_tokens": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def test_validate_refuses_the_schemas_the_grammar_compiler_refuses(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = [_schema_line(f"s{i}", schema) for i, (schema, _) in enumerate(BAD_SCHEMAS)]
    rows.append(_schema_line("good", {"type": "object",
                                      "properties": {"a": {"type": "integer"}}}))
    rows.append({"custom_id": "forced", "messages": USER, "tool_choice": "required",
                 "tools": [{"type": "function", "function": {
                     "name": "f", "parameters": {"type": "object",
                                                "properties": {"a": {"type": "wat"}}}}}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["validate", "-i", str(path)])
    assert result.exit_code == 1, result.output
    for i, (_, needle) in enumerate(BAD_SCHEMAS, start=1):
        [said] = [s for s in result.output.splitlines() if s.startswith(f"line {i}:")]
        assert "unsupported_response_format" in said and needle in said, said
    assert "line 7: invalid_tool_choice" in result.output
    assert f"{len(rows)} requests: 1 valid" in result.output


def test_validate_names_tools_for_a_forced_parameters_schema_the_compiler_refuses():
    """As the job's worker does: the schema at fault is in `tools`."""
    from batchgen.runner.leader.validate import grammar_checked

    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}
    err = grammar_checked(parse({"custom_id": "t", "messages": USER, "tools": [bad],
                                 "tool_choice": "required"}))
    assert isinstance(err, IntakeError) and err.code == "invalid_tool_choice"
    assert err.param == "tools" and "Unclosed '['" in err.message


def test_the_worker_refuses_the_same_schemas_with_the_same_message():
    from transformers import AutoTokenizer  # noqa: F401  (the engine needs a tokenizer)

    from batchgen.engine.structured import StructuredOutputError, schema_problem

    for schema, needle in BAD_SCHEMAS:
        problem = schema_problem({"type": "json_schema", "json_schema": {"schema": schema}})
        assert problem is not None and needle in problem
        assert problem.startswith("response_format: invalid JSON schema: ")
    assert schema_problem({"type": "json_object"}) is None
    assert issubclass(StructuredOutputError, ValueError)


def test_validate_reads_lines_as_long_as_the_job_does(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 100, "max_tokens": 1}) + "\n")
    default = CliRunner().invoke(app, ["validate", "-i", str(path)])
    assert default.exit_code == 0 and "1 valid" in default.output
    short = CliRunner().invoke(app, ["validate", "-i", str(path), "--max-line-bytes", "64"])
    assert short.exit_code == 1 and "line_too_long" in short.output


@pytest.mark.parametrize("encoding", [False, 0, "", []])
def test_an_embeddings_encoding_format_of_the_wrong_type_is_refused(encoding):
    err = parse({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                 "body": {"input": "x", "encoding_format": encoding}})
    assert isinstance(err, IntakeError) and err.param == "encoding_format"


def test_a_parquet_map_column_is_read_as_an_object(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "custom_id": ["lb"], "prompt": ["x"], "max_tokens": [2],
        "logit_bias": pa.array([[("42", 100.0)]], pa.map_(pa.string(), pa.float64()))}), path)
    [record] = read_records(path)
    parsed = parse_record(record)
    assert isinstance(parsed, ParsedRequest), parsed
    assert parsed.sampling.logit_bias == ((42, 100.0),)


def _app_raising(exc: BaseException) -> typer.Typer:
    bad = typer.Typer()

    @bad.command()
    def go() -> None:
        raise exc

    @bad.command()
    def other() -> None:
        pass

    return bad


def test_an_aborted_command_says_so_and_a_crash_keeps_its_own_traceback(capsys):
    assert run_app(_app_raising(EOFError()), ["go"]) == 130
    assert "aborted" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="boom"):
        run_app(_app_raising(RuntimeError("boom")), ["go"])


def test_a_line_whose_check_raises_unexpectedly_is_an_error_line_not_a_crash(monkeypatch):
    """A check that fails in a way nobody foresaw costs that line, never the job."""
    import batchgen.io.intake as intake

    def broken(*_args):
        raise AttributeError("'str' object has no attribute 'get'")

    monkeypatch.setattr(intake, "_check_structured", broken)
    err = parse({"custom_id": "t", "messages": USER})
    assert isinstance(err, IntakeError) and err.code == "invalid_request"
    assert "line 3" in err.message and "AttributeError" in err.message


@pytest.mark.parametrize("output", ["", "-", "  "])
def test_an_empty_or_stdout_output_is_refused_before_work(tmp_path, output):
    """`-o ''` would put the results under the state folder, `-o -` in a file named "-"."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "messages": USER}) + "\n")
    result = CliRunner().invoke(app, ["run", "-i", str(src), "-o", output])
    assert result.exit_code == 2, result.output
    assert "--output" in result.output and "standard output is not supported" in result.output


@pytest.mark.parametrize("key", ["4_2", " 42 ", "+42", "4.0", "٤٢", "-0", "-00"])
def test_logit_bias_keys_are_decimal_token_ids(key):
    err = parse({"custom_id": "t", "messages": USER, "logit_bias": {key: 5}})
    assert isinstance(err, IntakeError) and err.param == "logit_bias", err
    ok = parse({"custom_id": "t", "messages": USER, "logit_bias": {"42": 5}})
    assert isinstance(ok, ParsedRequest) and ok.sampling.logit_bias == ((42, 5.0),)


@pytest.mark.parametrize("field, value, names", [
    ("stop", ["x" * 100] * 5000, "stop holds at most 16 strings, got 5000 strings"),
    ("stop", ["y" * 100] * 3000 + [7], "stop[3000] must be a non-empty string, got int 7"),
    ("stop_token_ids", list(range(9000)) + [-1], "stop_token_ids[9000] must be a token id"),
    ("logit_bias", {**{str(i): 1 for i in range(9000)}, "77": 250}, "got {'77': 250}"),
    ("logit_bias", {**{str(i): 1 for i in range(9000)}, "77": "x"},
     "logit_bias['77'] must be a number in [-100, 100], got str 'x'"),
    ("temperature", "hot" * 10000, "temperature must be a number in [0, 100], got str 'hot"),
])
def test_a_huge_refused_value_is_named_not_echoed(field, value, names):
    """The error line names the entry at fault and quotes a bounded part of the value: a
    refused list of thousands of stop strings is not copied into the error message."""
    err = parse({"custom_id": "t", "messages": USER, field: value})
    assert isinstance(err, IntakeError) and err.param == field, err
    assert names in err.message and len(err.message) < 200, err.message


def _nested(depth: int) -> str:
    """JSON text of objects nested `depth` levels (json.dumps itself recurses per level)."""
    return '{"a": ' * depth + "1" + "}" * depth


DEEP_FIELDS = {  # fields no check recurses into, carried to the worker as they are
    "chat_template_kwargs": lambda deep: {"messages": USER, "chat_template_kwargs": {"x": deep}},
    "messages[0].extra": lambda deep: {"messages": [{**USER[0], "extra": deep}]},
    "messages[1].tool_calls": lambda deep: {"messages": [*USER, {
        "role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": deep}}]}]},
    "tools": lambda deep: {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}}]},
}


def test_a_field_nested_past_the_limit_is_an_error_line_not_a_crash_of_the_job(tmp_path):
    """Valid JSON 1,000 levels deep in a field no check walks passed intake, then stopped the
    job with a RecursionError (a traceback) when the supervisor pickled the parsed line."""
    from batchgen.io.field_values import MAX_FIELD_DEPTH
    from batchgen.io.parsed_input import parse_input, read_parsed
    from batchgen.io.reader import identify_input

    rows = [{"custom_id": name, **line("DEEP")} for name, line in DEEP_FIELDS.items()]
    rows.append({"custom_id": "stop", "messages": USER, "stop": "DEEP"})
    lines = [json.dumps(r).replace('"DEEP"', _nested(1000)) for r in rows]
    lines += [json.dumps({"custom_id": f"ok-{name}", **line("DEEP")}).replace(
        '"DEEP"', _nested(MAX_FIELD_DEPTH - 10)) for name, line in DEEP_FIELDS.items()]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    store = tmp_path / "job.requests"
    parse_input(identify_input(path), store, 1 << 20, 16)
    items = {r.key: r.item for r in read_parsed(store)}
    for name in DEEP_FIELDS:
        err = items[name]
        assert isinstance(err, IntakeError) and err.code == "invalid_request", err
        assert err.param == name and name in err.message and "flatten" in err.message
    err = items["stop"]  # refused for its type, quoted a few levels deep
    assert err.code == "invalid_sampling_param" and err.param == "stop", err
    assert "stop must be a string or a list" in err.message and len(err.message) < 200
    assert all(isinstance(items[f"ok-{name}"], ParsedRequest) for name in DEEP_FIELDS)
    result = CliRunner().invoke(app, ["validate", "-i", str(path)])
    assert f"{len(lines)} requests: {len(DEEP_FIELDS)} valid" in result.output, result.output


@pytest.mark.parametrize("body, said", [
    ("{'messages': [{'role': 'user', 'content': 'Hi'}]}", "single quotes"),
    ('{"messages": [}', "does not parse as JSON")])
def test_a_body_cell_that_is_not_json_says_why(tmp_path, body, said):
    """A body column written with str(dict) (Python's quotes) was refused as "body must be a
    JSON object", which it looked like."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"custom_id": ["a"], "method": ["POST"],
                             "url": ["/v1/chat/completions"], "body": [body]}), path)
    [record] = read_records(path)
    err = parse_record(record)
    assert isinstance(err, IntakeError) and err.param == "body" and said in err.message
    messages = parse({"custom_id": "m", "messages": "[{'role': 'user', 'content': 'Hi'}]"})
    assert isinstance(messages, IntakeError) and "single quotes" in messages.message
