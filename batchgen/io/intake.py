"""Turn one input record into a tokenized request, or into an error for that line.

Two steps so `batchgen validate` can check a file without a model:
  parse_record()     shape, custom_id, messages/prompt, sampling fields -> ParsedRequest
  tokenize_request() chat template + tokenizer + context check      -> PendingRequest
intake() does both (tokenize_parsed() the second half, for a record parsed earlier: a job's
supervisor parses every line once, its workers tokenize). A bad line returns an IntakeError;
nothing here raises for bad input.
"""

from __future__ import annotations

import logging
import reprlib
from dataclasses import dataclass, field, fields, replace
from typing import Any

from batchgen.core import CompactPickle, Request, SamplingParams
from batchgen.io.embeddings import (EMBEDDINGS_URL, MAX_CHARS_PER_TOKEN, MODEL_CONTEXT,
                                    VOCAB_BOUND, EmbeddingLineError, EmbeddingRequest, misnamed,
                                    misnamed_input, parse_embedding, raise_flag,
                                    tokenize_embedding)
from batchgen.io.field_values import (MAX_FIELD_DEPTH, maybe_json, request_fields, text_problem,
                                      too_deep)
from batchgen.io.grammar_limits import GrammarTooComplex, check_grammar_limits, check_grammars
from batchgen.io.messages import parse_messages, parse_prompt
from batchgen.io.reader import RawRecord, custom_id_of, record_key
from batchgen.io.refused_fields import (EMBEDDING_REFUSED, refuse_fields, refuse_template_kwargs,
                                       refuse_unimplemented)
from batchgen.io.sampling_fields import (MODEL_DEFAULT_FIELDS, BadLine, gives_max_tokens,
                                         parse_sampling)
from batchgen.io.templates import TemplateError, render_chat
from batchgen.request_checks import (StructuredOutputError, ToolChoiceError,
                                     check_parameters_schema, check_tools, forced_functions,
                                     grammar_constrained, response_format_schema)

log = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URL_FIELDS = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}
"""The body field each url's requests are made of."""
EXTRA_FIELDS = ("tools", "tool_choice", "response_format", "parallel_tool_calls",
                "chat_template_kwargs", "reasoning_effort")
"""Body fields carried to the chat template, the output parsers and, for response_format
(json_object, json_schema), the grammar that constrains sampling."""
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
"""OpenAI's reasoning_effort values: handed to the chat template, which reads it or not."""


@dataclass(frozen=True)
class IntakeError(CompactPickle):
    """A line that becomes an error result (status 400) instead of a request."""

    custom_id: str
    line: int
    code: str
    message: str
    param: str | None = None
    """The request field at fault (OpenAI's error `param`), None when no one field is."""


@dataclass(frozen=True)
class ParsedRequest(CompactPickle):
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
    unset: frozenset[str] = field(default=frozenset(), kw_only=True)
    """The MODEL_DEFAULT_FIELDS the line left out: the model's defaults fill them
    (with_model_defaults)."""


@dataclass(frozen=True)
class PendingRequest(ParsedRequest):
    prompt_token_ids: list[int]
    """sampling.max_tokens is already clamped to max_context - len(prompt_token_ids)."""

    def to_request(self) -> Request:
        return Request(self.custom_id, list(self.prompt_token_ids), self.sampling, origin=self)


def intake(record: RawRecord, tokenizer: Any, max_context: int,
           default_max_tokens: int = 256) -> PendingRequest | EmbeddingRequest | IntakeError:
    """Parse and tokenize one record (see module docstring): parse_record, then
    tokenize_parsed with no --max-model-len cap."""
    parsed = parse_record(record, default_max_tokens)
    if isinstance(parsed, IntakeError):
        return parsed
    return tokenize_parsed(parsed, tokenizer, max_context)


def tokenize_parsed(parsed: ParsedRequest | EmbeddingRequest, tokenizer: Any, max_context: int,
                    max_model_len: int | None = None, vocab_size: int | None = None
                    ) -> PendingRequest | EmbeddingRequest | IntakeError:
    """What intake does after parse_record: tokenize, and refuse a prompt + max_tokens above
    the `max_model_len` cap. A job's workers call it on the records the supervisor parsed.
    `vocab_size`: the model's (token ids at or past it, or past the tokenizer's, are refused)."""
    flag = max_model_len is not None and max_model_len <= max_context
    item = tokenize_request(parsed, tokenizer, max_context, vocab_size,
                            "--max-model-len" if flag else MODEL_CONTEXT)
    if max_model_len is not None:  # the model's own context may be the smaller cap
        return _within_cap(item, parsed, min(max_model_len, max_context))
    return item


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
    except BadLine as bad:
        return IntakeError(key, record.line, bad.code, f"line {record.line}: {bad}", bad.param)
    except RecursionError:  # valid JSON nested past what repr() and the checks recurse into
        name = too_deep(request_fields(record.data))
        return IntakeError(key, record.line, "invalid_request", f"line {record.line}: "
                           f"{name or 'a field'} is nested too deeply to check (more than "
                           f"{MAX_FIELD_DEPTH} levels of objects and lists): flatten it", name)
    except Exception as err:  # noqa: BLE001 - a check nobody foresaw failing costs this line
        log.warning("line %d could not be checked", record.line, exc_info=True)
        return IntakeError(key, record.line, "invalid_request", f"line {record.line}: batchgen "
                           f"could not check this line ({type(err).__name__}: {err}); compare "
                           "its fields with docs/job-files.md")


def _check_stream(stream) -> None:
    """Batch lines are answered whole: stream may be absent, null or the boolean false."""
    if stream is None or stream is False:
        return
    message = ("the request must not be sent in stream mode: batch lines are answered whole; "
               "drop \"stream\" or set it to false" if stream is True else
               f"stream must be the boolean false (or be dropped), got {type(stream).__name__} "
               f"{reprlib.repr(stream)}: batch lines are answered whole, never streamed")
    raise BadLine("invalid_request", message, "stream")


def _parse(data: dict, key: str, line: int,
           default_max_tokens: int) -> ParsedRequest | EmbeddingRequest:
    if data.get("custom_id") is not None and custom_id_of(data) is None:
        cid = data["custom_id"]
        hint = (": a number this large has lost digits in JSON, quote it"
                if isinstance(cid, float) and cid.is_integer() else "")
        raise BadLine("missing_custom_id", "custom_id must be a non-empty string, got "
                                            f"{cid!r}{hint}", "custom_id")
    if _is_envelope(data):
        kind, body = _openai_envelope(data)
    else:
        kind, body = plain_kind(data), data
    extra = {k: maybe_json(body[k]) for k in EXTRA_FIELDS if body.get(k) is not None}
    if "chat_template_kwargs" in extra:
        if not isinstance(extra["chat_template_kwargs"], dict):
            raise BadLine("invalid_messages", "chat_template_kwargs must be an object",
                           "chat_template_kwargs")
        refuse_template_kwargs(extra["chat_template_kwargs"])
    _check_stream(body.get("stream"))
    if kind == "embedding":
        try:
            parsed_embedding = parse_embedding(body, key, line)
        except EmbeddingLineError as bad:
            raise BadLine(bad.code, str(bad), bad.param) from None
        refuse_fields(body, EMBEDDING_REFUSED)
        return parsed_embedding
    _check_structured(extra)
    _check_parallel_tool_calls(extra.get("parallel_tool_calls"))
    _check_chat_fields(extra, kind)
    messages = parse_messages(body.get("messages")) if kind == "chat" else None
    prompt = parse_prompt(body.get("prompt")) if kind == "completion" else None
    sampling = parse_sampling(body, kind, default_max_tokens)
    if (sampling.stop or sampling.stop_token_ids) and grammar_constrained(extra):
        # A stop string or token inside the JSON would leave it cut and invalid (reported as
        # "stop"): a grammar-constrained answer ends where its grammar does.
        sampling = replace(sampling, stop=(), stop_token_ids=())
    if _echo(body, kind, sampling):
        extra["echo"] = True
    refuse_unimplemented(body, sampling.n)
    _refuse_deep(messages, extra)
    unset = frozenset(k for k in MODEL_DEFAULT_FIELDS if body.get(k) is None)
    return ParsedRequest(key, line, kind, messages, prompt, sampling, extra, unset=unset)


def _refuse_deep(messages: list[dict] | None, extra: dict) -> None:
    """What the line carries to its worker (messages, tools, chat_template_kwargs, ...) is
    pickled and walked by the chat template, both recursing per level: refuse deep nesting
    here, by name, rather than fail the job's intake or the template."""
    kept = [(f"messages[{i}].{k}", v) for i, m in enumerate(messages or ()) for k, v in m.items()]
    name = too_deep([*kept, *extra.items()])
    if name is not None:
        raise BadLine("invalid_request", f"{name} is nested more than {MAX_FIELD_DEPTH} levels "
                                          "deep (objects and lists): flatten it", name)


def with_model_defaults(parsed: ParsedRequest, defaults: dict[str, Any]
                        ) -> ParsedRequest | IntakeError:
    """`parsed` with the model's sampling defaults (sampling_fields.model_defaults) in the
    fields it left out; an IntakeError if the line's own fields do not go with them."""
    taken = {k: v for k, v in defaults.items() if k in parsed.unset}
    if not taken:
        return parsed
    try:
        return replace(parsed, sampling=replace(parsed.sampling, **taken))
    except ValueError as err:
        return IntakeError(parsed.custom_id, parsed.line, "invalid_sampling_param",
                           f"line {parsed.line}: with the model's sampling defaults "
                           f"{taken}: {err}")


def _echo(body: dict, kind: str, sampling: SamplingParams) -> bool:
    """Whether a completions line asks for its prompt before the answer (`"echo": true`).
    The prompt's own log probabilities, which echo adds to logprobs, are not computed: echo
    with logprobs is refused, as is echo on a chat line."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if echo is not True:
        raise BadLine("invalid_request", f"echo must be true or false, got {echo!r}", "echo")
    if kind != "completion":
        raise BadLine("invalid_request", "echo applies to /v1/completions lines: drop it",
                       "echo")
    if sampling.logprobs:
        raise BadLine("invalid_request", "echo with logprobs (log probabilities of the prompt's "
                                          "tokens) is not supported: drop one of them", "echo")
    return True


def _check_chat_fields(extra: dict, kind: str) -> None:
    """The fields only a chat template reads (tools, tool_choice, reasoning_effort): refused
    on a completions line, naming the field; reasoning_effort's value checked."""
    chat_only = next((k for k in ("tools", "tool_choice") if k in extra), None)
    if chat_only is not None and kind != "chat":
        raise BadLine("invalid_request", f"{chat_only} is a /v1/chat/completions field (the "
                                          "chat template renders the tools): drop it, or send "
                                          "the line as chat messages", chat_only)
    effort = extra.get("reasoning_effort")
    if effort is None:
        return
    if effort not in REASONING_EFFORTS:
        raise BadLine("invalid_request", f"reasoning_effort must be one of "
                                          f"{', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       "reasoning_effort")
    if kind != "chat":
        raise BadLine("invalid_request", "reasoning_effort applies to /v1/chat/completions "
                                          "lines (the chat template reads it): drop it",
                       "reasoning_effort")


def takes_default_max_tokens(parsed: ParsedRequest | EmbeddingRequest | IntakeError,
                             record: RawRecord) -> bool:
    """Whether `parsed` (parse_record of `record`) is a request whose length is --max-tokens."""
    if not isinstance(parsed, ParsedRequest):
        return False
    data = record.data
    return not gives_max_tokens(_envelope_body(data) if _is_envelope(data) else data)


def _is_envelope(data: dict) -> bool:
    """An OpenAI batch line ({custom_id, method, url, body}) rather than a bare request."""
    return any(k in data for k in ("url", "method", "body"))


def _envelope_body(data: dict) -> Any:
    return maybe_json(data.get("body"))  # Parquet may hold the body as JSON text


def _openai_envelope(data: dict) -> tuple[str, dict]:
    if custom_id_of(data) is None:
        raise BadLine("missing_custom_id", "an OpenAI batch line needs a custom_id "
                                            "(a non-empty string unique in the file)", "custom_id")
    method = data.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise BadLine("unsupported_method", f"method {method!r} is not supported: use \"POST\"",
                       "method")
    url = data.get("url")
    kinds = {CHAT_URL: "chat", COMPLETIONS_URL: "completion", EMBEDDINGS_URL: "embedding"}
    if url not in kinds:
        said = ("an OpenAI batch line needs a url" if url is None
                else f"url {url!r} is not supported")
        raise BadLine("unsupported_url", f"{said}: use \"{CHAT_URL}\", \"{COMPLETIONS_URL}\" or "
                                          f"\"{EMBEDDINGS_URL}\"", "url")
    body = _envelope_body(data)
    if not isinstance(body, dict):
        raise BadLine("not_an_object", "body must be a JSON object holding the request"
                                        + (text_problem(body) or _outside_body(data)), "body")
    if body.get("messages") is not None and body.get("prompt") is not None:
        raise BadLine("invalid_messages", "give either messages (chat) or prompt (completion), "
                                           "not both", "messages")
    _check_url_fits_body(url, body)
    return kinds[url], body


def _outside_body(data: dict) -> str:
    """The hint of a line without a body that holds a request's fields beside it."""
    fields = [name for name in URL_FIELDS.values() if name in data]
    return (f": this line has {fields[0]} beside body, not inside it; move the request's "
            "fields into body" if fields else "")


def _check_url_fits_body(url: str, body: dict) -> None:
    """BadLine naming the url a body without its url's field was written for (chat's
    messages sent to /v1/embeddings, an embeddings input to /v1/chat/completions, ...)."""
    needed = URL_FIELDS[url]
    if body.get(needed) is not None:
        return
    other = next((u for u, name in URL_FIELDS.items()
                  if name != needed and body.get(name) is not None), None)
    if other is not None:
        raise BadLine(f"invalid_{needed}", f"a {url} line needs {needed}; this one has "
                      f"{URL_FIELDS[other]}, which {other} takes: change its url or its body",
                      needed)


def plain_kind(data: dict) -> str:
    """"chat", "completion" or "embedding": what a plain line (no OpenAI envelope) asks for;
    BadLine when it holds neither messages, prompt nor input, or both of the first two."""
    has_messages, has_prompt = data.get("messages") is not None, data.get("prompt") is not None
    if has_messages and has_prompt:
        raise BadLine("invalid_messages", "give either messages (chat) or prompt (completion), "
                                           "not both", "messages")
    if has_prompt:
        return "completion"
    if has_messages:
        return "chat"
    if data.get("input") is not None:
        return "embedding"
    raise BadLine("invalid_messages", "a line needs messages (chat) or prompt (completion), or "
                                       "input (embeddings)"
                  + (misnamed_input(data) or misnamed(data, OTHER_PROMPT_NAMES)), "messages")


_CHAT = "messages (a list of {role, content} objects)"
OTHER_PROMPT_NAMES = {"text": "prompt", "question": "prompt", "query": "prompt",
                      "instruction": "prompt", "prompts": "prompt", "message": _CHAT,
                      "conversation": _CHAT, "conversations": _CHAT}
"""What datasets call a prompt or a chat (ShareGPT's `conversations`): a plain line giving one
of them instead is told which field batchgen reads."""


def _check_structured(extra: dict) -> None:
    """tools, tool_choice and response_format as the grammar builders will take them: a line
    they would refuse is refused here, where `batchgen validate` sees it too."""
    try:
        check_tools(extra.get("tools"))
    except ToolChoiceError as err:
        raise BadLine("invalid_tools", str(err), "tools") from None
    try:
        forced = forced_functions(extra.get("tools"), extra.get("tool_choice"))
    except ToolChoiceError as err:
        raise BadLine("invalid_tool_choice", str(err), "tool_choice") from None
    try:  # a forced call's grammar is built from these schemas
        check_grammars([(f"function {fn['name']!r} parameters", fn["parameters"])
                        for fn in forced or ()])
        for fn in forced or ():
            check_parameters_schema(fn["parameters"], f"function {fn['name']!r} parameters")
    except (GrammarTooComplex, StructuredOutputError) as err:
        raise BadLine("invalid_tool_choice", f"tools: a parameters schema cannot be "
                                             f"enforced: {err}", "tools") from None
    if "response_format" in extra:
        try:
            check_grammar_limits(extra["response_format"])
            schema, _ = response_format_schema(extra["response_format"])
        except (GrammarTooComplex, StructuredOutputError) as err:
            said = str(err) if str(err).startswith("response_format") \
                else f"response_format: {err}"  # as the worker's compile errors read
            raise BadLine("unsupported_response_format", said, "response_format") from None
        if forced is not None and schema is not None:  # the worker's rule (grammars.py)
            raise BadLine("invalid_tool_choice", "a tool_choice that forces a call cannot be "
                                                 "combined with response_format: drop one",
                           "tool_choice")


def _check_parallel_tool_calls(value) -> None:
    """parallel_tool_calls is OpenAI's boolean: only `false` keeps an answer to one call, so
    another value (the string "false", 0) would silently keep every call."""
    if value is None or isinstance(value, bool):
        return
    raise BadLine("invalid_request", "parallel_tool_calls must be true or false (or be "
                                     f"dropped), got {type(value).__name__} "
                                     f"{reprlib.repr(value)}", "parallel_tool_calls")


def tokenize_request(parsed: ParsedRequest | EmbeddingRequest, tokenizer: Any,
                     max_context: int, vocab_size: int | None = None,
                     context: str = MODEL_CONTEXT
                     ) -> PendingRequest | EmbeddingRequest | IntakeError:
    """Render (chat template) and tokenize; refuse prompts that leave no room to generate, and
    token ids the model has no embedding or logit for (`vocab_size`: the model's; the smaller
    of it and the tokenizer's bounds every id). `context` names what set `max_context` (the
    model, or "--max-model-len") in the error."""
    vocab = len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)
    bound = vocabulary_bound(len(tokenizer), vocab_size)
    if isinstance(parsed, EmbeddingRequest):
        try:
            return tokenize_embedding(parsed, tokenizer, max_context, vocab, context, bound)
        except EmbeddingLineError as bad:
            return IntakeError(parsed.custom_id, parsed.line, bad.code,
                               f"line {parsed.line}: {bad}", bad.param)
    try:
        ids = _prompt_ids(parsed, tokenizer, max_context)
        # An id past the vocabulary would stop the whole batch's step, not just this line:
        # prompt ids index the embedding, stop ids the logits (min_tokens masks them).
        _check_in_vocabulary("the prompt's token ids", ids, (vocab, bound), "invalid_prompt",
                             "messages" if parsed.kind == "chat" else "prompt")
        _check_in_vocabulary("stop_token_ids", parsed.sampling.stop_token_ids, (vocab, bound),
                             "invalid_sampling_param", "stop_token_ids")
        _check_in_vocabulary("logit_bias token ids", [t for t, _ in parsed.sampling.logit_bias],
                             (vocab, bound), "invalid_sampling_param", "logit_bias")
    except BadLine as bad:
        return IntakeError(parsed.custom_id, parsed.line, bad.code, f"line {parsed.line}: {bad}",
                           bad.param)
    param = "messages" if parsed.kind == "chat" else "prompt"
    if not ids:
        return IntakeError(parsed.custom_id, parsed.line, "invalid_prompt",
                           f"line {parsed.line}: the prompt is empty after tokenization", param)
    if len(ids) >= max_context:
        return IntakeError(parsed.custom_id, parsed.line, "context_length_exceeded",
                           f"line {parsed.line}: the prompt is {len(ids)} tokens but {context} "
                           f"is {max_context} tokens (at least one token must be left to "
                           "generate); shorten the prompt: it is never truncated"
                           + raise_flag(context), param)
    sampling = parsed.sampling.fit_context(max_context - len(ids))
    values = {f.name: getattr(parsed, f.name) for f in fields(ParsedRequest)}
    values["sampling"] = sampling
    return PendingRequest(**values, prompt_token_ids=ids)


def _check_in_vocabulary(what: str, token_ids, limit: tuple[int, str], code: str,
                         param: str) -> None:
    """`limit`: (every id must be below it, what sets it)."""
    if token_ids and max(token_ids) >= limit[0]:  # max: C speed over a long prompt
        raise BadLine(code, f"{what} must be < {limit[0]} ({limit[1]})", param)


def vocabulary_bound(tokenizer_size: int, vocab_size: int | None) -> str:
    """What bounds the token ids a line may use, as its refusal says it: the model's vocab_size
    where its tokenizer has more tokens (then text can tokenize past the model's embeddings,
    which means the tokenizer is not the weights' own), else the tokenizer's size."""
    if vocab_size is None or vocab_size == tokenizer_size:
        return VOCAB_BOUND
    if vocab_size < tokenizer_size:
        return (f"the model's vocab_size; its tokenizer has {tokenizer_size:,} tokens, more than "
                "the model has embeddings for, so text can tokenize past them: check that the "
                "model folder's tokenizer belongs to these weights")
    return f"the tokenizer's {tokenizer_size:,} tokens; the model's vocab_size is {vocab_size:,}"


def _prompt_ids(parsed: ParsedRequest, tokenizer: Any, max_context: int) -> list[int]:
    if parsed.kind == "completion":
        if isinstance(parsed.prompt, list):
            return list(parsed.prompt)  # checked against the vocabulary by the caller
        return list(tokenizer.encode(_fits_context(parsed.prompt, max_context, "prompt")))
    try:
        text = render_chat(parsed.messages, parsed.extra, tokenizer)
    except TemplateError as err:
        raise BadLine(err.code, str(err), err.param) from None
    text = _fits_context(text, max_context, "messages")
    # The template already wrote BOS and other special tokens: do not add them twice.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fits_context(text: str, max_context: int, param: str) -> str:
    """Refuse, untokenized, a text no tokenizer could fit in the context: tokenizing costs
    about a hundred bytes of memory per character, so a huge prompt is never tokenized."""
    if len(text) > max_context * MAX_CHARS_PER_TOKEN:
        raise BadLine("context_length_exceeded",
                       f"the prompt is {len(text)} characters, more than {MAX_CHARS_PER_TOKEN} "
                       f"per token of the model's {max_context}-token context, so it cannot "
                       "fit (it is refused without tokenizing); shorten the prompt", param)
    return text
