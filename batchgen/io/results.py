"""OpenAI batch result lines (plain dicts; `dumps` makes the bytes the writer appends).

Every id is derived from (batch_id, custom_id) and `created` is passed in, so a resumed run
writes byte-identical lines for the same answers. docs/job-files.md documents each field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from batchgen.core import Completion, FinishedRequest, TokenLogprob
from batchgen.detokenizer import BYTES_PREFIX
from batchgen.io.embeddings import EmbeddingRequest, embeddings_body
from batchgen.io.intake import IntakeError, PendingRequest

LOGPROB_FLOOR = -9999.0
"""-inf is not JSON; impossible tokens are reported with this logprob (as vLLM does)."""
REASONING_FIELDS = {"reasoning_content": ("reasoning_content",), "reasoning": ("reasoning",),
                    "both": ("reasoning_content", "reasoning")}


@dataclass(frozen=True)
class ParsedChoice:
    """What the reasoning / tool-call parsers made of one choice's text. Any object with these
    attributes works (e.g. parsers.ParsedMessage; reasoning_tokens then counts as 0)."""

    content: str | None
    """The answer without reasoning and tool-call markup (None when it is only tool calls)."""
    reasoning: str | None = None
    tool_calls: list[dict] | None = None
    """OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments"}}."""
    reasoning_tokens: int = 0


def _hex(batch_id: str, custom_id: str, purpose: bytes, size: int) -> str:
    h = hashlib.blake2b(f"{batch_id}\x00{custom_id}".encode(), digest_size=size, person=purpose)
    return h.hexdigest()


def item_id(batch_id: str, custom_id: str) -> str:
    return "batch_req_" + _hex(batch_id, custom_id, b"batchgen-item", 16)


def request_id(batch_id: str, custom_id: str) -> str:
    return _hex(batch_id, custom_id, b"batchgen-request", 16)


def completion_id(batch_id: str, custom_id: str, kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return prefix + _hex(batch_id, custom_id, b"batchgen-body", 16)


def tool_call_id(batch_id: str, custom_id: str, choice: int, index: int) -> str:
    """The id of a request's `index`-th tool call in choice `choice`: unique within the job,
    the same on a resume."""
    return "call_" + _hex(batch_id, f"{custom_id}\x00{choice}\x00{index}", b"batchgen-call", 12)


def dumps(line: dict) -> bytes:
    """One JSONL line, newline included."""
    return orjson.dumps(line) + b"\n"


def is_success(line: dict) -> bool:
    """Whether a result line belongs in the output (else in the errors file)."""
    response = line.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def _envelope(batch_id: str, custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {"id": item_id(batch_id, custom_id), "custom_id": custom_id,
            "response": response, "error": error}


def error_line(batch_id: str, error: IntakeError, status_code: int = 400) -> dict:
    """A request refused at intake (bad line, too long, template error): an HTTP-style error."""
    body = {"error": {"code": error.code, "message": error.message, "param": error.param,
                      "line": error.line, "type": "invalid_request_error"}}
    response = {"status_code": status_code,
                "request_id": request_id(batch_id, error.custom_id), "body": body}
    return _envelope(batch_id, error.custom_id, response, None)


def failure_line(batch_id: str, custom_id: str, line: int, code: str, message: str) -> dict:
    """A request that failed outside HTTP semantics (e.g. quarantined after repeated crashes)."""
    return _envelope(batch_id, custom_id, None, {"code": code, "message": message, "param": None,
                                                 "line": line})


def embedding_line(batch_id: str, request: EmbeddingRequest, vectors, model: str) -> dict:
    """The 200 result of an embeddings line: OpenAI's embeddings object (io/embeddings.py)."""
    response = {"status_code": 200, "request_id": request_id(batch_id, request.custom_id),
                "body": embeddings_body(request, vectors, model)}
    return _envelope(batch_id, request.custom_id, response, None)


def success_line(pending: PendingRequest, finished: FinishedRequest, *, batch_id: str,
                 model: str, created: int, decode_token: Callable[[int], str],
                 split_text: Callable[[Sequence[int]], tuple[str, str]],
                 texts: Sequence[str] | None = None,
                 parsed: Sequence[ParsedChoice | None] | None = None,
                 reasoning_field: str = "reasoning_content",
                 system_fingerprint: str | None = None) -> dict:
    """The 200 result of a finished request.

    texts: detokenized text per choice (default: each Completion.text). parsed: parser output
    per choice (chat only). decode_token: token id -> its text, for logprobs; split_text:
    token ids -> their text, cut before a character still unfinished at the end, and that
    character's U+FFFD (Detokenizer.split_unfinished), for echo and the completions'
    text_offset."""
    completions = sorted(finished.completions, key=lambda c: c.index)
    texts = list(texts) if texts is not None else [_text_of(c) for c in completions]
    top_n = pending.sampling.top_logprobs if pending.sampling.logprobs else -1
    if pending.kind == "chat":
        choices = [_chat_choice(c, t, p, top_n, decode_token, reasoning_field,
                                lambda choice, i: tool_call_id(batch_id, pending.custom_id,
                                                               choice, i))
                   for c, t, p in zip(completions, texts, parsed or [None] * len(completions))]
        obj = "chat.completion"
    else:
        if pending.extra.get("echo"):  # the prompt as the line gave it, then the answer
            head = (pending.prompt if isinstance(pending.prompt, str)
                    else "".join(split_text(pending.prompt_token_ids)))
            texts = [head + t for t in texts]
        choices = [_text_choice(c, t, top_n, decode_token, split_text)
                   for c, t in zip(completions, texts)]
        obj = "text_completion"
    body = {"id": completion_id(batch_id, pending.custom_id, pending.kind), "object": obj,
            "created": created, "model": model, "system_fingerprint": system_fingerprint,
            "choices": choices, "usage": _usage(finished, parsed)}
    response = {"status_code": 200, "request_id": request_id(batch_id, pending.custom_id),
                "body": body}
    return _envelope(batch_id, pending.custom_id, response, None)


def _text_of(c: Completion) -> str:
    if c.text is None:
        raise ValueError(f"choice {c.index} has no text: pass texts= or detokenize in the engine")
    return c.text


def _usage(finished: FinishedRequest, parsed: Sequence[ParsedChoice | None] | None) -> dict:
    completion = finished.completion_tokens
    usage = {"prompt_tokens": finished.prompt_len, "completion_tokens": completion,
             "total_tokens": finished.prompt_len + completion,
             "prompt_tokens_details": {"cached_tokens": finished.cached_tokens}}
    if parsed and any(p is not None and p.reasoning is not None for p in parsed):
        reasoning = sum(getattr(p, "reasoning_tokens", 0) for p in parsed if p is not None)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _chat_choice(c: Completion, text: str, parsed: ParsedChoice | None, top_n: int,
                 decode: Callable[[int], str], reasoning_field: str,
                 call_id: Callable[[int, int], str]) -> dict:
    message: dict = {"role": "assistant", "content": text if parsed is None else parsed.content,
                     "refusal": None}  # OpenAI's field; a model here never refuses by it
    finish = c.finish_reason.value
    if parsed is not None and parsed.reasoning is not None:
        for name in REASONING_FIELDS[reasoning_field]:
            message[name] = parsed.reasoning
    if parsed is not None and parsed.tool_calls:
        message["tool_calls"] = [{**call, "id": call_id(c.index, i)}
                                 for i, call in enumerate(parsed.tool_calls)]
        finish = "tool_calls"
    logprobs = None
    if top_n >= 0 and c.logprobs is not None:
        logprobs = {"content": [_chat_logprob(lp, top_n, decode) for lp in c.logprobs],
                    "refusal": None}
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _floor(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def _label_bytes(token: str) -> list[int]:
    if token.startswith(BYTES_PREFIX + "\\x"):
        try:
            return list(bytes.fromhex(token[len(BYTES_PREFIX):].replace("\\x", "")))
        except ValueError:
            pass
    return list(token.encode("utf-8"))


def _token_entry(token_id: int, logprob: float, decode: Callable[[int], str]) -> dict:
    token = decode(token_id)
    return {"token": token, "logprob": _floor(logprob), "bytes": _label_bytes(token)}


def _chat_logprob(lp: TokenLogprob, top_n: int, decode: Callable[[int], str]) -> dict:
    entry = _token_entry(lp.token_id, lp.logprob, decode)
    entry["top_logprobs"] = [_token_entry(t, p, decode) for t, p in lp.top[:top_n]]
    return entry


def _text_choice(c: Completion, text: str, top_n: int, decode: Callable[[int], str],
                 split_text: Callable[[Sequence[int]], tuple[str, str]]) -> dict:
    logprobs = None
    if top_n >= 0 and c.logprobs is not None:
        logprobs = _text_logprobs(c.logprobs, top_n, decode,
                                  char_offsets([lp.token_id for lp in c.logprobs], split_text))
    return {"index": c.index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason.value}


def char_offsets(token_ids: Sequence[int],
                 split_text: Callable[[Sequence[int]], tuple[str, str]]) -> list[int]:
    """Where each token's characters start in the text of `token_ids`: the length of the text
    before it, an unfinished character not counted. `split_text(ids)`: the text of `ids` and
    the U+FFFD it ends with for a character that later tokens may still finish ("" if none;
    Detokenizer.split_unfinished). A token's own text is not that (a multi-byte character
    split over tokens, a tokenizer that drops a leading space or skips special tokens), and
    decoding every prefix would be quadratic: the text before each token is decoded from the
    last two points where it was whole."""
    offsets = []
    whole, whole_len = 0, 0  # token_ids[:whole] decodes to whole_len whole characters
    anchor = 0  # the whole point before `whole`: decoding from it keeps a leading space
    anchor_len = 0  # characters of token_ids[anchor:whole], decoded from the anchor
    for i in range(len(token_ids)):
        head, unfinished = split_text(token_ids[anchor:i])
        offsets.append(whole_len + len(head) - anchor_len)
        if not unfinished:
            whole_len += len(head) - anchor_len
            anchor, whole = whole, i
            anchor_len = len(split_text(token_ids[anchor:whole])[0])
    return offsets


def _text_logprobs(lps: list[TokenLogprob], top_n: int, decode: Callable[[int], str],
                   offsets: list[int]) -> dict:
    tokens, top = [], []
    for lp in lps:
        token = decode(lp.token_id)
        tokens.append(token)
        # Legacy format: the chosen token plus the top alternatives, token text -> logprob.
        alternatives = {decode(t): _floor(p) for t, p in lp.top[:top_n]}
        alternatives.setdefault(token, _floor(lp.logprob))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [_floor(lp.logprob) for lp in lps],
            "top_logprobs": top, "text_offset": offsets}
