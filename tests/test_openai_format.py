"""The OpenAI batch format to the letter: forced tool calls (tool_choice), templates that cannot
render tools, stream mode, error objects' code/message/param, URLs refused as paths."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.io.intake import IntakeError, ParsedRequest, PendingRequest, intake, parse_record
from batchgen.io.locations import refuse_urls, url_scheme
from batchgen.io.parsers import parse_tool_calls
from batchgen.io.reader import InputFileError, RawRecord
from batchgen.io.results import error_line
from batchgen.engine.tool_choice import ToolChoiceError, forced_functions, tool_call_grammar
from batchgen.models.factory import load_model, load_tokenizer, model_folder
from batchgen.runner.worker.grammars import Grammars
from engine_utils import make_engine
from job_utils import batchgen, read_jsonl, write_jsonl

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def smol():
    return load_model(ModelConfig(), torch.device("cpu"))


@pytest.fixture(scope="module")
def tools_tokenizer():
    """SmolLM2's tokenizer with a template that renders tools (its own ignores them)."""
    tokenizer = load_tokenizer(model_folder(ModelConfig())[0])
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def line(body, custom_id="c1", url="/v1/chat/completions"):
    return RawRecord(1, {"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_stream_true_is_a_400_line_error_naming_stream(tools_tokenizer):
    err = intake(line({"messages": USER, "stream": True}), tools_tokenizer, 512)
    assert isinstance(err, IntakeError) and err.param == "stream"
    assert "must not be sent in stream mode" in err.message
    body = error_line("b", err)["response"]
    assert body["status_code"] == 400 and body["body"]["error"]["param"] == "stream"
    ok = intake(line({"messages": USER, "stream": False}), tools_tokenizer, 512)
    assert isinstance(ok, PendingRequest)


@pytest.mark.parametrize("stream, shown", [("false", "got str 'false'"), (0, "got int 0"),
                                           ("true", "got str 'true'")])
def test_stream_not_a_boolean_says_it_must_be_the_boolean_false(stream, shown):
    err = parse_record(line({"messages": USER, "stream": stream}))
    assert isinstance(err, IntakeError) and err.param == "stream"
    assert "stream must be the boolean false (or be dropped), " + shown in err.message, err
    assert "set it to false" not in err.message
    assert isinstance(parse_record(line({"messages": USER, "stream": None})), ParsedRequest)


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 2.0}, "top_p"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"messages": USER, "logprobs": 3}, "logprobs"),
    ({"messages": USER, "stop": list("abcdefghijklmnopq")}, "stop"),
    ({"prompt": "y" * 512 * 128 + "y"}, "prompt"),
    ({"messages": [{"role": "user", "content": "y" * 512 * 128}]}, "messages"),
    ({"messages": USER, "url": "/v1/completions"}, "prompt"),
    ({"prompt": "hi", "url": "/v1/chat/completions"}, "messages"),
])
def test_error_objects_carry_code_message_and_param(tools_tokenizer, body, param):
    """Each error names the field at fault: also the stop list past its limit, a text too long
    to tokenize and a body sent to the other url (chat's messages at /v1/completions)."""
    body = dict(body)
    url = body.pop("url", "/v1/completions" if "prompt" in body else "/v1/chat/completions")
    err = intake(line(body, url=url), tools_tokenizer, 512)
    assert isinstance(err, IntakeError), err
    error = error_line("b", err)["response"]["body"]["error"]
    assert error["param"] == param and error["code"] and error["message"]


def test_url_and_method_errors_name_their_field(tools_tokenizer):
    err = intake(line({"messages": USER}, url="/v1/responses"), tools_tokenizer, 512)
    assert err.code == "unsupported_url" and err.param == "url"


def test_a_template_that_cannot_render_tools_is_a_line_error(smol, tools_tokenizer):
    body = {"messages": USER, "tools": [WEATHER]}
    err = intake(line(body), smol.tokenizer, 2048)  # SmolLM2's own template ignores tools
    assert isinstance(err, IntakeError) and err.code == "unsupported_tools"
    assert err.param == "tools"
    ok = intake(line(body), tools_tokenizer, 2048)
    assert isinstance(ok, PendingRequest)
    assert isinstance(intake(line({"messages": USER}), smol.tokenizer, 2048), PendingRequest)


def test_forced_functions_reads_tool_choice():
    assert forced_functions([WEATHER], "auto") is None
    assert forced_functions([WEATHER], "none") is None
    assert forced_functions([WEATHER], None) is None
    assert [f["name"] for f in forced_functions([WEATHER, TIME], "required")] == [
        "get_weather", "get_time"]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert [f["name"] for f in forced_functions([WEATHER, TIME], named)] == ["get_time"]
    with pytest.raises(ToolChoiceError, match="not in tools"):
        forced_functions([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolChoiceError, match="non-empty tools"):
        forced_functions(None, "required")
    with pytest.raises(ToolChoiceError, match="tool_choice must be"):
        forced_functions([WEATHER], "always")


def test_formats_that_cannot_be_forced_are_refused():
    functions = forced_functions([WEATHER], "required")
    with pytest.raises(ToolChoiceError, match="harmony"):
        tool_call_grammar(functions, "harmony")
    with pytest.raises(ToolChoiceError, match="no tool-call format"):
        tool_call_grammar(functions, None)


def _pending(tokenizer, tool_choice, tools=(WEATHER, TIME), **body) -> PendingRequest:
    item = intake(line({"messages": USER, "tools": list(tools), "tool_choice": tool_choice,
                        "max_tokens": 300, "temperature": 0.9, **body}), tokenizer, 2048)
    assert isinstance(item, PendingRequest), item
    return item


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "deepseek_v3"])
def test_forced_tool_choice_yields_a_parsable_call(smol, tools_tokenizer, parser):
    grammars = Grammars(smol.tokenizer, smol.hf_config.vocab_size, smol.eos_token_ids, parser)
    engine = make_engine(smol.model, smol.tokenizer, smol.eos_token_ids, device_gb=0.3,
                         host_gb=0.3)
    named = {"type": "function", "function": {"name": "get_time"}}
    choices = ["required", "required", named, named]
    requests = []
    for i, choice in enumerate(choices):
        request = grammars.request(_pending(tools_tokenizer, choice, seed=i))
        request.request_id = f"r{i}"
        requests.append(request)
    for choice, result in zip(choices, engine.generate(requests)):
        completion = result.completions[0]
        assert completion.finish_reason.value == "stop", completion.text
        content, calls = parse_tool_calls(completion.text, parser)
        assert len(calls) == 1, completion.text
        function = calls[0]["function"]
        if choice == named:
            assert function["name"] == "get_time"
        arguments = json.loads(function["arguments"])
        expected = {"get_weather": {"city", "days"}, "get_time": {"zone"}}[function["name"]]
        assert set(arguments) == expected


ORDER = {"type": "function", "function": {"name": "add_item", "parameters": {  # pydantic's shape
    "$defs": {"Item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
    "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_calls_take_refs_and_functions_without_parameters(smol, tools_tokenizer, parser):
    """A parameters schema with `$defs` and `$ref`s (as pydantic writes one) is enforced as
    it reads, not against the call's wrapper; a function without parameters is called with
    `{}`, OpenAI's empty parameter list."""
    grammars = Grammars(smol.tokenizer, smol.hf_config.vocab_size, smol.eos_token_ids, parser)
    engine = make_engine(smol.model, smol.tokenizer, smol.eos_token_ids, device_gb=0.3,
                         host_gb=0.3)
    requests = []
    for i, tool in enumerate([ORDER, NOW, NOW]):
        request = grammars.request(_pending(tools_tokenizer, "required", tools=[tool], seed=i))
        assert not isinstance(request, IntakeError), request
        request.request_id = f"r{i}"
        requests.append(request)
    results = [r.completions[0] for r in engine.generate(requests)]
    _, calls = parse_tool_calls(results[0].text, parser)
    item = json.loads(calls[0]["function"]["arguments"])["item"]
    assert set(item) == {"sku", "qty"} and len(item["sku"]) == 3 and 1 <= item["qty"] <= 5
    for result in results[1:]:
        _, calls = parse_tool_calls(result.text, parser)
        assert calls[0]["function"]["name"] == "now"
        assert calls[0]["function"]["arguments"] == "{}", result.text


def test_a_parameters_schema_the_compiler_refuses_names_tools(smol, tools_tokenizer):
    """A schema error found only when compiling (a broken regex) is an error line naming
    `tools`, with xgrammar's reason and none of its log prefix."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}
    grammars = Grammars(smol.tokenizer, smol.hf_config.vocab_size, smol.eos_token_ids, "hermes")
    err = grammars.request(_pending(tools_tokenizer, "required", tools=[bad]))
    assert isinstance(err, IntakeError) and err.code == "invalid_tool_choice"
    assert err.param == "tools" and ".cc:" not in err.message
    assert err.message.startswith("line 1: tools: a parameters schema cannot be enforced: Regex")


def _key_order_format(*names):
    properties = {name: {"type": "boolean"} for name in names}
    return {"type": "json_schema", "json_schema": {"name": "flags", "strict": True, "schema": {
        "type": "object", "properties": properties, "required": sorted(names),
        "additionalProperties": False}}}


def _accepts(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_each_lines_schema_keeps_its_own_property_order(tools_tokenizer):
    """Properties are generated in the order a schema lists them: a line listing them in
    another order than an earlier line's identical schema gets its own order, whichever line
    the worker compiled first (a resume may take them in another order)."""
    grammars = Grammars(tools_tokenizer, len(tools_tokenizer), [tools_tokenizer.eos_token_id])
    pending = intake(line({"messages": USER}), tools_tokenizer, 2048)
    for first, second in [("alpha", "beta"), ("beta", "alpha")]:
        item = dataclasses.replace(
            pending, extra={"response_format": _key_order_format(first, second)})
        grammar = grammars.request(item).grammar
        assert _accepts(grammar, tools_tokenizer, f'{{"{first}": true, "{second}": false}}')
        assert not _accepts(grammar, tools_tokenizer, f'{{"{second}": true, "{first}": false}}')


def test_free_text_without_a_forced_choice_and_conflicts_are_errors(smol, tools_tokenizer):
    grammars = Grammars(smol.tokenizer, smol.hf_config.vocab_size, smol.eos_token_ids, "hermes")
    assert grammars.request(_pending(tools_tokenizer, "auto")).grammar is None
    both = intake(line({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
                        "response_format": {"type": "json_object"}}), tools_tokenizer, 2048)
    assert isinstance(both, IntakeError) and both.param == "tool_choice"  # refused at intake
    unnamed = intake(line({"messages": USER, "tools": [WEATHER, TIME],  # refused at intake
                           "tool_choice": {"type": "function", "function": {"name": "x"}}}),
                     tools_tokenizer, 2048)
    assert isinstance(unnamed, IntakeError) and "not in tools" in unnamed.message
    assert unnamed.param == "tool_choice" and unnamed.code == "invalid_tool_choice"
    harmony = Grammars(smol.tokenizer, smol.hf_config.vocab_size, smol.eos_token_ids, "harmony")
    assert isinstance(harmony.request(_pending(tools_tokenizer, "required")), IntakeError)


@pytest.mark.parametrize("value, scheme", [
    ("https://example.com/out.jsonl", "https"), ("http://x/y", "http"),
    ("s3://bucket/key.jsonl", "s3"), ("gs://bucket/in.jsonl", "gs"), ("hf://datasets/a/b", "hf"),
    ("https:/example.com/out.jsonl", "https"),  # a path library collapsed the "//"
    ("out/results.jsonl", None), ("/abs/https/x.jsonl", None), ("c:x", None),
])
def test_url_schemes_are_recognised(value, scheme):
    assert url_scheme(value) == scheme


def test_refuse_urls_says_what_is_supported():
    with pytest.raises(InputFileError, match="--output 'https://example.com/o.jsonl' is an "
                                             "https:// URL.*local or mounted.*hf upload"):
        refuse_urls(input="in.jsonl", output="https://example.com/o.jsonl")
    with pytest.raises(InputFileError, match="--input 'gs://b/in.jsonl' is a gs:// URL.*"
                                             "download the file first"):
        refuse_urls(input="gs://b/in.jsonl", output="out.jsonl")
    refuse_urls(input="in.jsonl", output=None)


@pytest.mark.parametrize("flag, value", [("--output", "https://example.com/out.jsonl"),
                                         ("--input", "s3://bucket/in.jsonl"),
                                         ("--input", "http://example.com/in.jsonl"),
                                         ("--input", "hf://datasets/org/jobs/in.jsonl")])
def test_run_refuses_urls_before_any_work(tmp_path, flag, value):
    rows = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    args = {"--input": rows, "--output": tmp_path / "out.jsonl", flag: value}
    proc = batchgen("run", *[str(a) for kv in args.items() for a in kv],
                    "--storage-path", tmp_path / "s")
    assert proc.returncode == 2
    assert "URL" in proc.stderr and "not supported" in proc.stderr
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob("http*"))
    assert read_jsonl(rows)  # the input is untouched
    proc = batchgen("validate", "--input", "gs://bucket/in.jsonl")
    assert proc.returncode == 2 and "'gs://bucket/in.jsonl' is a gs:// URL" in proc.stderr
    proc = batchgen("status", "s3://bucket/out.jsonl")
    assert proc.returncode == 2 and "'s3://bucket/out.jsonl' is a URL" in proc.stderr


def test_a_job_forces_tool_calls_without_parse_flags(tiny_chat_model, tmp_path):
    """Default flags (no --parse-tool-call): a forced call is generated in the model's format
    (llama3_json for this Llama) and answered as tool_calls; free lines stay text."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    named = {"type": "function", "function": {"name": "get_time"}}
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice,
                      "max_tokens": 300, "temperature": 0.8, "seed": i}}
            for i, choice in enumerate(["required", named])]
    rows.append({"custom_id": "s", "messages": USER, "stream": True})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    batchgen("run", "--input", inp, "--model", model, "--storage-path", tmp_path / "s",
             "--output", out, "--device", "cpu", check=True)
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    for custom_id in ("t0", "t1"):
        choice = results[custom_id]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert set(json.loads(call["arguments"])) == (
            {"zone"} if call["name"] == "get_time" else {"city", "days"})
    assert results["t1"]["response"]["body"]["choices"][0]["message"]["tool_calls"][0][
        "function"]["name"] == "get_time"
    error = read_jsonl(out.with_name("out.errors.jsonl"))[0]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "stream"
