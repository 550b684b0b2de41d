"""The shape of a chat line's `messages` and a completions line's `prompt`: what the chat
template and the tokenizer will be given, checked field by field so that a malformed line is an
error line naming the field (`param`), never a template failure that names none."""

from __future__ import annotations

from typing import Any

from batchgen.io.field_values import maybe_json, text_problem
from batchgen.io.sampling_fields import BadLine, token_ids

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
"""Message roles accepted: OpenAI's, and Llama 3's `ipython` (tool output in its template)."""



def parse_messages(value: Any) -> list[dict]:
    """A chat line's messages, each checked and cleaned (`_message`); BadLine naming the
    message and field at fault."""
    value = maybe_json(value)
    if not isinstance(value, list) or not value:
        raise BadLine("invalid_messages", "messages must be a non-empty list of "
                                           "{\"role\", \"content\"} objects"
                                           + text_problem(value), "messages")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, index: int) -> dict:
    if not isinstance(message, dict):
        raise BadLine("invalid_messages", f"messages[{index}] must be an object",
                       f"messages[{index}]")
    # Parquet structs carry every field of the schema, absent ones as null: drop them, or a
    # template would render "None" for a missing name.
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise BadLine("invalid_messages", f"messages[{index}].role must be a non-empty string",
                       f"messages[{index}].role")
    if role not in ROLES:
        raise BadLine("invalid_messages", f"messages[{index}].role {role!r} is not a chat "
                                           f"role: use one of {', '.join(sorted(ROLES))}",
                       f"messages[{index}].role")
    if role == "assistant" and "tool_calls" in message:
        _check_tool_calls(message["tool_calls"], index)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = _flatten_parts(content, index)
    elif content is None and role == "assistant" and message.get("tool_calls"):
        message["content"] = ""  # OpenAI's null beside tool calls; templates read .content
    elif content is None:
        raise BadLine("invalid_messages", f"messages[{index}].content is missing or null: "
                                           "give the message's text",
                       f"messages[{index}].content")
    elif content is not None and not isinstance(content, str):
        raise BadLine("invalid_messages", f"messages[{index}].content must be a string or a "
                                           "list of text parts", f"messages[{index}].content")
    return message


def _check_tool_calls(calls: Any, index: int) -> None:
    """An assistant message's tool_calls as OpenAI writes them: a list of `{"id", "type":
    "function", "function": {"name", "arguments"}}` objects, the arguments a JSON string (or the
    object it encodes). Another shape would reach the chat template, which fails on it as a
    template_error naming no field, or renders a call the line never made."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise BadLine("invalid_messages", f"{where} must be a list of {{\"id\", \"type\": "
                                           "\"function\", \"function\": {\"name\", "
                                           "\"arguments\"}} objects", where)
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            raise BadLine("invalid_messages", f"{where}[{i}] must be {{\"id\", \"type\": "
                                               "\"function\", \"function\": {\"name\", "
                                               "\"arguments\"}} with a non-empty name",
                          f"{where}[{i}].function")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise BadLine("invalid_messages", f"{where}[{i}].function.arguments must be the "
                                               "call's arguments as a JSON string (\"{}\" for "
                                               "none)", f"{where}[{i}].function.arguments")


def _flatten_parts(parts: list, index: int) -> str:
    # Text-only models' templates expect a string; join text parts as vLLM does.
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type", "text") != "text" \
                or not isinstance(part.get("text"), str):
            raise BadLine("invalid_messages", f"messages[{index}].content: only text parts "
                                               "({\"type\": \"text\", \"text\": ...}) are "
                                               "supported", f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_prompt(value: Any) -> str | list[int]:
    """A completions line's prompt: a string or token ids (one prompt, OpenAI's batched form
    of one accepted); BadLine otherwise."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt in OpenAI's batched form: ["text"] or [[ids]]
    if isinstance(value, str):
        return value
    if value == []:  # [] and [[]]: a list of token ids, but of none
        raise BadLine("invalid_prompt", "the prompt is an empty list of token ids: give at "
                                         "least one token id (or a non-empty string)", "prompt")
    ids = token_ids(value)
    if ids:
        return ids
    raise BadLine("invalid_prompt", "prompt must be a string or a list of token ids "
                                     "(one prompt per line; batched prompts are not supported)",
                   "prompt")
