"""Batched sampling with per-request seeds that do not depend on the batch.

Randomness is counter-based: the noise for (seed, step, token) comes from an integer hash, so a
sequence draws the same numbers whichever sequences share its batch, on CPU and GPU alike, with
no per-sequence generator objects and no host sync. Sampling is the exponential race
(argmax p / E, E ~ Exp(1)), written as Gumbel-max on log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.core import SamplingParams, TokenLogprob
from batchgen.engine.penalties import Penalties

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) float32 `[S, vocab]` that depends only on (seed, step, token id)."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    key = _hash32(_hash32(lo ^ _hash32(hi)) ^ ((steps * 0x9E3779B1) & _MASK32))
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32(key[:, None] ^ _hash32(token[None, :] + 0x632BE5AB))
    # 23 bits: (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1). With 24 bits the
    # top value rounds to 1.0, whose Gumbel noise is +inf (and -inf + inf = NaN wins argmax).
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingRows:
    """Per-row sampling settings for one step; built by the engine from the sequences
    (Engine._sampling_rows)."""

    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]
    """Tokens generated so far by each row's sequence (the noise counter)."""
    banned: list[tuple[int, ...]]
    """Token ids each row may not emit now (EOS and stop ids before min_tokens)."""
    penalties: Penalties | None = None
    """The rows' presence / frequency / repetition penalties: one object shared by a burst's
    steps, each step counting its samples into it; None when no row has one."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class DeviceSample:
    """One step's samples still on the device: reading them is what waits for the GPU."""

    tokens: torch.Tensor
    """[S] int64 sampled ids."""
    chosen_logprobs: torch.Tensor | None = None
    """[S] float32 log-probability of each sampled id (when any row wants logprobs)."""
    top_ids: torch.Tensor | None = None
    """[S, k] most likely ids, k = the largest top_logprobs asked."""
    top_logprobs: torch.Tensor | None = None


def sample(logits: torch.Tensor, rows: SamplingRows) -> SampleResult:
    """logits `[S, V]` -> one token per row (grammar masks, where rows have them, are applied
    to `logits` before: ModelRunner.execute's logits_processor)."""
    return HostSample(sample_on_device(logits, rows)).result(rows)


def sample_on_device(logits: torch.Tensor, rows: SamplingRows) -> DeviceSample:
    """Sample without waiting for the device: every branch is decided from host values."""
    want_logprobs = any(p.logprobs for p in rows.params)
    if (not want_logprobs and not any(rows.banned)
            and rows.penalties is None and all(p.greedy for p in rows.params)):
        # A float32 copy of bf16 logits would be exact, so its argmax is this one.
        return DeviceSample(logits.argmax(dim=-1))
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if rows.penalties is not None:
        logits = rows.penalties.apply(logits)  # before temperature and truncation, as vLLM
    logits = _apply_bans(logits, rows.banned)
    chosen = logits.argmax(dim=-1)
    if not all(p.greedy for p in rows.params):
        greedy = _upload([p.greedy for p in rows.params], torch.bool, logits.device)
        chosen = torch.where(greedy, chosen, _sample_random(logits, rows))
    if rows.penalties is not None:
        rows.penalties.update(chosen)
    if raw_logprobs is None:
        return DeviceSample(chosen)
    k = max(p.top_logprobs for p in rows.params)
    top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
    return DeviceSample(chosen, raw_logprobs.gather(1, chosen[:, None])[:, 0], top_ids, top_vals)


class HostSample:
    """A DeviceSample on its way to the host: the copies are queued behind the step that
    drew it (into pinned memory on a GPU), so a burst can hand each step's tokens to the
    host while its later steps still run."""

    def __init__(self, sample: DeviceSample):
        self._fields = [None if t is None else t.to("cpu", non_blocking=True)
                        for t in (sample.tokens, sample.chosen_logprobs, sample.top_ids,
                                  sample.top_logprobs)]
        self._ready = None
        if sample.tokens.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self, rows: SamplingRows) -> SampleResult:
        """The samples as host values; waits for the step (only) that drew them."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, chosen, top_ids, top_vals = (None if t is None else t.tolist()
                                             for t in self._fields)
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if chosen is not None:
            for row, p in enumerate(rows.params):
                if not p.logprobs:
                    continue
                top = []
                if top_ids is not None and p.top_logprobs:
                    top = list(zip(top_ids[row][: p.top_logprobs], top_vals[row][: p.top_logprobs]))
                logprobs[row] = TokenLogprob(tokens[row], chosen[row], top)
        return SampleResult(tokens, logprobs)


def _upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without a sync (a plain `torch.tensor(..., device=cuda)`
    waits for the stream)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _apply_bans(logits, banned):
    """`logits` with each row's `banned` ids at -inf (a copy; the same tensor when no row
    bans any)."""
    if any(banned):
        logits = logits.clone()
        # One indexed write for every (row, token) pair: a write per row is a kernel launch
        # per sequence on the GPU.
        rows = [row for row, ids in enumerate(banned) for _ in ids]
        cols = [token for ids in banned for token in ids]
        index = _upload([rows, cols], torch.long, logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    device = logits.device
    params = rows.params
    temp = _upload([max(p.temperature, 1e-5) for p in params], torch.float32, device)
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    logprobs = _truncate(logprobs, params)
    seeds = _upload(rows.seeds, torch.int64, device)
    steps = _upload(rows.steps, torch.int64, device)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
    return (logprobs + gumbel).argmax(dim=-1)


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p (in that order) by masking to -inf. Each filter sees the
    distribution the previous one left, renormalised (as HF's warpers and vLLM apply them):
    top-p's mass is counted among the top k tokens only."""
    device = logprobs.device
    vocab = logprobs.shape[-1]
    top_k_host = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # Which truncations apply is decided on the host: a .any() on the device would sync.
    if any(k < vocab for k in top_k_host) or any(p.top_p < 1.0 for p in params):
        top_k = _upload(top_k_host, torch.int64, device)
        top_p = _upload([p.top_p for p in params], torch.float32, device)
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        rank = torch.arange(logprobs.shape[-1], device=device)[None, :]
        sorted_lp = sorted_lp.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = sorted_lp.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        # top_p 1 keeps every token: over a large vocabulary the float32 sums reach 1.0
        # thousands of tokens before the tail ends, and `before >= 1` would drop those in
        # batches where another row's top_k or top_p runs this filter.
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logprobs = torch.empty_like(logprobs).scatter_(-1, order, sorted_lp)
    if any(p.min_p > 0 for p in params):
        min_p = _upload([p.min_p for p in params], torch.float32, device)
        floor = torch.log(min_p[:, None].clamp_min(1e-30))
        threshold = logprobs.max(dim=-1, keepdim=True).values + floor
        below = (logprobs < threshold) & (min_p[:, None] > 0)
        logprobs = logprobs.masked_fill(below, float("-inf"))
    return logprobs
