"""The dataclasses that cross module boundaries.

Request -> (scheduler) -> ScheduleOutput -> (runner) -> StepOutput -> (engine) -> FinishedRequest.
The scheduler sees only token and page counts; only the runner and models touch tensors.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import MISSING, Field, dataclass, field, fields, replace

PAGE_SIZE = 64
"""Tokens per KV page, on the device and in the host pool alike."""


def human_bytes(num_bytes: float) -> str:
    """A size for people: '12.3 GB', '0.5 MB' is '512.0 kB', '12 B'."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} B"


def rate_text(rate: float) -> str:
    """A rate for people: whole units, one decimal below 10 (a slow CPU job reads 1.4 tok/s,
    not 1, and a slow link 0.3 MB/s rather than 0)."""
    return f"{rate:,.1f}" if rate < 10 else f"{rate:,.0f}"


def human_seconds(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _default_of(f: Field):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise KeyError(f.name)


class CompactPickle:
    """A dataclass pickled as its field values in order, not as a dict naming each field: a
    job's parsed input (io/parsed_input.py) stores one request per input line, and the names
    were half of every record (~250 of ~500 bytes for a short line)."""

    __slots__ = ()

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in _field_names(type(self)))

    def __setstate__(self, state: tuple | dict) -> None:
        if isinstance(state, dict):  # pickled before (a field per name; later fields absent)
            state = tuple(state[f.name] if f.name in state else _default_of(f)
                          for f in fields(type(self)))
        for name, value in zip(_field_names(type(self)), state, strict=True):
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class SamplingParams(CompactPickle):
    """How one request is decoded. Checked once, when it is made (`__post_init__`): an instance
    is valid, so whoever receives one (the engine, the scheduler, the sampler) trusts it. The job
    runner's intake makes them from input lines, turning a refusal into that line's error."""

    max_tokens: int = 256
    """Upper bound on generated tokens (the stop reason is then "length")."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Same seed => same tokens, whatever else shares the batch. Any 64-bit signed integer
    (OpenAI's and vLLM's range): a negative seed is another seed, not "random"."""
    stop: tuple[str, ...] = ()
    """Stop strings; the matched string is not part of the output."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    """Independent choices per request."""
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the answer already holds."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per earlier occurrence of the token in the answer."""
    repetition_penalty: float = 1.0
    """HF's / vLLM's: the logit of a token in the prompt or the answer is divided by it when
    positive, multiplied when negative (1 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: (token id, bias in [-100, 100]) pairs, each bias added to its token's logit
    before the penalties (as vLLM) and sampling."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))

    def __post_init__(self) -> None:
        """Raises ValueError naming the first field out of range (its name starts the
        message: intake reports it as the line's `param`)."""
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (1 <= self.n <= 128, "n must be in [1, 128]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (len(self.stop) <= 16, "stop holds at most 16 strings"),
            (self.seed is None or -2**63 <= self.seed < 2**63, "seed must be in [-2^63, 2^63)"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             "logit_bias must map token ids (>= 0) to numbers in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def fit_context(self, room: int) -> SamplingParams:
        """These params with max_tokens (and min_tokens) at most `room`, the positions the model
        has left after the prompt: the context bounds the answer, which then ends "length"."""
        if self.max_tokens <= room:
            return self
        return replace(self, max_tokens=room, min_tokens=min(self.min_tokens, room))


@dataclass
class ChoiceProgress:
    """How far one choice of an unfinished request got: what an in-flight checkpoint keeps
    and what the engine needs to continue it exactly (grammar, penalty, stop and min_tokens
    state are all rebuilt from the tokens)."""

    token_ids: list[int]
    """Tokens generated so far (the prompt not included)."""
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when the request asked for logprobs."""
    done: Completion | None = None
    """The choice's result when it finished while another choice of its request ran on."""


@dataclass
class Request:
    """One unit of work as the engine sees it: tokens in, tokens out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: object | None = None
    """A compiled structured-output grammar (engine.structured.CompiledGrammar) or None; each
    choice gets its own matcher and may only emit tokens the grammar allows."""
    resume: list[ChoiceProgress] | None = None
    """One entry per choice (index order) when the request continues from an in-flight
    checkpoint: the tokens it had generated (and finished choices' results); None: new."""
    origin: object | None = None
    """Where the request came from (the job runner's parsed input line,
    io.intake.PendingRequest): the engine never reads it, and hands it back with the request
    in FinishedRequest.request, so the answer is formatted without a lookup by id."""


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """(token_id, logprob) of the most likely tokens, best first."""


@dataclass
class Completion:
    """One choice of a finished request."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    """Detokenized output, with a matched stop string cut off (engine with tokenizer only)."""
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    """The stop string or token that ended it, None for EOS or length."""


@dataclass
class FinishedRequest:
    request_id: str
    prompt_len: int
    completions: list[Completion]
    request: Request | None = None
    """The request as it was added (the engine keeps it through the request's life)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed (of the
    choice that computed the most of its prompt)."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)
