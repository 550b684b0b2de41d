"""Output parsing: split a finished completion into reasoning, content and tool calls.

Everything here works on the completion text after generation has stopped (batchgen never
streams), decoded with special tokens kept (``Detokenizer.markup``, batchgen/detokenizer.py) so
the markers below survive, and without the stop token itself. Nothing here raises on model
output: a block that cannot be parsed stays in ``content``.

Reasoning styles (``parse_reasoning``):

- ``deepseek_r1``: the chat template ends the prompt with ``<think>\\n``, so the output usually
  starts inside the block and only contains ``</think>``. No ``</think>`` at all means generation
  stopped while thinking (max_tokens): all of it is reasoning. Note that DeepSeek-V3 (non-R1)
  shares model_type ``deepseek_v3``; enable reasoning parsing only for thinking checkpoints.
- ``qwen3`` / ``think`` (generic): ``<think>...</think>`` is emitted by the model. No tags means
  no reasoning; ``<think>`` without ``</think>`` is unterminated thinking; an empty block
  (``<think>\\n\\n</think>``, thinking disabled) gives reasoning None. A lone ``</think>``
  (Qwen3 *-Thinking-2507 templates open the block in the prompt) splits like deepseek_r1.
- ``harmony`` (gpt-oss): a sequence of messages, e.g.
  ``<|channel|>analysis<|message|>...<|end|>``
  ``<|start|>assistant<|channel|>final<|message|>...<|return|>``.
  analysis -> reasoning; final, and commentary without a recipient (preambles) -> content;
  messages with a recipient (``to=functions.NAME``) are tool calls (tool parser ``harmony``).

Tool-call formats (``parse_tool_calls``):

- ``hermes`` (Qwen2/2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  repeated; the last one may lack ``</tool_call>`` if its JSON is complete.
- ``deepseek_v3`` (DeepSeek-V3/R1), one block per call inside
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` (the bars are U+FF5C, the spaces U+2581):
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``;
  V3.1 drops the type and the fence:
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.
- ``llama3_json`` (Llama 3.x): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``; an object without
  ``parameters`` or ``arguments`` is a JSON answer, not a call.
- ``harmony`` (gpt-oss): see above; the body of a message to ``functions.NAME`` is the arguments.

Each call becomes an OpenAI tool call ``{"id": "call_<24 hex>", "type": "function",
"function": {"name", "arguments": <JSON string>}}``. Ids are a hash of the text and the call
index, so a recomputed (resumed) request gets the same ids. If any call is malformed (bad or
non-strict JSON such as NaN, nesting past Python's stack, a lone surrogate, no name, arguments
not an object), the whole original text is returned as content with no calls:
a half-parsed message would silently lose what the model said.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from batchgen.detokenizer import Detokenizer

REASONING_STYLES = ("deepseek_r1", "qwen3", "think", "harmony")
TOOL_PARSERS = ("hermes", "deepseek_v3", "llama3_json", "harmony")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(slots=True)
class ParsedMessage:
    """What the result writer puts into ``choices[i].message``."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


class _Malformed(Exception):
    """A tool-call block that cannot be turned into a call; never escapes this module."""


def _clean(text: str | None) -> str | None:
    """Strip whitespace; an empty result is None (OpenAI's 'no content')."""
    text = (text or "").strip()
    return text or None


def _model_key(model_type: str) -> str:
    # Accept both HF model_type ("qwen3_moe") and architecture names ("Qwen3MoeForCausalLM").
    return re.sub(r"[^a-z0-9]", "", model_type.lower())


# ---------------------------------------------------------------------------------------------
# Picking a style / parser from the model


def reasoning_style_for(model_type: str, override: str | None = None) -> str | None:
    """Reasoning style for an HF model_type or architecture name.

    ``override`` wins; "none" turns reasoning parsing off.
    """
    if override is not None:
        return _checked(override, REASONING_STYLES)
    key = _model_key(model_type)
    if key.startswith("deepseekv3"):
        return "deepseek_r1"
    if key.startswith("qwen3"):
        return "qwen3"
    if key.startswith("gptoss"):
        return "harmony"
    return "think"


def tool_parser_for(model_type: str, override: str | None = None) -> str | None:
    """Tool-call parser for a model; None when we know no format for it. ``override`` wins."""
    if override is not None:
        return _checked(override, TOOL_PARSERS)
    key = _model_key(model_type)
    if key.startswith(("qwen2", "qwen3")):
        return "hermes"
    if key.startswith("deepseekv3"):
        return "deepseek_v3"
    if key.startswith("llama"):
        return "llama3_json"
    if key.startswith("gptoss"):
        return "harmony"
    return None


def _checked(name: str, choices: tuple[str, ...]) -> str | None:
    if name == "none":
        return None
    if name not in choices:
        raise ValueError(f"unknown parser {name!r}; choose one of {', '.join(choices)} or 'none'")
    return name


# ---------------------------------------------------------------------------------------------
# Reasoning


def parse_reasoning(text: str, style: str) -> tuple[str | None, str | None]:
    """Split ``text`` into (reasoning, content) for one of ``REASONING_STYLES``."""
    if style == "harmony":
        reasoning, content, _ = _harmony_split(text)
        return reasoning, content
    if style not in REASONING_STYLES:
        raise ValueError(f"unknown reasoning style {style!r}; choose one of {REASONING_STYLES}")
    return _split_think(text, opened_in_prompt=(style == "deepseek_r1"))


def _split_think(text: str, opened_in_prompt: bool) -> tuple[str | None, str | None]:
    first_close = text.find(THINK_CLOSE)
    if first_close >= 0 and not 0 <= text.find(THINK_OPEN) < first_close:
        # The prompt opened the block: what follows the first close is the answer, whatever
        # tags the answer mentions.
        return _clean(text[:first_close]), _clean(text[first_close + len(THINK_CLOSE):])
    start = text.find(THINK_OPEN)
    end = text.find(THINK_CLOSE, start + 1 if start >= 0 else 0)
    before = text[:start] if start >= 0 else ""  # text the model wrote before <think>, if any
    inside_from = start + len(THINK_OPEN) if start >= 0 else 0
    if end >= 0:
        content = _clean(before + text[end + len(THINK_CLOSE) :])
        return _clean(text[inside_from:end]), content
    if start >= 0:  # opened, never closed: max_tokens hit while thinking
        return _clean(text[inside_from:]), None
    if opened_in_prompt:  # the prompt opened the block and the model never left it
        return _clean(text), None
    return None, text


def count_reasoning_tokens(token_ids: list[int], detokenizer: Detokenizer, style: str) -> int:
    """Completion tokens spent on reasoning (OpenAI's ``reasoning_tokens``).

    Exact for the think styles when ``</think>`` is one token (Qwen3, DeepSeek-R1): the tokens up
    to and including it. Unterminated thinking counts every token. Otherwise (harmony, or a
    tokenizer that splits ``</think>``) the reasoning text is re-tokenized, which may differ from
    the generated count by a few tokens at the block edges and omits the message headers.
    """
    text = detokenizer.markup(token_ids)
    tokenizer = detokenizer.tokenizer  # re-tokenizing the reasoning text, below
    reasoning, content = parse_reasoning(text, style)
    if reasoning is None:
        return 0
    if content is None:
        return len(token_ids)
    if style != "harmony":
        close_ids = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        if len(close_ids) == 1 and close_ids[0] in token_ids:
            return token_ids.index(close_ids[0]) + 1
    return len(tokenizer.encode(reasoning, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# Harmony (gpt-oss)

_HARMONY_HEADER_END = "<|message|>"
_HARMONY_BODY_END = re.compile(r"<\|(?:end|return|call)\|>")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _harmony_messages(text: str) -> list[tuple[str, str | None, str]]:
    """(channel, recipient, body) per message; a message cut off by max_tokens keeps its body."""
    messages = []
    for chunk in text.split("<|start|>"):
        header, sep, rest = chunk.partition(_HARMONY_HEADER_END)
        if not sep:
            continue  # a header without body (cut off), or stray text between messages
        channel = _HARMONY_CHANNEL.search(header)
        recipient = _HARMONY_RECIPIENT.search(header)
        end = _HARMONY_BODY_END.search(rest)
        messages.append(
            (
                channel.group(1) if channel else "final",
                recipient.group(1) if recipient else None,
                rest[: end.start()] if end else rest,
            )
        )
    return messages


def _harmony_split(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, [(recipient, body)]) of a harmony completion."""
    if _HARMONY_HEADER_END not in text:
        return None, text, []  # no harmony markup (e.g. decoded without special tokens)
    reasoning, content, calls = [], [], []
    for channel, recipient, body in _harmony_messages(text):
        if recipient is not None:
            calls.append((recipient, body))
        elif channel == "analysis":
            reasoning.append(body.strip())
        else:  # final, and commentary preambles meant for the user
            content.append(body.strip())
    return _clean("\n\n".join(reasoning)), _clean("\n\n".join(content)), calls


# ---------------------------------------------------------------------------------------------
# Tool calls


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """Return (content, tool_calls). No calls found or a malformed call: (text unchanged, [])."""
    if parser not in _TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; choose one of {TOOL_PARSERS}")
    try:
        content, raw_calls = _TOOL_PARSERS[parser](text)
        calls = [_openai_call(text, i, name, args) for i, (name, args) in enumerate(raw_calls)]
    except _Malformed:
        return text, []
    if not calls:
        return text, []
    return _clean(content), calls


def _openai_call(text: str, index: int, name, arguments) -> dict:
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("tool call without a name")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models emit arguments as an already-encoded string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        raise _Malformed("tool call arguments are not a JSON object")
    digest = hashlib.sha256(f"{index}\x00{text}".encode()).hexdigest()[:24]
    try:  # strict JSON (no NaN / Infinity), and text that UTF-8 can carry (no lone surrogate)
        encoded = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        encoded.encode("utf-8"), name.encode("utf-8")
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise _Malformed(f"tool call arguments are not valid JSON: {exc}") from None
    return {
        "id": f"call_{digest}",
        "type": "function",
        "function": {"name": name.strip(), "arguments": encoded},
    }


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
"""Python's JSON reader, minus its NaN / Infinity extensions."""


def _loads(payload: str):
    try:
        return _DECODER.decode(payload)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise _Malformed(str(exc)) from None


def _name_and_args(obj, arguments_required: bool = False) -> tuple:
    """(name, arguments) of a ``{"name", "arguments"|"parameters"}`` object. With
    `arguments_required` (a bare JSON answer may be a call or just JSON) an object without
    either key is no call."""
    if not isinstance(obj, dict):
        raise _Malformed("tool call is not a JSON object")
    if arguments_required and "arguments" not in obj and "parameters" not in obj:
        raise _Malformed("JSON without arguments or parameters: an answer, not a call")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return obj.get("name"), args


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _hermes(text: str) -> tuple[str, list[tuple]]:
    # Each call's JSON is read whole before its </tool_call> is looked for: a string argument
    # may itself hold "</tool_call>" (a forced call's grammar allows any string).
    content, calls, pos = [], [], 0
    while (start := text.find(_HERMES_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(_HERMES_OPEN)
        begin = len(text) - len(text[body:].lstrip())
        try:
            obj, end = _DECODER.raw_decode(text, begin)
        except (ValueError, RecursionError):  # not one JSON value: the old, lenient reading
            match = _HERMES_CALL.match(text, start)
            calls.append(_name_and_args(_loads(match.group(1).strip())))
            pos = match.end()
            continue
        calls.append(_name_and_args(obj))
        rest = len(text) - len(text[end:].lstrip())
        if text.startswith(_HERMES_CLOSE, rest):
            pos = rest + len(_HERMES_CLOSE)
        elif rest == len(text):
            pos = rest  # the last call may lack </tool_call>
        else:
            raise _Malformed("text after a tool call's JSON inside <tool_call>")
    content.append(text[pos:])
    return "".join(content), calls


_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL
)
# V3: "NAME\n```json\n{...}\n```" after the separator; the type ("function") comes before it.
_DS_V3_BODY = re.compile(r"\s*([^\n]+)\n```(?:json)?\s*\n(.*)\n```\s*\Z", re.DOTALL)


def _deepseek_v3(text: str) -> tuple[str, list[tuple]]:
    first = text.find(_DS_CALLS_BEGIN)
    if first < 0:
        first = text.find(_DS_CALL_BEGIN)
    if first < 0:
        return text, []
    matches = list(_DS_CALL.finditer(text))
    if not matches or len(matches) != text.count(_DS_CALL_BEGIN):
        raise _Malformed("unterminated DeepSeek tool call")  # cut off by max_tokens
    calls = []
    for match in matches:
        v3 = _DS_V3_BODY.match(match.group(2))
        if v3:
            calls.append((v3.group(1), _loads(v3.group(2))))
        else:  # V3.1: NAME<｜tool▁sep｜>{...}
            calls.append((match.group(1), _loads(match.group(2).strip())))
    end = text.rfind(_DS_CALLS_END)
    tail = text[end + len(_DS_CALLS_END) :] if end >= 0 else text[matches[-1].end() :]
    return text[:first] + tail, calls


_LLAMA_TAG = "<|python_tag|>"
_LLAMA_SEP = re.compile(r"\s*(;\s*)?")  # calls are separated by ";"


def _llama3_json(text: str) -> tuple[str, list[tuple]]:
    head, tag, body = text.partition(_LLAMA_TAG)
    if not tag:
        if not text.lstrip().startswith("{"):
            return text, []  # plain prose answer
        head, body = "", text
    objs, pos, body = [], 0, body.strip()
    while pos < len(body):
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:
            raise _Malformed(str(exc)) from None
        objs.append(_name_and_args(obj, arguments_required=True))
        sep = _LLAMA_SEP.match(body, pos)
        if sep.group(1) is None and sep.end() < len(body):
            raise _Malformed("text after a Llama tool call")
        pos = sep.end()
    return head, objs


def _harmony_tools(text: str) -> tuple[str | None, list[tuple]]:
    _, content, messages = _harmony_split(text)
    calls = []
    for recipient, body in messages:
        name = recipient.removeprefix("functions.")
        calls.append((name, _loads(body.strip() or "{}")))
    return content, calls


_TOOL_PARSERS = {
    "hermes": _hermes,
    "deepseek_v3": _deepseek_v3,
    "llama3_json": _llama3_json,
    "harmony": _harmony_tools,
}


# ---------------------------------------------------------------------------------------------
# Both


def parse_output(
    text: str, *, reasoning_style: str | None = None, tool_parser: str | None = None
) -> ParsedMessage:
    """Reasoning first, then tool calls from what is left (calls inside thinking are ignored).

    With neither option the text comes back unchanged as content. Harmony tool calls are
    separate messages, so that parser reads the whole text rather than the final content.
    """
    reasoning, content = (None, text)
    if reasoning_style is not None:
        reasoning, content = parse_reasoning(text, reasoning_style)
    if tool_parser is None:
        return ParsedMessage(content=content, reasoning=reasoning)
    if tool_parser == "harmony":
        tool_content, calls = parse_tool_calls(text, "harmony")
        if calls or _harmony_split(text)[2]:  # calls, or a malformed call: keep the tool view
            content = tool_content
        elif reasoning_style is None:  # no call: the answer is the final channel, as with one
            content = _harmony_split(text)[1]
        return ParsedMessage(content=content, reasoning=reasoning, tool_calls=calls)
    if content is None:  # unterminated thinking: there is no answer to look for calls in
        return ParsedMessage(content=None, reasoning=reasoning)
    content, calls = parse_tool_calls(content, tool_parser)
    return ParsedMessage(content=content, reasoning=reasoning, tool_calls=calls)
