"""Finished request -> OpenAI batch result line, with reasoning / tool-call parsing when asked;
and whether final output files hold this job's lines."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import orjson

from batchgen.core import FinishedRequest
from batchgen.detokenizer import Detokenizer
from batchgen.io.intake import PendingRequest
from batchgen.io.parsers import (THINK_CLOSE, THINK_OPEN, count_reasoning_tokens, parse_output,
                                 reasoning_style_for, tool_parser_for)
from batchgen.io.results import ParsedChoice, item_id, success_line
from batchgen.request_checks import forces_call, grammar_constrained, json_response_format

log = logging.getLogger("batchgen.worker")


class OutputFormatter:
    def __init__(self, spec, loaded):
        self.spec = spec
        self.model_name = loaded.name
        out = spec.config.output
        model_type = getattr(loaded.hf_config, "model_type", "") or ""
        self.reasoning_style = reasoning_style_for(model_type) if out.parse_thinking else None
        override = None if out.tool_call_parser == "auto" else out.tool_call_parser
        self.tool_format = tool_parser_for(model_type, override)
        """The model's tool-call format: forced calls (tool_choice) are generated in it and
        parsed from it even without --parse-tool-call."""
        self.tool_parser = self.tool_format if out.parse_tool_call else None
        self.reasoning_field = out.reasoning_field
        self.detokenizer = Detokenizer(loaded.tokenizer,
                                       not out.detokenization_include_special_tokens)
        """Names logprobs' tokens and decodes texts as the engine decodes the choices'."""
        self._unparsed_noted = False
        """Whether a line whose tool calls stay text (no --parse-tool-call) was logged."""

    def success(self, pending: PendingRequest, finished: FinishedRequest) -> dict:
        parsed = None
        # OpenAI's rule: tool calls only for a line that gives tools and lets the model call
        # them (tool_choice "none" forbids it; a forced call is parsed even without the flag).
        # An answer a JSON response_format's grammar wrote is that JSON, never a call (a
        # schema with "name" and "arguments" would read as one).
        free = (pending.extra.get("tools") and pending.extra.get("tool_choice") != "none"
                and not json_response_format(pending.extra))
        forced = forces_call(pending.extra)
        tools = self.tool_format if forced else self.tool_parser if free else None
        if free and not forced and tools is None and not self._unparsed_noted:
            self._unparsed_noted = True
            log.warning("line %d gives tools the model may call, but without "
                        "--parse-tool-call the calls it writes stay text in message.content "
                        "(OpenAI returns them in tool_calls): start the job again with "
                        "--parse-tool-call (a new --batch-id) to parse them; said once",
                        pending.line)
        style = self._reasoning_style(pending) if pending.kind == "chat" else None
        if pending.kind == "chat" and (style or tools):
            parsed = [self._parse(c, tools, style) for c in finished.completions]
            if pending.extra.get("parallel_tool_calls") is False:  # OpenAI: at most one call
                parsed = [replace(p, tool_calls=p.tool_calls[:1]) if p.tool_calls else p
                          for p in parsed]
        return success_line(pending, finished, batch_id=self.spec.batch_id, model=self.model_name,
                            created=self.spec.created,
                            system_fingerprint=self.spec.system_fingerprint,
                            decode_token=self.detokenizer.label,
                            split_text=self.detokenizer.split_unfinished,
                            parsed=parsed, reasoning_field=self.reasoning_field)

    def _reasoning_style(self, pending: PendingRequest) -> str | None:
        """The reasoning style of this line's answers. A grammar (a forced tool call, a JSON
        response_format) constrains the answer from its first token: it holds no reasoning,
        whatever block the prompt opened. Otherwise the end of the rendered prompt says where
        the answer starts: after an opened <think> (Qwen3-Thinking-2507, DeepSeek-R1 and its
        distills) all up to </think>, or all of a cut-off answer, is reasoning; after a closed
        one (DeepSeek-V3.1 without thinking) an answer without tags is all content."""
        style = self.reasoning_style
        if style is None or style == "harmony":
            return style
        if grammar_constrained(pending.extra):
            return None
        tail = self.detokenizer.markup(pending.prompt_token_ids[-8:]).rstrip()
        if tail.endswith(THINK_OPEN):
            return "deepseek_r1"
        if tail.endswith(THINK_CLOSE) and style == "deepseek_r1":
            return "think"
        return style

    def _parse(self, completion, tool_parser: str | None, style: str | None) -> ParsedChoice:
        text = completion.text or ""
        if "harmony" in (style, tool_parser):
            # Harmony's channel markers are special tokens: parse the text that keeps them.
            text = self.detokenizer.markup(completion.token_ids)
        message = parse_output(text, reasoning_style=style, tool_parser=tool_parser)
        tokens = 0
        if style and message.reasoning:
            tokens = count_reasoning_tokens(completion.token_ids, self.detokenizer, style)
        return ParsedChoice(message.content, message.reasoning, message.tool_calls or None, tokens)


def outputs_belong_to(batch_id: str, *files: Path) -> bool:
    """Whether every line of `files` is a result of batch `batch_id` (each line's id is derived
    from the batch id and its custom_id): another job that wrote the same --output, or a file
    edited by hand, makes the job's final files be merged again rather than called complete."""
    for path in files:
        try:
            with open(path, "rb") as f:
                for raw in f:
                    try:
                        line = orjson.loads(raw)
                        ours = line["id"] == item_id(batch_id, line["custom_id"])
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        ours = False
                    if not ours:
                        return False
        except FileNotFoundError:
            return False
    return True
