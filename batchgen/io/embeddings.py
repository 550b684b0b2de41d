"""`/v1/embeddings` lines: OpenAI's embeddings body in, OpenAI's embeddings object out.

Body: `input` (a string, a list of strings, a list of token ids, or a list of token-id lists),
`encoding_format` ("float", default, or "base64": little-endian float32 bytes), `dimensions`
(keep the first N values, then re-normalise: Matryoshka models), vLLM's `normalize` (L2-normalise
or not, whatever the model folder says). A line with several inputs is
one request with one vector per input, `data[i].index` = its position in `input`.
"""

from __future__ import annotations

import base64
import difflib
import reprlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from batchgen.core import CompactPickle

MODEL_CONTEXT = "the model context"
"""What bounds an input's length unless --max-model-len does (errors name it)."""
EMBEDDINGS_URL = "/v1/embeddings"
EMBEDDING_FIELDS = ("input", "encoding_format", "dimensions", "normalize")
"""The body fields of an embeddings line batchgen reads."""
MAX_INPUTS = 2048
"""OpenAI's limit of inputs per embeddings request."""
MAX_CHARS_PER_TOKEN = 128
"""More characters than any vocabulary piece holds: a text longer than this many per token of
the context cannot fit, whatever the tokenizer (so it is refused without being tokenized:
tokenizing costs about a hundred bytes of memory per character)."""


OTHER_INPUT_NAMES = ("inputs", "texts", "sentences")
"""What other embedding APIs call `input` (Hugging Face TEI's `inputs`, Cohere's `texts`,
sentence-transformers' `sentences`): a line giving one of them is told to rename it."""
VOCAB_BOUND = "the vocabulary size of the model and its tokenizer"
"""What bounds a line's token ids where the model and its tokenizer agree on their number."""
HINTED_KEYS = 64
"""Keys of a line looked at for a misnamed field (a hostile line may hold a million)."""


def misnamed(data: dict, renames: dict[str, str], near: str | None = None) -> str:
    """The hint of a line holding a field under another name ("; this one has 'inputs':
    rename it to input"), or "" when none of its keys reads as one: a key (in any case) that
    `renames` maps to what to write instead, or one spelled close to `near`."""
    for key in list(data)[:HINTED_KEYS]:
        if not isinstance(key, str) or data[key] is None:
            continue
        name = key.lower()
        meant = renames.get(name) or (
            near if near and difflib.get_close_matches(name, [near], 1, 0.8) else None)
        if meant:
            return f"; this one has {reprlib.repr(key)}: rename it to {meant}"
    return ""


def misnamed_input(data: dict) -> str:
    """`misnamed` for a line without `input`."""
    return misnamed(data, dict.fromkeys(OTHER_INPUT_NAMES, "input"), "input")


class EmbeddingLineError(Exception):
    def __init__(self, code: str, message: str, param: str | None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class EmbeddingRequest(CompactPickle):
    """An embeddings line, parsed (token_ids empty) or tokenized."""

    custom_id: str
    line: int
    inputs: tuple
    """Each input: a string, or a tuple of token ids given by the user."""
    encoding_format: str
    """"float" or "base64"."""
    dimensions: int | None
    """Keep this many leading values (None: all)."""
    token_ids: tuple[tuple[int, ...], ...] = ()
    """One token-id tuple per input, after tokenization."""
    normalize: bool | None = None
    """L2-normalise the vectors (None: as the model folder says)."""
    kind: str = "embedding"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def _ids(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    ids = [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return tuple(ids)
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad_token_id(value: list) -> EmbeddingLineError:
    """The refusal of a list of token ids (its first item is a number) holding an item that is
    not one, naming that item, not the first (which may be a good id)."""
    at, item = next((i, v) for i, v in enumerate(value) if _ids([v]) is None)
    if _number(item):
        return EmbeddingLineError("invalid_input", f"input[{at}] is token id "
                                  f"{reprlib.repr(item)}: token ids are integers >= 0", "input")
    return EmbeddingLineError("invalid_input", f"input[{at}] is {reprlib.repr(item)}: input is "
                              "a list of token ids (its first item is a number), which holds "
                              "integers >= 0 only", "input")


def _inputs(value: Any) -> tuple:
    bad = EmbeddingLineError("invalid_input", "input must be a non-empty string, a list of "
                             "strings, a list of token ids or a list of token-id lists", "input")
    if isinstance(value, str):
        items: list = [value]
    elif _ids(value) is not None:
        items = [_ids(value)]
    elif isinstance(value, list) and value and _number(value[0]):
        raise _bad_token_id(value)
    elif isinstance(value, list) and value:
        items = [v if isinstance(v, str) else _ids(v) for v in value]
        for i, item in enumerate(items):
            if item is None or item == "":
                raise EmbeddingLineError("invalid_input", f"input[{i}] is "
                                         f"{reprlib.repr(value[i])}: each item must be a "
                                         "non-empty string or a non-empty list of token ids "
                                         "(integers >= 0)", "input")
        if len({isinstance(v, str) for v in items}) > 1:
            raise EmbeddingLineError("invalid_input", "input mixes strings and token-id lists: "
                                     "give one kind per line", "input")
    else:
        raise bad
    if items == [""]:
        raise bad
    if len(items) > MAX_INPUTS:
        raise EmbeddingLineError("invalid_input", f"input holds {len(items)} items, at most "
                                 f"{MAX_INPUTS} are allowed per line: split it", "input")
    return tuple(items)


def parse_embedding(body: dict, custom_id: str, line: int) -> EmbeddingRequest:
    """An embeddings body; raises EmbeddingLineError naming the field at fault."""
    if body.get("input") is None:
        raise EmbeddingLineError("invalid_input", "an embeddings line needs input"
                                 + misnamed_input(body), "input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding  # false, 0, "" are not formats
    if encoding not in ("float", "base64"):
        raise EmbeddingLineError("invalid_request", "encoding_format must be \"float\" or "
                                 f"\"base64\", got {reprlib.repr(encoding)}", "encoding_format")
    dimensions = body.get("dimensions")
    if isinstance(dimensions, float) and dimensions.is_integer():
        dimensions = int(dimensions)
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or dimensions < 1):
        raise EmbeddingLineError("invalid_request", "dimensions must be an integer >= 1, got "
                                 f"{reprlib.repr(dimensions)}", "dimensions")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise EmbeddingLineError("invalid_request", "normalize must be true or false, got "
                                 f"{reprlib.repr(normalize)}", "normalize")
    return EmbeddingRequest(custom_id, line, _inputs(body["input"]), encoding, dimensions,
                            normalize=normalize)


def raise_flag(context: str) -> str:
    """The second fix of a too-long input when a flag (--max-model-len) set the context."""
    return f", or raise {context}" if context.startswith("--") else ""


def tokenize_embedding(parsed: EmbeddingRequest, tokenizer: Any, max_context: int,
                       vocab: int | None = None, context: str = MODEL_CONTEXT,
                       bound: str = VOCAB_BOUND) -> EmbeddingRequest:
    """Tokenize every input (as the tokenizer does by default: its special tokens, e.g. the
    EOS last-token pooling reads, are added); raises EmbeddingLineError. `vocab`: every token
    id must be below it (default: the tokenizer's size); `bound`: what sets it, for the
    error."""
    vocab = len(tokenizer) if vocab is None else vocab
    ids = []
    for i, item in enumerate(parsed.inputs):
        where = "input" if len(parsed.inputs) == 1 else f"input[{i}]"
        if isinstance(item, str) and len(item) > max_context * MAX_CHARS_PER_TOKEN:
            raise EmbeddingLineError("context_length_exceeded", f"{where} is {len(item)} "
                                     f"characters, more than {MAX_CHARS_PER_TOKEN} per token of "
                                     f"{context} ({max_context} tokens), so it cannot fit (it is "
                                     "refused without tokenizing); shorten it: it is never "
                                     "truncated" + raise_flag(context), where)
        tokens = tuple(tokenizer.encode(item)) if isinstance(item, str) else item
        if tokens and max(tokens) >= vocab:
            raise EmbeddingLineError("invalid_input", f"{where}: token ids must be < {vocab} "
                                     f"({bound})", where)
        if not tokens:
            raise EmbeddingLineError("invalid_input", f"{where} is empty after tokenization",
                                     where)
        if len(tokens) > max_context:
            raise EmbeddingLineError("context_length_exceeded", f"{where} is {len(tokens)} "
                                     f"tokens but {context} is {max_context} tokens; shorten "
                                     "it: it is never truncated" + raise_flag(context), where)
        ids.append(tokens)
    return replace(parsed, token_ids=tuple(ids))


def check_dimensions(request: EmbeddingRequest, width: int, allowed=None) -> None:
    """Raise EmbeddingLineError when `dimensions` does not fit the model: `width` is its
    embedding size, `allowed` the sizes a Matryoshka model lists (None: any up to width)."""
    d = request.dimensions
    if d is not None and (d > width or (allowed and d not in allowed)):
        sizes = f"one of {sorted(allowed)}" if allowed else f"at most {width}"
        raise EmbeddingLineError("invalid_request", f"dimensions must be {sizes} for this "
                                 f"model, got {reprlib.repr(d)}", "dimensions")


def check_length(request: EmbeddingRequest, limit: int | None, source: str) -> None:
    """Raise EmbeddingLineError (context_length_exceeded) when an input is longer than the
    `limit` tokens the model folder's `source` sets (None: no bound but the context's)."""
    for i, ids in enumerate(request.token_ids):
        if limit is not None and len(ids) > limit:
            where = "input" if len(request.token_ids) == 1 else f"input[{i}]"
            raise EmbeddingLineError("context_length_exceeded", f"{where} is {len(ids)} tokens "
                                     f"but the model's max_seq_length ({source}) is {limit} "
                                     "tokens; shorten it: it is never truncated", where)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    values = np.ascontiguousarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()


def embeddings_body(request: EmbeddingRequest, vectors: list[np.ndarray], model: str) -> dict:
    """OpenAI's embeddings object for a request's vectors (already pooled and cut)."""
    data = [{"object": "embedding", "index": i,
             "embedding": encode_vector(v, request.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = request.prompt_tokens
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
