"""Turn one input record into a tokenized request, or into an error for that line.

Two steps so `batchgen validate` can check a file without a model:
  parse_record()     shape, custom_id, messages/prompt, sampling fields -> ParsedRequest
  tokenize_request() chat template + tokenizer + context check      -> PendingRequest
intake() does both (tokenize_parsed() the second half, for a record parsed earlier: a job's
supervisor parses every line once, its workers tokenize). A bad line returns an IntakeError;
nothing here raises for bad input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import orjson

from batchgen.core import Request, SamplingParams
from batchgen.io.embeddings import (EMBEDDINGS_URL, EmbeddingLineError, EmbeddingRequest,
                                    parse_embedding, tokenize_embedding)
from batchgen.io.grammar_limits import GrammarTooComplex, check_grammar_limits
from batchgen.io.reader import RawRecord, custom_id_of, record_key
from batchgen.io.templates import TemplateError, render_chat
from batchgen.request_checks import (StructuredOutputError, ToolChoiceError, check_tools,
                                     forced_functions, response_format_schema)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EXTRA_FIELDS = ("tools", "tool_choice", "response_format", "parallel_tool_calls",
                "chat_template_kwargs")
"""Body fields carried to the chat template, the output parsers and, for response_format
(json_object, json_schema), the grammar that constrains sampling."""
MAX_CHARS_PER_TOKEN = 128
"""More characters than any vocabulary piece holds: a text longer than this many per token of
the context cannot fit, whatever the tokenizer."""
_ALLOWED = {
    "max_tokens": "an integer >= 1", "max_completion_tokens": "an integer >= 1",
    "min_tokens": "an integer >= 0", "temperature": "a number in [0, 100]",
    "top_p": "a number in (0, 1]", "top_k": "an integer >= 0 (0 or -1 disable it)",
    "min_p": "a number in [0, 1]", "seed": "an integer in [0, 2^63)",
    "n": "an integer in [1, 128]", "top_logprobs": "an integer in [0, 20]",
    "stop": "a string or a list of up to 16 non-empty strings",
    "stop_token_ids": "a list of token ids (integers >= 0)", "ignore_eos": "true or false",
    "presence_penalty": "a number in [-2, 2]", "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in (0, 10]",
    "logit_bias": "an object mapping token ids to numbers in [-100, 100]",
}


@dataclass(frozen=True)
class IntakeError:
    """A line that becomes an error result (status 400) instead of a request."""

    custom_id: str
    line: int
    code: str
    message: str
    param: str | None = None
    """The request field at fault (OpenAI's error `param`), None when no one field is."""


@dataclass(frozen=True)
class ParsedRequest:
    custom_id: str
    line: int
    kind: str
    """"chat" or "completion"."""
    messages: list[dict] | None
    """Chat messages (text content parts flattened to one string, None-valued keys dropped)."""
    prompt: str | list[int] | None
    """Completion prompt: text, or token ids given by the user."""
    sampling: SamplingParams
    extra: dict[str, Any]
    """Body fields in EXTRA_FIELDS that were given."""


@dataclass(frozen=True)
class PendingRequest(ParsedRequest):
    prompt_token_ids: list[int]
    """sampling.max_tokens is already clamped to max_context - len(prompt_token_ids)."""

    def to_request(self) -> Request:
        return Request(self.custom_id, list(self.prompt_token_ids), self.sampling, origin=self)


class _BadLine(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def intake(record: RawRecord, tokenizer: Any, max_context: int,
           default_max_tokens: int = 256,
           max_model_len: int | None = None) -> PendingRequest | EmbeddingRequest | IntakeError:
    """Parse and tokenize one record (see module docstring). `max_model_len`: the context cap
    the user set (--max-model-len): a prompt + max_tokens above it is refused, not shortened."""
    parsed = parse_record(record, default_max_tokens)
    if isinstance(parsed, IntakeError):
        return parsed
    return tokenize_parsed(parsed, tokenizer, max_context, max_model_len)


def tokenize_parsed(parsed: ParsedRequest | EmbeddingRequest, tokenizer: Any, max_context: int,
                    max_model_len: int | None = None
                    ) -> PendingRequest | EmbeddingRequest | IntakeError:
    """What intake does after parse_record: tokenize, and refuse a prompt + max_tokens above
    the `max_model_len` cap. A job's workers call it on the records the supervisor parsed."""
    if max_model_len is not None:  # the model's own context may be the smaller cap
        return _within_cap(tokenize_request(parsed, tokenizer, max_context), parsed,
                           min(max_model_len, max_context))
    return tokenize_request(parsed, tokenizer, max_context)


def _within_cap(item: PendingRequest | EmbeddingRequest | IntakeError, parsed,
                cap: int) -> PendingRequest | EmbeddingRequest | IntakeError:
    if not isinstance(item, PendingRequest):
        return item
    prompt, asked = len(item.prompt_token_ids), parsed.sampling.max_tokens
    if prompt + asked <= cap:
        return item
    return IntakeError(item.custom_id, item.line, "context_length_exceeded",
                       f"line {item.line}: the prompt ({prompt} tokens) + max_tokens ({asked}) "
                       f"is {prompt + asked} tokens, over --max-model-len {cap}: lower "
                       "max_tokens (or --max-tokens) or raise --max-model-len")


def parse_record(record: RawRecord,
                 default_max_tokens: int = 256) -> ParsedRequest | EmbeddingRequest | IntakeError:
    """Check a record's shape and fields without a tokenizer."""
    key = record_key(record)
    if record.error is not None:
        return IntakeError(key, record.line, record.error.code, record.error.message)
    assert record.data is not None
    try:
        return _parse(record.data, key, record.line, default_max_tokens)
    except _BadLine as bad:
        return IntakeError(key, record.line, bad.code, f"line {record.line}: {bad}", bad.param)
    except RecursionError:  # valid JSON nested past what repr() and the checks recurse into
        return IntakeError(key, record.line, "invalid_request", f"line {record.line}: a field "
                           "is nested too deeply to check: flatten it")


def _parse(data: dict, key: str, line: int,
           default_max_tokens: int) -> ParsedRequest | EmbeddingRequest:
    if data.get("custom_id") is not None and custom_id_of(data) is None:
        hint = (": a number this large has lost digits in JSON, quote it"
                if isinstance(data["custom_id"], float) else "")
        raise _BadLine("missing_custom_id", "custom_id must be a non-empty string, got "
                                            f"{data['custom_id']!r}{hint}", "custom_id")
    if any(k in data for k in ("url", "method", "body")):
        kind, body = _openai_envelope(data)
    else:
        kind, body = _plain_kind(data), data
    extra = {k: _maybe_json(body[k]) for k in EXTRA_FIELDS if body.get(k) is not None}
    if "chat_template_kwargs" in extra and not isinstance(extra["chat_template_kwargs"], dict):
        raise _BadLine("invalid_messages", "chat_template_kwargs must be an object",
                       "chat_template_kwargs")
    if body.get("stream") not in (None, False):
        raise _BadLine("invalid_request", "the request must not be sent in stream mode: batch "
                                          "lines are answered whole; drop \"stream\" or set it "
                                          "to false", "stream")
    if kind == "embedding":
        try:
            return parse_embedding(body, key, line)
        except EmbeddingLineError as bad:
            raise _BadLine(bad.code, str(bad), bad.param) from None
    _check_structured(extra)
    messages = _messages(body.get("messages")) if kind == "chat" else None
    prompt = _prompt(body.get("prompt")) if kind == "completion" else None
    sampling = parse_sampling(body, kind, default_max_tokens)
    return ParsedRequest(key, line, kind, messages, prompt, sampling, extra)


def _openai_envelope(data: dict) -> tuple[str, dict]:
    if custom_id_of(data) is None:
        raise _BadLine("missing_custom_id", "an OpenAI batch line needs a custom_id "
                                            "(a non-empty string unique in the file)", "custom_id")
    method = data.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise _BadLine("unsupported_method", f"method {method!r} is not supported: use \"POST\"",
                       "method")
    url = data.get("url")
    kinds = {CHAT_URL: "chat", COMPLETIONS_URL: "completion", EMBEDDINGS_URL: "embedding"}
    if url not in kinds:
        said = ("an OpenAI batch line needs a url" if url is None
                else f"url {url!r} is not supported")
        raise _BadLine("unsupported_url", f"{said}: use \"{CHAT_URL}\", \"{COMPLETIONS_URL}\" or "
                                          f"\"{EMBEDDINGS_URL}\"", "url")
    body = _maybe_json(data.get("body"))  # Parquet may hold the body as JSON text
    if not isinstance(body, dict):
        raise _BadLine("not_an_object", "body must be a JSON object holding the request", "body")
    if body.get("messages") is not None and body.get("prompt") is not None:
        raise _BadLine("invalid_messages", "give either messages (chat) or prompt (completion), "
                                           "not both", "messages")
    return kinds[url], body


def _plain_kind(data: dict) -> str:
    has_messages, has_prompt = data.get("messages") is not None, data.get("prompt") is not None
    if has_messages and has_prompt:
        raise _BadLine("invalid_messages", "give either messages (chat) or prompt (completion), "
                                           "not both", "messages")
    if has_prompt:
        return "completion"
    if has_messages:
        return "chat"
    if data.get("input") is not None:
        return "embedding"
    raise _BadLine("invalid_messages", "a line needs messages (chat) or prompt (completion), or "
                                       "input (embeddings)",
                   "messages")


def _maybe_json(value: Any) -> Any:
    """Parquet often stores nested fields (messages, tools) as JSON text; decode it."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
"""Message roles accepted: OpenAI's, and Llama 3's `ipython` (tool output in its template)."""


def _check_structured(extra: dict) -> None:
    """tools, tool_choice and response_format as the grammar builders will take them: a line
    they would refuse is refused here, where `batchgen validate` sees it too."""
    try:
        check_tools(extra.get("tools"))
    except ToolChoiceError as err:
        raise _BadLine("invalid_tools", str(err), "tools") from None
    try:
        forced_functions(extra.get("tools"), extra.get("tool_choice"))
    except ToolChoiceError as err:
        raise _BadLine("invalid_tool_choice", str(err), "tool_choice") from None
    if "response_format" in extra:
        try:
            check_grammar_limits(extra["response_format"])
            response_format_schema(extra["response_format"])
        except (GrammarTooComplex, StructuredOutputError) as err:
            raise _BadLine("unsupported_response_format", str(err), "response_format") from None


def _messages(value: Any) -> list[dict]:
    value = _maybe_json(value)
    if not isinstance(value, list) or not value:
        raise _BadLine("invalid_messages", "messages must be a non-empty list of "
                                           "{\"role\", \"content\"} objects", "messages")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, index: int) -> dict:
    if not isinstance(message, dict):
        raise _BadLine("invalid_messages", f"messages[{index}] must be an object",
                       f"messages[{index}]")
    # Parquet structs carry every field of the schema, absent ones as null: drop them, or a
    # template would render "None" for a missing name.
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _BadLine("invalid_messages", f"messages[{index}].role must be a non-empty string",
                       f"messages[{index}].role")
    if role not in ROLES:
        raise _BadLine("invalid_messages", f"messages[{index}].role {role!r} is not a chat "
                                           f"role: use one of {', '.join(sorted(ROLES))}",
                       f"messages[{index}].role")
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = _flatten_parts(content, index)
    elif content is None and role == "assistant" and message.get("tool_calls"):
        message["content"] = ""  # OpenAI's null beside tool calls; templates read .content
    elif content is None:
        raise _BadLine("invalid_messages", f"messages[{index}].content is missing or null: "
                                           "give the message's text",
                       f"messages[{index}].content")
    elif content is not None and not isinstance(content, str):
        raise _BadLine("invalid_messages", f"messages[{index}].content must be a string or a "
                                           "list of text parts", f"messages[{index}].content")
    return message


def _flatten_parts(parts: list, index: int) -> str:
    # Text-only models' templates expect a string; join text parts as vLLM does.
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type", "text") != "text" \
                or not isinstance(part.get("text"), str):
            raise _BadLine("invalid_messages", f"messages[{index}].content: only text parts "
                                               "({\"type\": \"text\", \"text\": ...}) are "
                                               "supported", f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        return value
    ids = _token_ids(value)
    if ids:
        return ids
    raise _BadLine("invalid_prompt", "prompt must be a string or a list of token ids "
                                     "(one prompt per line; batched prompts are not supported)",
                   "prompt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any) -> Any:
    """An integral float as the int it is (Parquet/pandas turn integer columns with gaps into
    floats); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _token_ids(value: Any) -> list[int] | None:
    """A list of token ids (ints >= 0, integral floats accepted), or None if it is not one."""
    if not isinstance(value, list):
        return None
    ids = [_whole(t) for t in value]
    return ids if all(_is_int(t) and t >= 0 for t in ids) else None


def _bad_type(name: str, value: Any) -> _BadLine:
    return _BadLine("invalid_sampling_param",
                    f"{name} must be {_ALLOWED[name]}, got {type(value).__name__} {value!r}", name)


def _get_int(body: dict, name: str) -> int | None:
    value = _whole(body.get(name))
    if value is not None and not _is_int(value):
        raise _bad_type(name, value)
    return value


def _get_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad_type(name, value)
    return float(value)


def _get_stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")  # a string is one stop string, even one that looks like JSON
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _bad_type("stop", value)
    return tuple(items)


def _get_token_ids(body: dict) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    ids = _token_ids(value)
    if ids is None:
        raise _bad_type("stop_token_ids", value)
    return tuple(ids)


def _get_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings), as sorted (id, bias) pairs."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    try:
        pairs = sorted((int(k), v) for k, v in value.items())
    except (AttributeError, TypeError, ValueError):
        raise _bad_type("logit_bias", value) from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in pairs):
        raise _bad_type("logit_bias", value)
    return tuple((t, float(v)) for t, v in pairs)


def _get_logprobs(body: dict, kind: str) -> tuple[bool, int]:
    """(logprobs on?, top_logprobs). Chat: logprobs bool + top_logprobs int. Completions:
    logprobs is the int count of alternatives (OpenAI legacy), 0 = chosen token only."""
    value, top = body.get("logprobs"), _get_int(body, "top_logprobs")
    if kind == "completion":
        value = _whole(value)
        if value is not None and not (_is_int(value) and 0 <= value <= 20):
            raise _BadLine("invalid_sampling_param", "logprobs for completions must be an "
                                                     f"integer in [0, 20], got {value!r}",
                           "logprobs")
        if value is not None:
            return True, value
        return top is not None, top or 0
    if value is not None and not isinstance(value, bool):
        raise _BadLine("invalid_sampling_param", f"logprobs must be true or false, got {value!r}",
                       "logprobs")
    if top and not value:
        raise _BadLine("invalid_sampling_param", "top_logprobs needs logprobs: true",
                       "top_logprobs")
    return bool(value), top or 0


def parse_sampling(body: dict, kind: str, default_max_tokens: int = 256) -> SamplingParams:
    """SamplingParams from request fields (None means "not given"); raises _BadLine."""
    max_tokens = _get_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _bad_type("ignore_eos", ignore_eos)
    top_k = _get_int(body, "top_k")
    logprobs, top_logprobs = _get_logprobs(body, kind)
    given = {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "min_tokens": _get_int(body, "min_tokens"),
        "temperature": _get_number(body, "temperature"),
        "top_p": _get_number(body, "top_p"),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
        "min_p": _get_number(body, "min_p"),
        "seed": _get_int(body, "seed"),
        "n": _get_int(body, "n"),
        "stop": _get_stop(body),
        "stop_token_ids": _get_token_ids(body),
        "ignore_eos": ignore_eos,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "presence_penalty": _get_number(body, "presence_penalty"),
        "frequency_penalty": _get_number(body, "frequency_penalty"),
        "repetition_penalty": _get_number(body, "repetition_penalty"),
        "logit_bias": _get_logit_bias(body),
    }
    given = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(**given)  # checks its values (the only check they get)
    except ValueError as e:
        name, rest = (str(e).split(" ", 1) + [""])[:2]
        got = (f", got {given.get(name, _SAMPLING_DEFAULTS.get(name))!r}"
               if name in _SAMPLING_FIELDS else "")
        if name == "max_tokens" and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"  # the field the line spelled
        raise _BadLine("invalid_sampling_param", f"{name} {rest}{got}".strip(),
                       name if name in _SAMPLING_FIELDS or name in _ALLOWED else None) from None


_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
_SAMPLING_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}


def tokenize_request(parsed: ParsedRequest | EmbeddingRequest, tokenizer: Any,
                     max_context: int) -> PendingRequest | EmbeddingRequest | IntakeError:
    """Render (chat template) and tokenize; refuse prompts that leave no room to generate."""
    if isinstance(parsed, EmbeddingRequest):
        try:
            return tokenize_embedding(parsed, tokenizer, max_context)
        except EmbeddingLineError as bad:
            return IntakeError(parsed.custom_id, parsed.line, bad.code,
                               f"line {parsed.line}: {bad}", bad.param)
    try:
        ids = _prompt_ids(parsed, tokenizer, max_context)
        # Stop ids index the logits (min_tokens masks them): one past the vocabulary would
        # stop the whole batch's step, not just this line.
        _check_in_vocabulary("stop_token_ids", parsed.sampling.stop_token_ids, len(tokenizer),
                             "invalid_sampling_param")
        _check_in_vocabulary("logit_bias", [t for t, _ in parsed.sampling.logit_bias],
                             len(tokenizer), "invalid_sampling_param")
    except _BadLine as bad:
        return IntakeError(parsed.custom_id, parsed.line, bad.code, f"line {parsed.line}: {bad}",
                           bad.param)
    field = "messages" if parsed.kind == "chat" else "prompt"
    if not ids:
        return IntakeError(parsed.custom_id, parsed.line, "invalid_prompt",
                           f"line {parsed.line}: the prompt is empty after tokenization", field)
    if len(ids) >= max_context:
        return IntakeError(parsed.custom_id, parsed.line, "context_length_exceeded",
                           f"line {parsed.line}: the prompt is {len(ids)} tokens but the model "
                           f"context is {max_context} tokens (at least one token must be left "
                           "to generate); shorten the prompt: it is never truncated", field)
    sampling = parsed.sampling.fit_context(max_context - len(ids))
    values = {f.name: getattr(parsed, f.name) for f in fields(ParsedRequest)}
    values["sampling"] = sampling
    return PendingRequest(**values, prompt_token_ids=ids)


def _check_in_vocabulary(what: str, token_ids, vocab: int, code: str) -> None:
    if any(t >= vocab for t in token_ids):
        noun = "token ids" if what == "logit_bias" else ""
        raise _BadLine(code, f"{what} {noun + ' ' if noun else ''}must be < {vocab} (the "
                       "tokenizer's vocabulary size)",
                       what if what in ("stop_token_ids", "logit_bias") else "prompt")


def _prompt_ids(parsed: ParsedRequest, tokenizer: Any, max_context: int) -> list[int]:
    if parsed.kind == "completion":
        if isinstance(parsed.prompt, list):
            _check_in_vocabulary("prompt token ids", parsed.prompt, len(tokenizer),
                                 "invalid_prompt")
            return list(parsed.prompt)
        return list(tokenizer.encode(_fits_context(parsed.prompt, max_context)))
    try:
        text = render_chat(parsed.messages, parsed.extra, tokenizer)
    except TemplateError as err:
        raise _BadLine(err.code, str(err), err.param) from None
    text = _fits_context(text, max_context)
    # The template already wrote BOS and other special tokens: do not add them twice.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fits_context(text: str, max_context: int) -> str:
    """Refuse, untokenized, a text no tokenizer could fit in the context: tokenizing costs
    about a hundred bytes of memory per character, so a huge prompt is never tokenized."""
    if len(text) > max_context * MAX_CHARS_PER_TOKEN:
        raise _BadLine("context_length_exceeded",
                       f"the prompt is {len(text)} characters, more than {MAX_CHARS_PER_TOKEN} "
                       f"per token of the model's {max_context}-token context, so it cannot "
                       "fit (it is refused without tokenizing); shorten the prompt")
    return text
