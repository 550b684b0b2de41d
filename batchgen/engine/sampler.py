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
    """Per-row sampling settings for one step; built by the runner from the sequences."""

    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]
    """Tokens generated so far by each row's sequence (the noise counter)."""
    banned: list[tuple[int, ...]]
    """Token ids each row may not emit now (EOS and stop ids before min_tokens)."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, rows: SamplingRows,
           allowed: torch.Tensor | None = None) -> SampleResult:
    """logits `[S, V]` float32 -> one token per row. `allowed` is an optional bool `[S, V]`
    mask (structured outputs)."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs for p in rows.params) else None
    logits = _apply_bans(logits, rows.banned, allowed)
    chosen = logits.argmax(dim=-1)
    if not all(p.greedy for p in rows.params):  # decided on the host: no device round trip
        greedy = torch.tensor([p.greedy for p in rows.params], device=logits.device)
        chosen = torch.where(greedy, chosen, _sample_random(logits, rows))
    tokens = chosen.tolist()
    return SampleResult(tokens, _gather_logprobs(raw_logprobs, tokens, rows.params))


def _apply_bans(logits, banned, allowed):
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if any(banned):
        logits = logits.clone() if allowed is None else logits
        # One indexed write for every (row, token) pair: a write per row is a kernel launch
        # per sequence on the GPU.
        rows = [row for row, ids in enumerate(banned) for _ in ids]
        cols = [token for ids in banned for token in ids]
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    device = logits.device
    params = rows.params
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=device)
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    logprobs = _truncate(logprobs, params)
    seeds = torch.tensor(rows.seeds, dtype=torch.int64, device=device)
    steps = torch.tensor(rows.steps, dtype=torch.int64, device=device)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
    return (logprobs + gumbel).argmax(dim=-1)


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p (in that order) by masking to -inf."""
    device = logprobs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logprobs.shape[-1] for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((top_k < logprobs.shape[-1]).any()) or bool((top_p < 1.0).any()):
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        rank = torch.arange(logprobs.shape[-1], device=device)[None, :]
        probs = sorted_lp.exp()
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        drop = (rank >= top_k[:, None]) | (before >= top_p[:, None])
        drop[:, 0] = False
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logprobs = torch.empty_like(logprobs).scatter_(-1, order, sorted_lp)
    if bool((min_p > 0).any()):
        threshold = logprobs.max(dim=-1, keepdim=True).values + torch.log(min_p[:, None].clamp_min(1e-30))
        logprobs = logprobs.masked_fill((logprobs < threshold) & (min_p[:, None] > 0), float("-inf"))
    return logprobs


def _gather_logprobs(raw: torch.Tensor | None, tokens: list[int],
                     params: list[SamplingParams]) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(tokens)
    k = max(p.top_logprobs for p in params)
    top_vals, top_ids = (raw.topk(k, dim=-1) if k else (None, None))
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
    out: list[TokenLogprob | None] = []
    for row, (p, token) in enumerate(zip(params, tokens)):
        if not p.logprobs:
            out.append(None)
            continue
        top = []
        if p.top_logprobs:
            top = list(zip(top_ids[row, : p.top_logprobs].tolist(),
                           top_vals[row, : p.top_logprobs].tolist()))
        out.append(TokenLogprob(token, chosen[row], top))
    return out
