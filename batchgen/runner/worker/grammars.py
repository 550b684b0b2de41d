"""Structured outputs for the worker: compile a request's `response_format`, or the tool call a
`tool_choice` forces, once per schema."""

from __future__ import annotations

from collections import OrderedDict

import orjson

from batchgen.core import Request
from batchgen.io.intake import IntakeError, PendingRequest
from batchgen.engine.tool_choice import forced_functions, tool_call_grammar

GRAMMAR_CACHE_BYTES = 512 << 20
"""Most memory the compiled grammars kept for reuse may hold (xgrammar's own measure of each;
one is ~2 MB with a 49k-token vocabulary). A file whose lines each carry their own schema would
otherwise grow the worker by that much per line until it is killed; past the bound the least
recently used grammar is dropped (requests that hold it keep it) and compiled again if asked."""


class Grammars:
    """Turns PendingRequests into engine Requests, with a compiled grammar when asked for.
    `tool_parser`: the tool-call format of the model's answers (parsers.tool_parser_for)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids,
                 tool_parser: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.tool_parser = tool_parser
        self._compiler = None
        self._cache: OrderedDict[bytes, object] = OrderedDict()
        self._cached_bytes = 0

    def request(self, item: PendingRequest) -> Request | IntakeError:
        response_format = item.extra.get("response_format")
        try:
            functions = forced_functions(item.extra.get("tools"), item.extra.get("tool_choice"))
        except ValueError as err:
            return IntakeError(item.custom_id, item.line, "invalid_tool_choice",
                               f"line {item.line}: {err}", "tool_choice")
        if functions is not None:
            return self._forced_call(item, functions, response_format)
        if not response_format:
            return item.to_request()
        try:
            # orjson refuses nesting past 254 levels (a TypeError), as the compiler would.
            grammar = self._cached(grammar_key(response_format),
                                   lambda: self._compile(response_format))
        except (ValueError, TypeError, RecursionError) as err:  # StructuredOutputError: ValueError
            return IntakeError(item.custom_id, item.line, "unsupported_response_format",
                               f"line {item.line}: response_format: {err}", "response_format")
        request = item.to_request()
        request.grammar = grammar
        return request

    def _forced_call(self, item: PendingRequest, functions: list[dict],
                     response_format) -> Request | IntakeError:
        if response_format and response_format.get("type") != "text":
            return IntakeError(item.custom_id, item.line, "invalid_tool_choice",
                               f"line {item.line}: a tool_choice that forces a call cannot be "
                               "combined with response_format: drop one", "tool_choice")
        try:
            grammar = self._cached(grammar_key([self.tool_parser, functions]),
                                   lambda: self._compiler_().compile_grammar(
                                       tool_call_grammar(functions, self.tool_parser)))
        except (ValueError, TypeError, RecursionError) as err:
            # A schema in tools the grammar engine refuses names tools; a format that cannot
            # be forced names tool_choice.
            param = "tool_choice" if str(err).startswith("tool_choice") else "tools"
            return IntakeError(item.custom_id, item.line, "invalid_tool_choice",
                               f"line {item.line}: {err}", param)
        request = item.to_request()
        request.grammar = grammar
        return request

    def _cached(self, key: bytes, build):
        """The compiled grammar under `key`, built by `build()` when not kept; the cache stays
        within GRAMMAR_CACHE_BYTES, dropping the least recently used (never the newest)."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        grammar = self._cache[key] = build()
        self._cached_bytes += grammar_bytes(grammar)
        while self._cached_bytes > GRAMMAR_CACHE_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= grammar_bytes(dropped)
        return grammar

    def _compiler_(self):
        if self._compiler is None:
            from batchgen.engine.structured import GrammarCompiler  # xgrammar loads only if used

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             stop_token_ids=self.stop_token_ids)
        return self._compiler

    def _compile(self, response_format):
        return self._compiler_().compile(response_format)


def grammar_bytes(grammar) -> int:
    """The memory a CompiledGrammar holds, as xgrammar measures it (0 for None: plain text)."""
    return 0 if grammar is None else grammar.grammar.memory_size_bytes


def grammar_key(spec) -> bytes:
    """The cache key of a grammar's spec: its JSON with keys in the order written, since the
    grammar generates an object's properties in the order its schema lists them (sorted keys
    would hand a line the order of an earlier line's otherwise equal schema)."""
    return orjson.dumps(spec)
