"""Finished request -> OpenAI batch result line, with reasoning / tool-call parsing when asked;
and whether final output files hold this job's lines."""

from __future__ import annotations

from pathlib import Path

import orjson

from batchgen.core import FinishedRequest
from batchgen.detokenizer import Detokenizer
from batchgen.io.intake import PendingRequest
from batchgen.io.parsers import (count_reasoning_tokens, parse_output, reasoning_style_for,
                                 tool_parser_for)
from batchgen.io.results import ParsedChoice, item_id, success_line
from batchgen.engine.tool_choice import forces_call


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

    def success(self, pending: PendingRequest, finished: FinishedRequest) -> dict:
        parsed = None
        # OpenAI's rule: tool calls only for a line that gives tools and lets the model call
        # them (tool_choice "none" forbids it; a forced call is parsed even without the flag).
        free = pending.extra.get("tools") and pending.extra.get("tool_choice") != "none"
        tools = (self.tool_format if forces_call(pending.extra)
                 else self.tool_parser if free else None)
        if pending.kind == "chat" and (self.reasoning_style or tools):
            parsed = [self._parse(c, tools) for c in finished.completions]
        return success_line(pending, finished, batch_id=self.spec.batch_id, model=self.model_name,
                            created=self.spec.created, decode_token=self.detokenizer.label,
                            decode_text=self.detokenizer.text,
                            parsed=parsed, reasoning_field=self.reasoning_field)

    def _parse(self, completion, tool_parser: str | None) -> ParsedChoice:
        text = completion.text or ""
        if "harmony" in (self.reasoning_style, tool_parser):
            # Harmony's channel markers are special tokens: parse the text that keeps them.
            text = self.detokenizer.markup(completion.token_ids)
        message = parse_output(text, reasoning_style=self.reasoning_style,
                               tool_parser=tool_parser)
        tokens = 0
        if self.reasoning_style and message.reasoning:
            tokens = count_reasoning_tokens(completion.token_ids, self.detokenizer,
                                            self.reasoning_style)
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
