"""Chat templates rendered as untrusted code: the model folder's template runs in transformers'
sandboxed jinja environment, within a time limit and an output-size limit, so a template that
loops, grows without end or raises becomes one line's error, never a stuck or dead job. A
line's own text holding a special token's text is said once (SpecialTextNote)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import threading
from typing import Any

log = logging.getLogger("batchgen.intake")

TEMPLATE_TIMEOUT_S = 10.0
"""Longest a chat template may render one line (the model folder's template is foreign code)."""
MAX_RENDERED_CHARS = 64 << 20
"""Longest text a chat template may render for one line."""
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize",
                             "add_generation_prompt", "chat_template", "return_dict"}


class TemplateError(ValueError):
    """A line's chat template failed, looped, grew too large, or ignored its tools."""

    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code, self.param = code, param


class TemplateTimeout(Exception):
    """A chat template ran past TEMPLATE_TIMEOUT_S."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise TemplateTimeout in this code after `seconds` (an interval timer: main thread
    only; elsewhere no limit applies, as in `batchgen validate`'s threads there are none)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat(messages: list[dict], extra: dict, tokenizer: Any) -> str:
    """The prompt text of a chat request (transformers renders it in a sandboxed jinja env,
    within TEMPLATE_TIMEOUT_S and MAX_RENDERED_CHARS: a template that loops or grows without
    end becomes this line's template_error). Tools the template does not render (the text is
    the same without them) are refused: the model would answer without ever seeing them."""
    tools = extra.get("tools")
    messages = _developer_as_system(messages, tokenizer)
    decoded = _decoded_arguments(messages)
    try:
        text = _render(decoded, extra, tokenizer, tools)
        messages = decoded
    except TemplateError:
        if decoded is messages:
            raise
        # A template that concatenates the arguments as text (DeepSeek-V3's) wants the string.
        text = _render(messages, extra, tokenizer, tools)
    if tools and text == _render(messages, extra, tokenizer, None):
        raise TemplateError("unsupported_tools",
                            "this model's chat template does not render tools, so the model "
                            "would never see them: drop \"tools\" or use a model whose template "
                            "supports tool use", "tools")
    _check_tool_calls_rendered(text, messages, extra, tokenizer, tools)
    effort = extra.get("reasoning_effort")
    if effort is not None and text == _render(
            messages, {**extra, "reasoning_effort": "low" if effort != "low" else "high"},
            tokenizer, tools):
        raise TemplateError("invalid_request",
                            f"this model's chat template does not read reasoning_effort, so "
                            f"{effort!r} would change nothing: drop it or use a reasoning model "
                            "whose template reads it (gpt-oss)", "reasoning_effort")
    return text


def _check_tool_calls_rendered(text: str, messages: list[dict], extra: dict, tokenizer: Any,
                               tools) -> None:
    """Refuse earlier assistant `tool_calls` the template does not render (the prompt is the
    same without them, as SmolLM2's, which writes only `content`): the model would read an
    empty assistant turn and a tool result answering nothing, as it does tools it never saw."""
    calls = [i for i, m in enumerate(messages)
             if m.get("role") == "assistant" and m.get("tool_calls")]
    if not calls:
        return
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} if i in calls else m
            for i, m in enumerate(messages)]
    try:
        same = text == _render(bare, extra, tokenizer, tools)
    except TemplateError:  # a template that needs the calls reads them
        return
    if same:
        raise TemplateError("unsupported_tools",
                            f"this model's chat template does not render the tool_calls of "
                            f"messages[{calls[0]}], so the model would never see them: write the "
                            "calls into that message's content, or use a model whose template "
                            "supports tool use", f"messages[{calls[0]}].tool_calls")


DEVELOPER_ROLE = re.compile(r"""['"]developer['"]""")
"""How a template that handles the developer role names it (`role == 'developer'`)."""


def _developer_as_system(messages: list[dict], tokenizer: Any) -> list[dict]:
    """OpenAI's `developer` role is its `system` role under a newer name: a template that never
    names it gets it as `system` (Qwen3's drops an unknown role, ChatML templates render a
    header the model never saw and add their default system prompt before it)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    template = getattr(tokenizer, "chat_template", None)
    if DEVELOPER_ROLE.search(str(template or "")):  # the role's name quoted: a comparison
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _decoded_arguments(messages: list[dict]) -> list[dict]:
    """`messages` with each assistant tool call's `arguments` (OpenAI's JSON string) as the
    object it encodes, as vLLM and transformers hand them to templates: Llama 3.1's and
    Qwen2.5's templates write `arguments | tojson`, which would encode a string a second time.
    Arguments that are not a JSON object stay as they are. `messages` itself when none
    changes."""
    out = messages
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not isinstance(calls, list):
            continue
        new_calls = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                try:
                    value = json.loads(arguments)
                except (ValueError, RecursionError):
                    value = None
                if isinstance(value, dict):
                    call = {**call, "function": {**function, "arguments": value}}
            new_calls.append(call)
        if any(a is not b for a, b in zip(new_calls, calls)):
            if out is messages:
                out = list(messages)
            out[i] = {**message, "tool_calls": new_calls}
    return out


def _render(messages: list[dict], extra: dict, tokenizer: Any, tools) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError("template_error", "this model ships no chat template: give one "
                            "with --chat-template (a file or the template text), or send "
                            "/v1/completions lines", "messages")
    kwargs = {k: v for k, v in (extra.get("chat_template_kwargs") or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    if extra.get("reasoning_effort") is not None:  # OpenAI's field, as vLLM hands it over
        kwargs["reasoning_effort"] = extra["reasoning_effort"]
    try:
        with _time_limit(TEMPLATE_TIMEOUT_S):
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True, tools=tools,
                                                 **kwargs)
    except TemplateTimeout:
        raise TemplateError("template_error",
                            f"the chat template ran past {TEMPLATE_TIMEOUT_S:g} s for this line "
                            "(a loop without end?) and was stopped", "messages") from None
    # A template is foreign code that may raise anything; one line must never stop the job.
    except Exception as e:  # noqa: BLE001
        raise TemplateError("template_error",
                       f"the chat template failed: {type(e).__name__}: {e}", "messages") from None
    if not isinstance(text, str) or len(text) > MAX_RENDERED_CHARS:
        size = f"{len(text)} characters" if isinstance(text, str) else type(text).__name__
        raise TemplateError("template_error",
                            f"the chat template rendered {size}, over the limit of "
                            f"{MAX_RENDERED_CHARS}", "messages")
    return text


def special_token_pattern(tokenizer: Any) -> re.Pattern | None:
    """A regex finding the text of the tokenizer's special tokens (`<|im_start|>`,
    `<|endoftext|>`, ...); None when it has none."""
    named = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    named |= {str(token) for token in added.values() if getattr(token, "special", False)}
    named = sorted((t for t in named if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, named))) if named else None


def special_token_text(messages: list[dict] | None, prompt, pattern: re.Pattern | None
                       ) -> str | None:
    """The first special token's text written inside a line's own text (a message's content,
    a completions prompt): tokenized as that token, as vLLM and transformers do, it can forge
    the template's turns (OpenAI's API reads it as text). None when there is none."""
    if pattern is None:
        return None
    texts = [prompt] if isinstance(prompt, str) else []
    for message in messages or ():
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        texts += [p.get("text") if isinstance(p, dict) else p for p in parts]
    for text in texts:
        if isinstance(text, str) and (found := pattern.search(text)):
            return found.group()
    return None


class SpecialTextNote:
    """Says once in the job's log that a line's own text holds a special token's text, which
    the tokenizer reads as that token: a job of untrusted users' lines should strip it."""

    def __init__(self, tokenizer: Any):
        self._pattern = special_token_pattern(tokenizer)
        self._noted = False

    def check(self, line: int, messages: list[dict] | None, prompt) -> None:
        if self._noted:
            return
        found = special_token_text(messages, prompt, self._pattern)
        if found is not None:
            self._noted = True
            log.warning("line %d writes the special token %r as text: it is read as that token "
                        "(as vLLM and transformers read it; OpenAI's API reads it as text), so a "
                        "line can open turns of its own in the chat template; if the file comes "
                        "from untrusted users, strip such text first; said once", line, found)
