"""Fields of an input line that batchgen does not read: a typo of a known field, or a request
field written beside an OpenAI line's `body` instead of inside it, runs with the default. Named
by `batchgen validate` line by line, and summed up by `batchgen run` when it parses the input."""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection
from dataclasses import fields

from batchgen.core import SamplingParams
from batchgen.io.embeddings import EMBEDDING_FIELDS, EMBEDDINGS_URL
from batchgen.io.intake import EXTRA_FIELDS, plain_kind
from batchgen.io.refused_fields import EMBEDDING_REFUSED, REFUSED
from batchgen.io.sampling_fields import BadLine

ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")
REQUEST_FIELDS = frozenset({"messages", "prompt", "max_completion_tokens", "echo", *EXTRA_FIELDS,
                            *(f.name for f in fields(SamplingParams))})
"""Request fields batchgen reads (the body of an OpenAI batch line, or a plain line)."""
IGNORED_FIELDS = frozenset({"model", "user", "stream", "stream_options", "metadata", "store",
                            "service_tier", "prediction", "prompt_cache_key",
                            "safety_identifier"})
"""OpenAI request fields that change nothing in a batch job here: accepted silently (stream
only as false; intake refuses the others)."""
GENERATION_FIELDS = REQUEST_FIELDS | frozenset({*REFUSED, "best_of"})
"""What a chat or completions line may name: the fields read, and those refused at values that
change the answer (accepted silently at their defaults)."""


OTHER_APIS_NAMES = {
    "max_new_tokens": "max_tokens", "max_output_tokens": "max_tokens",
    "num_predict": "max_tokens", "stop_sequences": "stop", "num_return_sequences": "n",
    "candidate_count": "n", "random_seed": "seed",
}
"""Names other APIs give fields batchgen reads (Hugging Face's generate, Anthropic's, Gemini's,
Ollama's, Mistral's), snake_case: the hint names the field meant, which spelling alone
would not find (`stop_sequences` is no near miss of `stop`)."""

_GENERATION_KNOWN = GENERATION_FIELDS | IGNORED_FIELDS
_EMBEDDING_KNOWN = frozenset({*EMBEDDING_FIELDS, *EMBEDDING_REFUSED, *IGNORED_FIELDS})


def unknown_fields(data: dict, limit: int | None = None) -> list[str]:
    """One message per field batchgen does not read (a typo runs with the default), with the
    closest field it does read; the first `limit` of them (a hostile line may hold a million
    keys: each message costs a fuzzy match). A caller that needs no message for a line asks
    has_unknown_fields instead: the fuzzy match costs more than parsing the line."""
    envelope, known, checks = _unread(data)
    messages = []
    for name, where, options in checks[:limit]:
        if envelope and not where and name in known:  # a body field written beside "body"
            messages.append(f"field {name!r} is outside \"body\", where it is ignored: move it "
                            "into \"body\"")
            continue
        close = _meant(name, options)
        hint = f"did you mean {close!r}?" if close else "it is ignored"
        messages.append(f"unknown field {where}{name!r}: {hint}")
    return messages


def has_unknown_fields(data: dict) -> bool:
    """Whether unknown_fields names any field of `data`, without matching them against the
    known fields: cheap enough for every line of a large input."""
    return bool(_unread(data)[2])


def _unread(data: dict) -> tuple[bool, frozenset[str], list[tuple[str, str, Collection[str]]]]:
    """(an OpenAI batch line?, the request fields it may name, (field, where, its options)
    for each field batchgen does not read)."""
    envelope = any(k in data for k in ENVELOPE_FIELDS[1:])  # an OpenAI batch line
    embedding = (data.get("url") == EMBEDDINGS_URL if envelope
                 else _plain_kind_of(data) == "embedding")
    known = _EMBEDDING_KNOWN if embedding else _GENERATION_KNOWN
    if envelope:
        body = data.get("body")
        checks = [(k, "", ENVELOPE_FIELDS) for k in data if k not in ENVELOPE_FIELDS]
        checks += [(k, "body.", known) for k in (body if isinstance(body, dict) else ())
                   if k not in known]
    else:
        options = known | {"custom_id"}
        checks = [(k, "", options) for k in data if k not in options]
    return envelope, known, checks


def _meant(name: str, options) -> str | None:
    """The field of `options` that `name` most likely means: its snake_case spelling
    (`topP`, `maxTokens`: Gemini and JavaScript clients write camelCase), another API's name
    for it (OTHER_APIS_NAMES), else the closest spelling; None when nothing is close."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    for candidate in (snake, OTHER_APIS_NAMES.get(snake)):
        if candidate in options:
            return candidate
    close = difflib.get_close_matches(name, sorted(options), 1, 0.7)
    return close[0] if close else None


def _plain_kind_of(data: dict) -> str | None:
    """A plain line's kind (intake's rule), None when it is not a valid one."""
    try:
        return plain_kind(data)
    except BadLine:
        return None
