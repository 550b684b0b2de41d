"""Request fields of OpenAI's and vLLM's APIs that batchgen does not implement and whose
non-default values change the answer: a line that sets one is refused
(`invalid_request`, naming the field and what to do instead), never answered as if the field
were absent. Its default values pass silently."""

from __future__ import annotations

import reprlib
from typing import Any

from batchgen.io.sampling_fields import BadLine, is_int, whole

_RESPONSE_FORMAT = ("give response_format {\"type\": \"json_schema\", \"json_schema\": "
                    "{\"name\", \"schema\"}} instead")

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    # field: (values that change nothing, what the line should do instead)
    "suffix": ((None, ""), "suffix (the text after the completion: insertion) is not "
                           "supported: drop it"),
    "functions": ((None, []), "functions (OpenAI's deprecated form of tools) is not "
                              "supported: give each as tools: [{\"type\": \"function\", "
                              "\"function\": {...}}]"),
    "function_call": ((None, "none"), "function_call (OpenAI's deprecated form of tool_choice) "
                                      "is not supported: give tool_choice instead"),
    "modalities": ((None, ["text"]), "only text answers are generated: drop modalities or "
                                     "set it to [\"text\"]"),
    "audio": ((None,), "audio output is not supported: drop audio"),
    "web_search_options": ((None,), "web search is not supported: drop web_search_options"),
    "verbosity": ((None, "medium"), "verbosity is not supported (the model answers at its "
                                    "own length): drop it"),
    "use_beam_search": ((None, False), "beam search is not supported: drop use_beam_search"),
    "prompt_logprobs": ((None,), "prompt_logprobs (log probabilities of the prompt's tokens) "
                                 "is not supported: drop it"),
    "include_stop_str_in_output": ((None, False), "the stop string is always cut from the "
                                                  "text: drop include_stop_str_in_output"),
    "bad_words": ((None, []), "bad_words is not supported: give their token ids in "
                              "logit_bias with -100"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: drop it"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated: shorten the prompt and "
                                        "drop truncate_prompt_tokens"),
    "add_generation_prompt": ((None, True), "the chat template always ends with the "
                                            "assistant's turn opened: drop "
                                            "add_generation_prompt"),
    "continue_final_message": ((None, False), "continuing the last message is not supported: "
                                              "drop continue_final_message"),
    "chat_template": ((None,), "a chat template per line is not supported: give it to the "
                               "job as --chat-template and drop chat_template"),
    "skip_special_tokens": ((None, True), "special tokens are left out of every answer's text "
                                          "(--detokenization-include-special-tokens keeps "
                                          "them, for the whole job): drop skip_special_tokens"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens is not "
                                                    "supported: drop it"),
    "return_tokens_as_token_ids": ((None, False), "logprobs name tokens by their text: drop "
                                                  "return_tokens_as_token_ids"),
    "logits_processors": ((None, []), "logits_processors is not supported: drop it"),
    "guided_json": ((None,), f"guided_json is not supported: {_RESPONSE_FORMAT}"),
    "guided_regex": ((None,), "guided_regex is not supported: give response_format "
                              "{\"type\": \"json_schema\"} with a string schema's "
                              "\"pattern\" instead"),
    "guided_choice": ((None,), "guided_choice is not supported: give response_format "
                               "{\"type\": \"json_schema\"} with an \"enum\" instead"),
    "guided_grammar": ((None,), "guided_grammar is not supported: drop it"),
    "structured_outputs": ((None,), f"structured_outputs is not supported: {_RESPONSE_FORMAT}"),
}
"""Checked on chat and completions lines (embeddings lines: EMBEDDING_REFUSED)."""

EMBEDDING_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncate_prompt_tokens": ((None,), "inputs are never truncated (one longer than the "
                                        "context is the error context_length_exceeded): "
                                        "shorten it and drop truncate_prompt_tokens"),
    "add_special_tokens": ((None, True), "strings are tokenized with the tokenizer's special "
                                         "tokens (the EOS that last-token pooling reads): give "
                                         "input as token ids to embed other tokens, and drop "
                                         "add_special_tokens"),
    "embed_dtype": ((None, "float32"), "vectors are float32: drop embed_dtype"),
    "endianness": ((None, "native", "little"), "base64 vectors are little-endian float32: "
                                               "drop endianness"),
}
"""vLLM's embeddings fields that change the vector or its bytes, checked on embeddings lines
(`normalize` is read: io/embeddings.py)."""


TEMPLATE_KWARGS_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "messages": ((None,), "give the conversation as the line's messages"),
    "conversation": ((None,), "give the conversation as the line's messages"),
    "tools": ((None,), "give tools as the line's tools"),
    "chat_template": ((None,), "a chat template per line is not supported: give it to the "
                               "job as --chat-template"),
    "add_generation_prompt": ((None, True), "the chat template always ends with the "
                                            "assistant's turn opened"),
    "continue_final_message": ((None, False), "continuing the last message is not supported"),
}
"""chat_template_kwargs keys that are arguments batchgen gives the chat template itself
(transformers' apply_chat_template): another value would be dropped, so it is refused, naming
the key and what to do instead (`tokenize`, `return_dict`, which change no prompt, are
dropped)."""


def refuse_template_kwargs(kwargs: dict) -> None:
    """BadLine for the first chat_template_kwargs key of TEMPLATE_KWARGS_REFUSED set to a
    value other than the one batchgen renders with (`param`: chat_template_kwargs.<key>)."""
    refuse_fields(kwargs, TEMPLATE_KWARGS_REFUSED, within="chat_template_kwargs")


def refuse_unimplemented(body: dict, n: int) -> None:
    """BadLine for the first REFUSED field `body` sets to a value that changes the answer, or
    a `best_of` other than `n` (the best of several samples: answered as n choices)."""
    refuse_fields(body, REFUSED)
    best_of = whole(body.get("best_of"))
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise BadLine("invalid_request", f"best_of {best_of!r} is not supported (only best_of "
                                          "equal to n, or none): ask for n choices and pick "
                                          "among them", "best_of")


def refuse_fields(body: dict, refused: dict[str, tuple[tuple[Any, ...], str]],
                  within: str | None = None) -> None:
    """BadLine for the first field of `refused` that `body` sets to a value that changes the
    answer; `within`: the field of the line that `body` is (its keys are named inside it)."""
    for name, (defaults, fix) in refused.items():
        value = body.get(name)
        if any(_same(value, d) for d in defaults):
            continue
        got = f"(got {reprlib.repr(value)})"
        if within is None:
            raise BadLine("invalid_request", f"{fix} {got}", name)
        raise BadLine("invalid_request", f"{within}.{name}: {fix}; drop it from {within} {got}",
                      f"{within}.{name}")


def _same(value: Any, default: Any) -> bool:
    """`value` is `default` in JSON's sense: no bool passes for 0 or 1, nor 0 for false."""
    return type(value) is type(default) and value == default
