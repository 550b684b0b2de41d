"""Structured outputs for the worker: compile a request's `response_format`, or the tool call a
`tool_choice` forces, once per schema."""

from __future__ import annotations

import orjson

from batchgen.core import Request
from batchgen.io.intake import IntakeError, PendingRequest
from batchgen.engine.tool_choice import forced_functions, tool_call_grammar


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
        self._cache: dict[bytes, object] = {}

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
            key = grammar_key(response_format)
            if key not in self._cache:
                self._cache[key] = self._compile(response_format)
        except (ValueError, TypeError, RecursionError) as err:  # StructuredOutputError: ValueError
            return IntakeError(item.custom_id, item.line, "unsupported_response_format",
                               f"line {item.line}: response_format: {err}", "response_format")
        request = item.to_request()
        request.grammar = self._cache[key]
        return request

    def _forced_call(self, item: PendingRequest, functions: list[dict],
                     response_format) -> Request | IntakeError:
        if response_format and response_format.get("type") != "text":
            return IntakeError(item.custom_id, item.line, "invalid_tool_choice",
                               f"line {item.line}: a tool_choice that forces a call cannot be "
                               "combined with response_format: drop one", "tool_choice")
        try:
            key = grammar_key([self.tool_parser, functions])
            if key not in self._cache:
                grammar = tool_call_grammar(functions, self.tool_parser)
                self._cache[key] = self._compiler_().compile_grammar(grammar)
        except (ValueError, TypeError, RecursionError) as err:
            # A schema in tools the grammar engine refuses names tools; a format that cannot
            # be forced names tool_choice.
            param = "tool_choice" if str(err).startswith("tool_choice") else "tools"
            return IntakeError(item.custom_id, item.line, "invalid_tool_choice",
                               f"line {item.line}: {err}", param)
        request = item.to_request()
        request.grammar = self._cache[key]
        return request

    def _compiler_(self):
        if self._compiler is None:
            from batchgen.engine.structured import GrammarCompiler  # xgrammar loads only if used

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             stop_token_ids=self.stop_token_ids)
        return self._compiler

    def _compile(self, response_format):
        return self._compiler_().compile(response_format)


def grammar_key(spec) -> bytes:
    """The cache key of a grammar's spec: its JSON with keys in the order written, since the
    grammar generates an object's properties in the order its schema lists them (sorted keys
    would hand a line the order of an earlier line's otherwise equal schema)."""
    return orjson.dumps(spec)
