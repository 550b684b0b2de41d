"""OpenAI and vLLM request fields batchgen does not implement: refused per line when they would
change the answer, silent at their defaults; reasoning_effort reaches the chat template, and is
refused where the template does not read it."""

from __future__ import annotations

import pytest

from batchgen.io.intake import IntakeError, ParsedRequest, PendingRequest, intake, parse_record
from batchgen.io.reader import RawRecord
from batchgen.io.field_hints import unknown_fields

USER = [{"role": "user", "content": "What is the weather like?"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GET = {"name": "get", "parameters": {"type": "object"}}


def line(body, url=CHAT):
    return RawRecord(1, {"custom_id": "c1", "method": "POST", "url": url, "body": body})


def chat(**fields):
    return line({"messages": USER, **fields})


@pytest.mark.parametrize("field, value", [
    ("functions", [GET]), ("function_call", "auto"), ("function_call", {"name": "get"}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}), ("verbosity", "low"),
    ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]),
    ("guided_regex", "[a-z]+"), ("structured_outputs", {"json": {"type": "object"}}),
    ("include_stop_str_in_output", True), ("use_beam_search", True),
    ("prompt_logprobs", 1), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]),
    ("truncate_prompt_tokens", 10), ("add_generation_prompt", False),
    ("continue_final_message", True), ("chat_template", "{{ messages[0]['content'] }}"),
    ("skip_special_tokens", False), ("spaces_between_special_tokens", False),
    ("return_tokens_as_token_ids", True), ("logits_processors", ["my.module:Processor"])])
def test_fields_that_would_change_the_answer_are_refused(field, value):
    """A line migrated from OpenAI (deprecated functions, audio, web search) or vLLM's
    run-batch (guided decoding, beam search, ...) is refused naming the field and what to give
    instead, never answered as if the field were absent."""
    err = parse_record(chat(**{field: value}))
    assert isinstance(err, IntakeError), err
    assert err.code == "invalid_request" and err.param == field and field in err.message


@pytest.mark.parametrize("fields", [
    {"functions": []}, {"function_call": "none"}, {"modalities": ["text"]}, {"audio": None},
    {"verbosity": "medium"}, {"use_beam_search": False}, {"include_stop_str_in_output": False},
    {"add_generation_prompt": True}, {"continue_final_message": False},
    {"skip_special_tokens": True, "spaces_between_special_tokens": True,
     "return_tokens_as_token_ids": False, "logits_processors": []},
    {"prediction": {"type": "content", "content": "It is sunny"}},
    {"prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto"}])
def test_their_defaults_and_fields_that_change_nothing_pass_silently(fields):
    record = chat(**fields)
    assert isinstance(parse_record(record), ParsedRequest)
    assert unknown_fields(record.data) == []  # validate: no "unknown field" warning either


def test_a_value_that_only_looks_like_the_default_is_refused():
    """JSON's false is not 0, nor "medium" a list: only the default itself passes."""
    for fields in ({"use_beam_search": 0}, {"modalities": "text"}):
        assert isinstance(parse_record(chat(**fields)), IntakeError)


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": False}, {"continue_final_message": True},
    {"messages": [{"role": "user", "content": "another question"}]}, {"conversation": USER},
    {"tools": [{"type": "function", "function": GET}]}, {"chat_template": "{{ 'x' }}"}])
def test_template_kwargs_that_would_replace_the_lines_own_are_refused(kwargs):
    """They were dropped without a word: `add_generation_prompt: false` refused as a field was
    answered with the turn opened when given in chat_template_kwargs, a `messages` there never
    reached the template, and `continue_final_message` failed as a template error."""
    (key, _), = kwargs.items()
    err = parse_record(chat(chat_template_kwargs={"enable_thinking": False, **kwargs}))
    assert isinstance(err, IntakeError), err
    assert err.code == "invalid_request" and err.param == f"chat_template_kwargs.{key}"
    assert f"chat_template_kwargs.{key}: " in err.message and "drop it" in err.message


def test_template_kwargs_at_the_values_batchgen_renders_with_pass():
    kwargs = {"add_generation_prompt": True, "continue_final_message": False, "tools": None,
              "tokenize": True, "enable_thinking": False}
    assert isinstance(parse_record(chat(chat_template_kwargs=kwargs)), ParsedRequest)


READS_EFFORT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if reasoning_effort is not defined %}{% set reasoning_effort = 'medium' %}"
                "{% endif %}Reasoning: {{ reasoning_effort }}\nassistant:")
IGNORES_EFFORT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "assistant:")


def test_reasoning_effort_reaches_the_chat_template(template_tokenizer):
    """gpt-oss's template reads `reasoning_effort` (default "medium"): the line's value is
    rendered into the prompt, the default value included."""
    template_tokenizer.chat_template = READS_EFFORT
    prompts = {}
    for effort in ("low", "medium", "high"):
        req = intake(chat(reasoning_effort=effort), template_tokenizer, 2048)
        assert isinstance(req, PendingRequest), req
        prompts[effort] = template_tokenizer.decode(req.prompt_token_ids)
        assert f"Reasoning: {effort}\n" in prompts[effort]
    assert len(set(prompts.values())) == 3


def test_reasoning_effort_a_template_ignores_is_refused(template_tokenizer):
    """Answering as if the field were absent would silently change what was asked for."""
    template_tokenizer.chat_template = IGNORES_EFFORT
    err = intake(chat(reasoning_effort="high"), template_tokenizer, 2048)
    assert isinstance(err, IntakeError) and err.param == "reasoning_effort", err
    assert "does not read reasoning_effort" in err.message
    assert isinstance(intake(chat(), template_tokenizer, 2048), PendingRequest)


@pytest.mark.parametrize("record, message", [
    (chat(reasoning_effort="extreme"), "must be one of"),
    (chat(reasoning_effort=2), "must be one of"),
    (line({"prompt": "Once", "reasoning_effort": "low"}, COMPLETIONS), "/v1/chat/completions")])
def test_reasoning_effort_values_and_lines_it_cannot_apply_to(record, message):
    err = parse_record(record)
    assert isinstance(err, IntakeError) and err.code == "invalid_request"
    assert err.param == "reasoning_effort" and message in err.message


def test_answers_carry_the_jobs_system_fingerprint(tiny_chat_model, tmp_path):
    """OpenAI's `system_fingerprint` on chat and completions bodies: the same for every job run
    with the same model and settings (whatever its input), another with another seed; a
    resumed job keeps it (lines are byte-identical)."""
    import re

    from job_utils import batchgen, read_jsonl, write_jsonl

    def row(custom_id, url, **body):
        return {"custom_id": custom_id, "method": "POST", "url": url,
                "body": {"max_tokens": 2, "temperature": 0, **body}}

    def run(name, rows, *flags):
        inp = write_jsonl(tmp_path / f"{name}.in.jsonl", rows)
        out = tmp_path / f"{name}.jsonl"
        batchgen("run", "--input", inp, "--model", tiny_chat_model, "--output", out,
                 "--storage-path", tmp_path / "s", "--device", "cpu", *flags, check=True)
        return {r["response"]["body"]["system_fingerprint"] for r in read_jsonl(out)}

    first = run("a", [row("c", CHAT, messages=USER), row("p", COMPLETIONS, prompt="Once")])
    assert len(first) == 1 and re.fullmatch(r"fp_[0-9a-f]{10}", next(iter(first))), first
    assert run("b", [row("p2", COMPLETIONS, prompt="Twice")]) == first
    assert run("c", [row("p3", COMPLETIONS, prompt="Once")], "--seed", "7") != first
