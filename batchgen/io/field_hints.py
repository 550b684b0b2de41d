"""Fields of an input line that batchgen does not read: a typo of a known field, or a request
field written beside an OpenAI line's `body` instead of inside it, runs with the default. Named
by `batchgen validate` line by line, and summed up by `batchgen run` when it parses the input."""

from __future__ import annotations

import difflib
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


_GENERATION_KNOWN = GENERATION_FIELDS | IGNORED_FIELDS
_EMBEDDING_KNOWN = frozenset({*EMBEDDING_FIELDS, *EMBEDDING_REFUSED, *IGNORED_FIELDS})


def unknown_fields(data: dict, limit: int | None = None) -> list[str]:
    """One message per field batchgen does not read (a typo runs with the default), with the
    closest field it does read; the first `limit` of them (a hostile line may hold a million
    keys: each message costs a fuzzy match). Cheap for a line without any: `batchgen run`
    asks of each."""
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
        checks = [(k, "", known | {"custom_id"}) for k in data
                  if k not in known and k != "custom_id"]
    messages = []
    for name, where, options in checks[:limit]:
        if envelope and not where and name in known:  # a body field written beside "body"
            messages.append(f"field {name!r} is outside \"body\", where it is ignored: move it "
                            "into \"body\"")
            continue
        close = difflib.get_close_matches(name, sorted(options), 1, 0.7)
        hint = f"did you mean {close[0]!r}?" if close else "it is ignored"
        messages.append(f"unknown field {where}{name!r}: {hint}")
    return messages


def _plain_kind_of(data: dict) -> str | None:
    """A plain line's kind (intake's rule), None when it is not a valid one."""
    try:
        return plain_kind(data)
    except BadLine:
        return None
