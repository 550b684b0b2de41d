"""Structured outputs for the worker: compile a request's `response_format` once per schema."""

from __future__ import annotations

import orjson

from batchgen.core import Request
from batchgen.io.intake import IntakeError, PendingRequest


class Grammars:
    """Turns PendingRequests into engine Requests, with a compiled grammar when asked for."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._cache: dict[bytes, object] = {}

    def request(self, item: PendingRequest) -> Request | IntakeError:
        response_format = item.extra.get("response_format")
        if not response_format:
            return item.to_request()
        try:
            # orjson refuses nesting past 254 levels (a TypeError), as the compiler would.
            key = orjson.dumps(response_format, option=orjson.OPT_SORT_KEYS)
            if key not in self._cache:
                self._cache[key] = self._compile(response_format)
        except (ValueError, TypeError, RecursionError) as err:  # StructuredOutputError: ValueError
            return IntakeError(item.custom_id, item.line, "unsupported_response_format",
                               f"line {item.line}: response_format: {err}")
        request = item.to_request()
        request.grammar = self._cache[key]
        return request

    def _compile(self, response_format):
        if self._compiler is None:
            from batchgen.engine.structured import GrammarCompiler  # xgrammar loads only if used

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             stop_token_ids=self.stop_token_ids)
        return self._compiler.compile(response_format)
