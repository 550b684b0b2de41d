"""The sampling fields of a request body, read and checked once (intake.parse_record calls
`parse_sampling`): OpenAI's and vLLM's names, their types and ranges, each mistake a line
error naming the field (`BadLine`: code, message, param)."""

from __future__ import annotations

import math
import reprlib
from dataclasses import fields
from typing import Any

from batchgen.core import SamplingParams

ALLOWED = {
    "max_tokens": "an integer >= 1", "max_completion_tokens": "an integer >= 1",
    "min_tokens": "an integer >= 0", "temperature": "a number in [0, 100]",
    "top_p": "a number in (0, 1]", "top_k": "an integer >= 0 (0 or -1 disable it)",
    "min_p": "a number in [0, 1]", "seed": "an integer in [-2^63, 2^63)",
    "n": "an integer in [1, 128]", "top_logprobs": "an integer in [0, 20]",
    "stop": "a string or a list of up to 16 non-empty strings",
    "stop_token_ids": "a list of token ids (integers >= 0)", "ignore_eos": "true or false",
    "presence_penalty": "a number in [-2, 2]", "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in (0, 10]",
    "logit_bias": "an object mapping token ids to numbers in [-100, 100]",
}


class BadLine(Exception):
    """A line that becomes an error result: OpenAI's error code, the message, the field."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole(value: Any) -> Any:
    """An integral float as the int it is (Parquet/pandas turn integer columns with gaps into
    floats); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def token_ids(value: Any) -> list[int] | None:
    """A list of token ids (ints >= 0, integral floats accepted), or None if it is not one."""
    if not isinstance(value, list):
        return None
    ids = [whole(t) for t in value]
    return ids if all(is_int(t) and t >= 0 for t in ids) else None


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its type and a bounded repr (a list of thousands
    of stop strings, or a long one, is not echoed whole into the error line)."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _bad_type(name: str, value: Any) -> BadLine:
    return BadLine("invalid_sampling_param", f"{name} must be {ALLOWED[name]}, got {_shown(value)}",
                   name)


def _bad_item(name: str, at: str, what: str, value: Any) -> BadLine:
    """The refusal of one entry of a list or object field, named as `name[at]`."""
    return BadLine("invalid_sampling_param", f"{name}[{at}] must be {what}, got {_shown(value)}",
                   name)


def _get_int(body: dict, name: str) -> int | None:
    value = whole(body.get(name))
    if value is not None and not is_int(value):
        raise _bad_type(name, value)
    return value


def _get_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad_type(name, value)
    return float(value)


def _get_stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")  # a string is one stop string, even one that looks like JSON
    if value is None:
        return ()
    if isinstance(value, str) and value:
        return (value,)
    if not isinstance(value, list):
        raise _bad_type("stop", value)
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise _bad_item("stop", str(i), "a non-empty string", item)
    return tuple(value)


def _gettoken_ids(body: dict) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    ids = token_ids(value)
    if ids is None and isinstance(value, list):
        i = next(i for i, t in enumerate(value) if token_ids([t]) is None)
        raise _bad_item("stop_token_ids", str(i), "a token id (an integer >= 0)", value[i])
    if ids is None:
        raise _bad_type("stop_token_ids", value)
    return tuple(ids)


def _get_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings), as sorted (id, bias) pairs."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad_type("logit_bias", value)
    pairs = {}
    for key, bias in value.items():
        try:
            token = _token_key(key)
        except ValueError:
            raise BadLine("invalid_sampling_param", f"logit_bias key {reprlib.repr(key)} is not "
                                                     "a token id (decimal digits)",
                          "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _bad_item("logit_bias", reprlib.repr(key), "a number in [-100, 100]", bias)
        if token in pairs:  # "5" and "05": which bias would win?
            raise BadLine("invalid_sampling_param", f"logit_bias names token {token} twice",
                          "logit_bias")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _token_key(key) -> int:
    """A logit_bias key: a token id written in decimal digits ("42"; an int from a Parquet map
    column); Python's int() would also take "4_2", " 42 " and "-0" (token 0). ValueError
    otherwise."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.lstrip("-").isdigit() and key.isascii() \
            and not (key.startswith("-") and int(key) == 0):
        return int(key)
    raise ValueError(key)


def _get_logprobs(body: dict, kind: str) -> tuple[bool, int]:
    """(logprobs on?, top_logprobs). Chat: logprobs bool + top_logprobs int. Completions:
    logprobs is the int count of alternatives (OpenAI legacy), 0 = chosen token only."""
    value, top = body.get("logprobs"), _get_int(body, "top_logprobs")
    if kind == "completion":
        value = whole(value)
        if value is not None and not (is_int(value) and 0 <= value <= 20):
            raise BadLine("invalid_sampling_param", "logprobs for completions must be an "
                                                     f"integer in [0, 20], got {value!r}",
                           "logprobs")
        if value is not None:
            return True, value
        return top is not None, top or 0
    if value is not None and not isinstance(value, bool):
        raise BadLine("invalid_sampling_param", f"logprobs must be true or false, got {value!r}",
                       "logprobs")
    if top and not value:
        raise BadLine("invalid_sampling_param", "top_logprobs needs logprobs: true",
                       "top_logprobs")
    return bool(value), top or 0


def gives_max_tokens(body: dict) -> bool:
    """Whether a request body sets its own length (max_completion_tokens or max_tokens): one
    that does not takes --max-tokens."""
    return body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None


MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The fields a model's generation_config.json may set for lines that leave them out."""


def model_defaults(generation_config: dict) -> dict:
    """The MODEL_DEFAULT_FIELDS a generation_config.json's object sets, as parse_sampling reads
    them (checked as a line's would be: BadLine naming a bad one)."""
    body = {k: generation_config[k] for k in MODEL_DEFAULT_FIELDS
            if generation_config.get(k) is not None}
    parsed = parse_sampling(body, "chat")
    return {k: getattr(parsed, k) for k in body}


def parse_sampling(body: dict, kind: str, default_max_tokens: int = 256) -> SamplingParams:
    """SamplingParams from request fields (None means "not given"); raises BadLine."""
    max_tokens = _get_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _bad_type("ignore_eos", ignore_eos)
    top_k = _get_int(body, "top_k")
    logprobs, top_logprobs = _get_logprobs(body, kind)
    given = {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "min_tokens": _get_int(body, "min_tokens"),
        "temperature": _get_number(body, "temperature"),
        "top_p": _get_number(body, "top_p"),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
        "min_p": _get_number(body, "min_p"),
        "seed": _get_int(body, "seed"),
        "n": _get_int(body, "n"),
        "stop": _get_stop(body),
        "stop_token_ids": _gettoken_ids(body),
        "ignore_eos": ignore_eos,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "presence_penalty": _get_number(body, "presence_penalty"),
        "frequency_penalty": _get_number(body, "frequency_penalty"),
        "repetition_penalty": _get_number(body, "repetition_penalty"),
        "logit_bias": _get_logit_bias(body),
    }
    given = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(**given)  # checks its values (the only check they get)
    except ValueError as e:
        name, rest = (str(e).split(" ", 1) + [""])[:2]
        got = ""
        if name in _SAMPLING_FIELDS:
            if name == "max_tokens" and body.get("max_completion_tokens") is not None:
                name = "max_completion_tokens"  # the field the line spelled
            # As the line wrote it: `given` holds it converted (logit_bias, stop as tuples).
            value = body.get(name)
            value = given.get(name, _SAMPLING_DEFAULTS.get(name)) if value is None else value
            got = f", got {_at_fault(name, value)}"
        if rest == "must be <= max_tokens":  # name the bound: the line may not have set it
            rest = f"must be <= max_tokens ({_max_tokens_source(body, given['max_tokens'])})"
        raise BadLine("invalid_sampling_param", f"{name} {rest}{got}".strip(),
                       name if name in _SAMPLING_FIELDS or name in ALLOWED else None) from None


def _max_tokens_source(body: dict, max_tokens: int) -> str:
    """max_tokens as a refusal names it: its value and the field, or flag, that set it."""
    if body.get("max_completion_tokens") is not None:
        return f"{max_tokens}, the line's max_completion_tokens"
    if body.get("max_tokens") is not None:
        return f"{max_tokens}, the line's max_tokens"
    return f"{max_tokens}, the job's --max-tokens: the line sets no max_tokens"


def _at_fault(name: str, value: Any) -> str:
    """What the refusal of field `name` quotes of its `value`: the logit_bias entries out of
    range, a stop list's length, else the value (bounded: reprlib)."""
    if name == "logit_bias" and isinstance(value, dict):
        value = {k: v for k, v in value.items()
                 if _token_key(k) < 0 or not -100.0 <= v <= 100.0}
    elif name == "stop" and isinstance(value, list):
        return f"{len(value)} strings"
    return reprlib.repr(value)


_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
_SAMPLING_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
