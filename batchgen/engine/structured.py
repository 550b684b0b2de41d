"""Structured outputs: OpenAI ``response_format`` turned into a per-token allowed-token mask.

Accepted formats (the request body's ``response_format``):

- ``{"type": "text"}`` or absent: no constraint (``GrammarCompiler.compile`` returns None).
- ``{"type": "json_object"}``: any JSON object.
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}``:
  JSON valid under ``schema``. ``strict: true`` follows OpenAI's strict mode: where an object
  declares properties, no other property is generated (an object that declares none, a bare
  ``{"type": "object"}``, still takes any keys). Without it, JSON Schema's defaults apply
  (extra properties allowed).

Supported: objects (properties, required, additionalProperties, patternProperties,
propertyNames, min/maxProperties), arrays (items, prefixItems, min/maxItems), strings
(min/maxLength, pattern without lookaround and matching no quote or backslash, the common
formats), numbers and integers (bounds; multipleOf on integers only, a whole step up to 1024),
booleans, null, enum, const, anyOf, oneOf
(enforced as anyOf: exclusivity is not checked, which is exact for discriminated unions),
single-entry allOf, $ref/$defs. Keywords the grammar cannot enforce (not, if/then/else,
uniqueItems, contains, dependent*, multi-entry allOf, ...) raise ``StructuredOutputError``
instead of silently producing output that may not validate.
Unknown ``format`` values are ignored, as JSON Schema treats ``format`` as an annotation.

Engine contract: one ``GrammarCompiler`` per tokenizer (xgrammar caches compiled schemas),
one ``GrammarMatcher`` per sequence. In a step with a constrained row the engine hands the
runner a logits processor that calls ``apply_masks(logits[S, V], matchers)`` (None for
unconstrained rows) before sampling, and then calls ``matcher.accept(token)`` for the sampled
token. The stop tokens are allowed exactly when the JSON value is complete; a finished matcher
allows only stop tokens.

Library choice: xgrammar 0.2.9 vs llguidance 1.9.1, measured on SmolLM2-135M's tokenizer (49152
tokens), 2-core AMD EPYC, replaying the same 65-token document through a 6-field nested schema
(object, array of strings, enum, bool); warm numbers are the median of 5 replays:

    mask fill per token            xgrammar              llguidance
    schema, warm mean/p50/max      4 / 2 / 16 us         15 / 12 / 73 us
    schema, first replay mean/max  9 / 109-243 us        37-58 / 1390-1900 us
    json_object, warm mean/max     7 / 14 us             12 / 84-93 us
    accept one token               2 us                  4-5 us
    batch of 64, one step          0.3-0.4 ms (max 1.6)  1.0-1.3 ms (max 5.0)
    compile schema / object        7 / 5 ms              2 / 1 ms   (once per schema, cached)
    tokenizer init                 0.2 s                 0.6 s      (once per job)

On a walk driven by random logits (200 steps, mostly inside long strings) both cost ~10 us per
token. xgrammar precomputes context-independent token masks at compile time, so it is 3x
cheaper per step and its worst step is ~5x smaller, which is what stalls a batched decode step.
We use xgrammar.

Whole ``apply_masks`` step on the H200 host (16 cores, rows at different points of the nested
schema, fill on 8 threads + copy + Triton kernel, equal to the torch reference): 16 rows
0.6-0.9 ms, 64 rows 0.9-1.0 ms, 256 rows 1.4-2.2 ms; the Triton kernel alone is 0.05-0.1 ms.
On CPU, writing -inf into most of a [64, 49152] row block is the cost (~36 ms with xgrammar's
kernel on the 2-core box, ~110 ms with the torch reference below, which is a fallback and the
test oracle).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass

import torch
import xgrammar as xgr

from batchgen.request_checks import StructuredOutputError, response_format_schema

# Whitespace between JSON tokens is free-form (models pretty-print), but bounded so that a
# small model cannot loop on spaces or newlines until max_tokens.
MAX_WHITESPACE = 16


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled response_format; immutable and shared by all sequences using it."""

    grammar: xgr.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GrammarCompiler:
    """Compiles response formats for one tokenizer.

    ``vocab_size`` is the model's logits width, which may exceed the tokenizer's (padded
    embeddings); ids past the tokenizer are never allowed. ``stop_token_ids`` are the ids that
    end a sequence (default: the tokenizer's eos).
    """

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids=None, max_threads: int = 8):
        if stop_token_ids is None and tokenizer.eos_token_id is not None:
            stop_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # xgrammar's own cache keeps every grammar compiled, without bound: the worker's
        # (runner/worker/grammars.py) is bounded.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads,
                                             cache_enabled=False)

    def compile(self, response_format: dict | None) -> CompiledGrammar | None:
        """Grammar for ``response_format``; None for plain text. Raises StructuredOutputError."""
        schema, strict = response_format_schema(response_format)
        if schema is None:
            return None
        try:
            grammar = self._compiler.compile_json_schema(
                # Key order matters: properties are generated in the order the schema lists them.
                json.dumps(schema),
                strict_mode=strict,
                any_whitespace=True,
                max_whitespace_cnt=MAX_WHITESPACE,
            )
        except (RuntimeError, ValueError) as exc:
            raise StructuredOutputError(f"invalid JSON schema: {xgrammar_reason(exc)}") from None
        return CompiledGrammar(grammar, self.vocab_size, tuple(self._info.stop_token_ids))


    def compile_grammar(self, grammar: xgr.Grammar) -> CompiledGrammar:
        """Compile a grammar built elsewhere (a forced tool call: tool_choice.py)."""
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise StructuredOutputError(f"invalid grammar: {xgrammar_reason(exc)}") from None
        return CompiledGrammar(compiled, self.vocab_size, tuple(self._info.stop_token_ids))


def schema_problem(response_format: dict | None, forced: list[dict] | None = None) -> str | None:
    """Why the grammar compiler would refuse a request's `response_format`, or the parameters
    schema of a function its tool_choice forces (`forced`: request_checks.forced_functions),
    without a tokenizer: the JSON schema is converted exactly as compile() converts it (the
    tokenizer only precomputes masks afterwards). None when it converts. `batchgen validate`
    calls it, so it refuses the lines a job's worker would."""
    try:
        schema, strict = response_format_schema(response_format)
    except StructuredOutputError as err:
        return str(err)
    if schema is not None:
        problem = _schema_problem(json.dumps(schema), strict, True)
        if problem is not None:
            return f"response_format: invalid JSON schema: {problem}"
    for fn in forced or ():
        problem = _schema_problem(json.dumps(fn["parameters"]), True, False)  # as tool_choice.py
        if problem is not None:
            return f"tools: a parameters schema cannot be enforced: {problem}"
    return None


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str, strict: bool, any_whitespace: bool) -> str | None:
    try:
        xgr.Grammar.from_json_schema(schema, strict_mode=strict, any_whitespace=any_whitespace,
                                     max_whitespace_cnt=MAX_WHITESPACE if any_whitespace else None)
    except (RuntimeError, ValueError) as exc:
        return xgrammar_reason(exc)
    return None


def xgrammar_reason(exc: Exception) -> str:
    """The first line of an xgrammar error without its "[time] file.cc:line: " prefix."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


class GrammarMatcher:
    """Grammar state of one sequence: which tokens may come next."""

    def __init__(self, grammar: CompiledGrammar):
        self.vocab_size = grammar.vocab_size
        self.stop_token_ids = grammar.stop_token_ids
        self._matcher = xgr.GrammarMatcher(grammar.grammar)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write allowed tokens as bits into ``bitmask[row]`` (int32 CPU, see allocate_bitmask)."""
        if self._matcher.is_terminated():
            # xgrammar refuses to fill after the stop token; keep the sequence able to stop.
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write allowed tokens into a bool tensor of shape [vocab_size] (any device)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        out.copy_(unpack_bitmask(bitmask, self.vocab_size)[0])

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        return self._matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete JSON value."""
        return self._matcher.is_terminated()


def _bit(position: int) -> int:
    # int32 bitmask: bit 31 must be written as a negative number.
    return (1 << position) - (1 << 32 if position == 31 else 0)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 CPU tensor [rows, ceil(vocab/32)], all tokens allowed (-1 = every bit set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from an int32 bitmask; bit j of word w is token 32 * w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Pure-PyTorch oracle: logits[r, t] = -inf where token t is not allowed, for r in rows."""
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device)[index], logits.shape[-1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_masks(
    logits: torch.Tensor,
    matchers: list[GrammarMatcher | None],
    bitmask: torch.Tensor | None = None,
) -> None:
    """Mask disallowed tokens to -inf in place, for the rows of ``logits [S, V]`` with a matcher.

    One bitmask fill per constrained row (in xgrammar's C++ loop) and one masking kernel for the
    whole batch; rows whose matcher is None are untouched. ``bitmask`` is an optional reusable
    buffer from ``allocate_bitmask(max_rows, V)`` (without one, each call makes its own). Its
    rows are rewritten every call; the caller must not call again before the previous step's
    tokens were read back to the CPU (which accept() needs anyway).
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    if logits.dim() != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"logits must be [len(matchers), V], got {tuple(logits.shape)}")
    vocab_size = matchers[rows[0]].vocab_size
    if logits.shape[1] != vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns, grammar vocab is {vocab_size}")
    if bitmask is None:
        # No initial value needed: every applied row is written below. torch.full would cost
        # page faults on every step (measured ~3 ms for 64 rows on the H200 host).
        bitmask = torch.empty((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    if bitmask.shape[0] < len(matchers) or bitmask.shape[1] != (vocab_size + 31) // 32:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} is too small for {tuple(logits.shape)}")
    live = [i for i in rows if not matchers[i].is_terminated()]
    for i in set(rows) - set(live):
        matchers[i].fill_bitmask(bitmask, i)  # finished: stop tokens only
    if live:
        _batch_filler().batch_fill_next_token_bitmask(
            [matchers[i]._matcher for i in live], bitmask, indices=live
        )
    device_mask = bitmask[: len(matchers)].to(logits.device, non_blocking=True)
    _apply_bitmask(logits, device_mask, rows, vocab_size)


@functools.cache
def _batch_filler() -> xgr.BatchGrammarMatcher:
    # A thread pool; created once, shared by every batch.
    return xgr.BatchGrammarMatcher(max_threads="auto")


def _apply_bitmask(logits, bitmask, rows: list[int], vocab_size: int) -> None:
    device = logits.device.type
    backend = "cpu" if device == "cpu" else _cuda_backend() if device == "cuda" else None
    if backend is None or not logits.is_contiguous() or logits.dtype != torch.float32:
        apply_bitmask_reference(logits, bitmask, rows)
        return
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=vocab_size, indices=rows, backend=backend
    )


@functools.cache
def _cuda_backend() -> str | None:
    """xgrammar's CUDA masking kernel is written in Triton; without it use the reference."""
    return "triton" if importlib.util.find_spec("triton") is not None else None
