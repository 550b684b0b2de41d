"""OpenAI request fields whose meaning batchgen must keep or refuse, never drop silently: echo,
suffix and best_of; tool_choice "none"; one prompt in the batched form; error values as the
line wrote them; JSON schema keywords the grammar would ignore."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from batchgen.config import OutputConfig
from batchgen.core import Completion, FinishedRequest, FinishReason, SamplingParams
from batchgen.io.intake import (IntakeError, ParsedRequest, PendingRequest, parse_record,
                                with_model_defaults)
from batchgen.io.reader import RawRecord
from batchgen.request_checks import StructuredOutputError, response_format_schema
from batchgen.io.field_hints import unknown_fields

USER = [{"role": "user", "content": "What is the weather like?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def line(body, url="/v1/completions"):
    return RawRecord(1, {"custom_id": "c1", "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("field, value", [
    ("suffix", " the end"), ("best_of", 3), ("best_of", 1.0 + 1)])
def test_fields_that_change_the_answer_are_refused_not_ignored(field, value):
    """suffix wants an insertion, best_of the best of several samples: answering as if they
    were absent gives a result of another shape."""
    err = parse_record(line({"prompt": "Once", field: value}))
    assert isinstance(err, IntakeError) and err.code == "invalid_request"
    assert err.param == field and field in err.message


@pytest.mark.parametrize("extra", [
    {"echo": False}, {"suffix": ""}, {"suffix": None}, {"best_of": 1}, {"best_of": 2, "n": 2}])
def test_their_defaults_pass_silently(extra):
    record = line({"prompt": "Once", **extra})
    assert isinstance(parse_record(record), ParsedRequest)
    assert unknown_fields(record.data) == []  # validate: no "unknown field" warning either


@pytest.mark.parametrize("prompt, ids", [([[5, 6, 7]], [5, 6, 7]), ([5.0, 6], [5, 6])])
def test_one_prompt_of_token_ids_in_the_batched_form(prompt, ids):
    """[[ids]] is one prompt, as ["text"] is; several prompts stay refused."""
    parsed = parse_record(line({"prompt": prompt}))
    assert isinstance(parsed, ParsedRequest) and parsed.prompt == ids
    err = parse_record(line({"prompt": [[5, 6], [7]]}))
    assert isinstance(err, IntakeError) and err.code == "invalid_prompt"


@pytest.mark.parametrize("body, shown", [
    ({"logit_bias": {"28": 101}}, "got {'28': 101}"),
    ({"stop": list("abcdefghijklmnopq")}, "stop holds at most 16 strings, got 17 strings"),
    ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens must be >= 1, got 0"),
])
def test_a_refused_value_is_shown_as_the_line_wrote_it(body, shown):
    err = parse_record(line({"prompt": "Once", **body}))
    assert isinstance(err, IntakeError) and shown in err.message, err.message
    assert "((" not in err.message and "('" not in err.message  # no internal tuples


def test_multiple_of_is_refused_where_the_grammar_would_ignore_it():
    def schema(s):
        return {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}

    number = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 2}}}
    with pytest.raises(StructuredOutputError, match="multipleOf"):
        response_format_schema(schema(number))
    err = parse_record(line({"messages": USER, "response_format": schema(number)},
                            "/v1/chat/completions"))
    assert isinstance(err, IntakeError) and err.code == "unsupported_response_format"
    assert response_format_schema(schema({"type": "integer", "multipleOf": 3}))[0] is not None


@pytest.fixture(scope="module")
def formatter():
    from tiny_models import embedded_tokenizer, tiny_config

    from batchgen.runner.worker.outputs import OutputFormatter

    loaded = SimpleNamespace(tokenizer=embedded_tokenizer(), name="m",
                             hf_config=tiny_config("qwen2"))  # hermes tool calls
    spec = SimpleNamespace(config=SimpleNamespace(output=OutputConfig(parse_tool_call=True)),
                           batch_id="b", created=1, system_fingerprint=None)
    return OutputFormatter(spec, loaded)


@pytest.mark.parametrize("extra, calls", [
    ({"tools": [WEATHER]}, True), ({"tools": [WEATHER], "tool_choice": "auto"}, True),
    ({"tools": [WEATHER], "tool_choice": "none"}, False), ({}, False)])
def test_parse_tool_call_keeps_to_the_lines_tool_choice(formatter, extra, calls):
    """--parse-tool-call: tool_choice "none" (or a line without tools) never gets tool_calls
    nor finish_reason "tool_calls", whatever the text looks like."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pending = PendingRequest("c1", 1, "chat", USER, None, SamplingParams(max_tokens=8), extra,
                             [5, 6])
    choice = formatter.success(pending, FinishedRequest("c1", 2, [Completion(
        0, [1, 2], FinishReason.STOP, text=text)]))["response"]["body"]["choices"][0]
    assert ("tool_calls" in choice["message"]) is calls
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    if not calls:
        assert choice["message"]["content"] == text


def test_tool_calls_left_as_text_without_the_flag_are_said_once(caplog):
    """Default flags: a line giving tools (tool_choice auto) keeps the calls it writes as text,
    as vLLM does without its parser flags; OpenAI would parse them, so a user porting a job is
    told once, naming the line and the flag."""
    from tiny_models import embedded_tokenizer, tiny_config

    from batchgen.runner.worker.outputs import OutputFormatter

    loaded = SimpleNamespace(tokenizer=embedded_tokenizer(), name="m",
                             hf_config=tiny_config("qwen2"))
    spec = SimpleNamespace(config=SimpleNamespace(output=OutputConfig()), batch_id="b",
                           created=1, system_fingerprint=None)
    formatter = OutputFormatter(spec, loaded)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def answer(line: int, extra: dict) -> dict:
        pending = PendingRequest(f"c{line}", line, "chat", USER, None,
                                 SamplingParams(max_tokens=8), extra, [5, 6])
        return formatter.success(pending, FinishedRequest(f"c{line}", 2, [Completion(
            0, [1, 2], FinishReason.STOP, text=text)]))["response"]["body"]["choices"][0]

    with caplog.at_level("WARNING", logger="batchgen.worker"):
        assert answer(3, {"tools": [WEATHER], "tool_choice": "none"})["message"]["content"]
        assert not caplog.records  # "none": nothing to parse
        for line in (4, 5):
            assert answer(line, {"tools": [WEATHER]})["message"]["content"] == text
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("line 4 gives tools") and "--parse-tool-call" in said


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}])
def test_a_json_response_format_answer_is_content_never_a_tool_call(response_format):
    """With tools (tool_choice "auto") and --parse-tool-call, the JSON a response_format's
    grammar wrote was read as a call when it held "name" and "arguments" (Llama's format):
    content null, a call to a function no tool names, finish_reason "tool_calls"."""
    from tiny_models import embedded_tokenizer, tiny_config

    from batchgen.runner.worker.outputs import OutputFormatter

    loaded = SimpleNamespace(tokenizer=embedded_tokenizer(), name="m",
                             hf_config=tiny_config("llama"))  # llama3_json tool calls
    spec = SimpleNamespace(config=SimpleNamespace(output=OutputConfig(parse_tool_call=True)),
                           batch_id="b", created=1, system_fingerprint=None)
    text = '{"name": "summary", "arguments": {"n": 7}}'
    extra = {"tools": [WEATHER], "tool_choice": "auto", "response_format": response_format}
    pending = PendingRequest("c1", 1, "chat", USER, None, SamplingParams(max_tokens=8), extra,
                             [5, 6])
    finished = FinishedRequest("c1", 2, [Completion(0, [1, 2], FinishReason.STOP, text=text)])
    choice = OutputFormatter(spec, loaded).success(pending, finished)["response"]["body"][
        "choices"][0]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    del extra["response_format"]  # the same text without one is the model's call
    choice = OutputFormatter(spec, loaded).success(pending, finished)["response"]["body"][
        "choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "summary"


@pytest.mark.parametrize("strict", ["false", "true", 0, 1, [True]])
def test_a_json_schema_strict_that_is_not_a_boolean_is_refused(strict):
    """bool("false") is True: the string "false" silently turned strict mode on."""
    def body(value):
        return {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object"}, "strict": value}}}

    err = parse_record(line(body(strict), "/v1/chat/completions"))
    assert isinstance(err, IntakeError) and err.code == "unsupported_response_format"
    assert err.param == "response_format"
    assert "json_schema.strict must be true or false" in err.message, err.message
    for ok in (True, False, None):
        assert isinstance(parse_record(line(body(ok), "/v1/chat/completions")), ParsedRequest)
    assert response_format_schema(body(None)["response_format"])[1] is False


@pytest.mark.parametrize("value", ["false", 0, "no", [False]])
def test_parallel_tool_calls_that_is_not_a_boolean_is_refused(value):
    """Only `false` keeps an answer to one call: the string "false" or 0 read as true would
    silently keep every call the model made."""
    err = parse_record(line({"messages": USER, "tools": [WEATHER], "parallel_tool_calls": value},
                            "/v1/chat/completions"))
    assert isinstance(err, IntakeError) and err.code == "invalid_request"
    assert err.param == "parallel_tool_calls" and "true or false" in err.message
    for ok in (True, False, None):
        parsed = parse_record(line({"messages": USER, "tools": [WEATHER],
                                    "parallel_tool_calls": ok}, "/v1/chat/completions"))
        assert isinstance(parsed, ParsedRequest)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "Once", "echo": True, "logprobs": 2}, "echo with logprobs"),
    ({"prompt": "Once", "echo": "yes"}, "echo must be true or false"),
])
def test_echo_that_cannot_be_answered_is_refused(body, message):
    err = parse_record(line(body))
    assert isinstance(err, IntakeError) and err.param == "echo" and message in err.message
    chat = parse_record(line({"messages": USER, "echo": True}, "/v1/chat/completions"))
    assert isinstance(chat, IntakeError) and "/v1/completions" in chat.message


def test_echo_puts_the_prompt_before_each_choice(tiny_chat_model, tmp_path):
    """`"echo": true` on completions: the prompt string as given (token ids decoded), then
    each choice's answer; the same line without echo answers the same text after it."""
    from job_utils import batchgen, read_jsonl, write_jsonl

    def row(custom_id, prompt, **extra):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2, **extra}}

    ids = [40, 41, 42, 43]
    inp = write_jsonl(tmp_path / "in.jsonl", [
        row("plain", "Once upon a time"), row("echo", "Once upon a time", echo=True),
        row("ids", ids, echo=True)])
    out = tmp_path / "out.jsonl"
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
             tmp_path / "s", "--output", out, "--device", "cpu", check=True)
    bodies = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    for plain, echoed in zip(bodies["plain"]["choices"], bodies["echo"]["choices"]):
        assert echoed["text"] == "Once upon a time" + plain["text"]
    from tiny_models import embedded_tokenizer

    head = embedded_tokenizer().decode(ids)
    assert all(c["text"].startswith(head) and len(c["text"]) > len(head)
               for c in bodies["ids"]["choices"])
    for field in ("prompt_tokens", "completion_tokens"):  # the echoed prompt is not counted
        assert bodies["echo"]["usage"][field] == bodies["plain"]["usage"][field]


def test_model_defaults_read_generation_config_as_a_line_would_be_read():
    from batchgen.io.sampling_fields import BadLine, model_defaults

    assert model_defaults({"temperature": 0.7, "top_k": -1, "top_p": 0.8, "do_sample": True,
                           "min_p": None, "eos_token_id": 2}) == {
        "temperature": 0.7, "top_k": 0, "top_p": 0.8}
    assert model_defaults({"max_new_tokens": 30}) == {}
    with pytest.raises(BadLine, match="top_p"):
        model_defaults({"top_p": 0})
    defaults = {"temperature": 0.6, "repetition_penalty": 1.1}
    left_out = with_model_defaults(parse_record(line({"prompt": "Once"})), defaults)
    assert (left_out.sampling.temperature, left_out.sampling.repetition_penalty) == (0.6, 1.1)
    given = with_model_defaults(parse_record(line(
        {"prompt": "Once", "temperature": 0, "repetition_penalty": 1})), defaults)
    assert (given.sampling.temperature, given.sampling.repetition_penalty) == (0, 1)


def test_a_models_generation_config_sets_what_lines_leave_out(tiny_chat_model, tmp_path):
    """--generation-config auto (the default): a line without temperature is answered with
    generation_config.json's (here 0: greedy), as one giving it explicitly; `none` answers it
    with OpenAI's (1.0: sampled). The defaults are part of the job: a resume with the other
    setting is refused."""
    import shutil

    from job_utils import batchgen, read_jsonl, write_jsonl

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.0, "do_sample": True}))

    def row(custom_id, **extra):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "Once upon a time", "max_tokens": 24, "seed": 7,
                         "ignore_eos": True, **extra}}

    inp = write_jsonl(tmp_path / "in.jsonl", [row("left-out"), row("greedy", temperature=0),
                                              row("sampled", temperature=1.0)])

    def run(out, *flags):
        proc = batchgen("run", "--input", inp, "--model", model, "--output", out, "--device",
                        "cpu", "--storage-path", tmp_path / "s", *flags)
        texts = ({r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
                  for r in read_jsonl(out)} if proc.returncode == 0 else None)
        return proc, texts

    proc, auto = run(tmp_path / "auto.jsonl")
    assert auto is not None, proc.stderr
    assert "generation_config.json's temperature 0.0" in proc.stderr
    assert auto["left-out"] == auto["greedy"] != auto["sampled"]
    proc, _ = run(tmp_path / "auto.jsonl", "--generation-config", "none")
    assert proc.returncode == 3 and "sampling_defaults" in proc.stderr, proc.stderr
    proc, none = run(tmp_path / "none.jsonl", "--generation-config", "vllm", "--batch-id", "b2")
    assert none is not None, proc.stderr
    assert none["left-out"] == none["sampled"] == auto["sampled"]
    assert none["greedy"] == auto["greedy"]


def test_chat_template_flag_serves_a_model_without_one(tiny_chat_model, tmp_path):
    """A model folder with no chat template: chat lines are error lines saying how to give one;
    --chat-template (a file, or the text itself) answers them; the template is part of the job:
    a resume with another one is refused."""
    import shutil

    from job_utils import batchgen, read_jsonl, write_jsonl

    model = tmp_path / "base"
    shutil.copytree(tiny_chat_model, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "c", "messages": USER, "max_tokens": 4, "temperature": 0}])
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "assistant:")

    def run(batch_id, *flags, check=False):
        return batchgen("run", "--input", inp, "--model", model, "--output",
                        tmp_path / f"{batch_id}.jsonl", "--batch-id", batch_id, "--device",
                        "cpu", "--storage-path", tmp_path / "s", *flags, check=check)

    run("none", check=True)
    error = read_jsonl(tmp_path / "none.errors.jsonl")[0]["response"]["body"]["error"]
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    run("file", "--chat-template", template, check=True)
    assert read_jsonl(tmp_path / "file.jsonl")[0]["response"]["status_code"] == 200
    proc = run("file", "--chat-template", template.read_text() + " ")
    assert proc.returncode == 3 and "chat_template" in proc.stderr, proc.stderr
    proc = run("missing", "--chat-template", tmp_path / "missing.jinja")
    assert proc.returncode == 2 and "--chat-template" in proc.stderr


def test_generation_config_may_name_a_folder(tmp_path):
    """vLLM's --generation-config also takes a folder: its generation_config.json is read
    instead of the model's; a folder without one is refused as the flag's value."""
    from dataclasses import replace

    from batchgen.config import ConfigError, JobConfig
    from batchgen.runner.leader.prepare import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5, "top_p": 0.5}))
    base = JobConfig()
    model = replace(base.engine.model, generation_config=str(tmp_path))
    model.validate()
    config = replace(base, engine=replace(base.engine, model=model))
    assert sampling_defaults(config) == {"top_k": 5, "top_p": 0.5}
    with pytest.raises(ConfigError, match="--generation-config"):
        replace(model, generation_config=str(tmp_path / "elsewhere")).validate()


@pytest.mark.parametrize("fields", [{"tools": [WEATHER]},
                                    {"tools": [WEATHER], "tool_choice": "required"}])
def test_tool_fields_on_a_completions_line_are_refused(fields):
    """A /v1/completions prompt is not rendered by a chat template: tools never reached the
    model, and tool_choice "required" forced a call markup no one parsed."""
    err = parse_record(line({"prompt": "call:", **fields}, "/v1/completions"))
    assert isinstance(err, IntakeError) and (err.code, err.param) == ("invalid_request", "tools")
    assert "tools is a /v1/chat/completions field" in err.message
