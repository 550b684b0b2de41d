"""Presence, frequency and repetition penalties and logit biases, kept on the device across a
burst's steps.

A burst draws its tokens on the device without telling the host, so the counts that the
penalties need are tensors updated with each step's samples, and a burst that continues
another carries its rows' counts over (the host has not seen the last tokens yet)."""

from __future__ import annotations

import torch

from batchgen.sched.sequence import Sequence


def _upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class Penalties:
    """The penalized rows of a batch: their coefficients and, once the vocabulary is known
    (the first logits), `counts` [P, V] of each token in the answer so far and `seen` [P, V]
    (prompt or answer) for the repetition penalty; `bias` [P, V] holds the rows' logit biases
    when any row has one."""

    def __init__(self, rows: list[int], presence: list[float], frequency: list[float],
                 repetition: list[float], answers: list[list[int]], prompts: list[list[int]],
                 biases: list[tuple[tuple[int, float], ...]] | None = None):
        self.rows, self._coefficients = rows, (presence, frequency, repetition)
        self._answers, self._prompts = answers, prompts
        self._biases = biases if biases is not None else [() for _ in rows]
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    @classmethod
    def of(cls, seqs: list[Sequence]) -> Penalties | None:
        """From the tokens the host holds; None when no row asks for a penalty."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.penalized]
        if not rows:
            return None
        chosen = [seqs[i] for i in rows]
        return cls(rows, [s.sampling.presence_penalty for s in chosen],
                   [s.sampling.frequency_penalty for s in chosen],
                   [s.sampling.repetition_penalty for s in chosen],
                   [s.token_ids[s.prompt_len:] for s in chosen],
                   [s.token_ids[:s.prompt_len] if s.sampling.repetition_penalty != 1.0 else []
                    for s in chosen],
                   [s.sampling.logit_bias for s in chosen])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, V] with the biases and then the penalties applied to their rows (a
        new tensor), in vLLM's order.
        Each apply is followed by the update with the samples drawn from it."""
        if self.counts is None:
            self._materialize(logits.shape[-1], logits.device)
        presence, frequency, repetition = self._device_coefficients
        rows = self._device_rows
        sub = logits.index_select(0, rows)
        if self.bias is not None:  # before the penalties, as vLLM: (logit + bias) / repetition
            sub = sub + self.bias
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(self.seen, scaled, sub)
        counts = self.counts.float()
        sub = sub - frequency * counts - presence * (counts > 0).float()
        return logits.index_copy(0, rows, sub)

    def update(self, tokens: torch.Tensor) -> None:
        """Count one step's samples `tokens` [S] (on the device, no sync)."""
        picked = tokens.index_select(0, self._device_rows)
        slots = torch.arange(len(self.rows), device=tokens.device)
        self.counts.index_put_((slots, picked), torch.ones_like(picked, dtype=torch.int32),
                               accumulate=True)
        self.seen.index_put_((slots, picked), torch.ones_like(picked, dtype=torch.bool))

    def continued(self, kept: list[int]) -> Penalties | None:
        """The penalties of a burst that continues this one with the rows `kept` (indices of
        this batch's rows, in the new order): their counts as this burst's steps leave them."""
        slot_of = {row: slot for slot, row in enumerate(self.rows)}
        pairs = [(new, slot_of[old]) for new, old in enumerate(kept) if old in slot_of]
        if not pairs:
            return None
        slots = [slot for _, slot in pairs]
        nxt = Penalties([new for new, _ in pairs], *[[c[i] for i in slots]
                                                      for c in self._coefficients],
                        [self._answers[i] for i in slots], [self._prompts[i] for i in slots],
                        [self._biases[i] for i in slots])
        if self.counts is not None:
            index = _upload(slots, torch.long, self.counts.device)
            nxt._to_device(self.counts.device)
            nxt.counts, nxt.seen = self.counts[index], self.seen[index]
            nxt.bias = self.bias[index] if self.bias is not None else None
        return nxt

    def _to_device(self, device: torch.device) -> None:
        self._device_rows = _upload(self.rows, torch.long, device)
        self._device_coefficients = tuple(_upload(c, torch.float32, device)[:, None]
                                          for c in self._coefficients)

    def _materialize(self, vocab: int, device: torch.device) -> None:
        self._to_device(device)
        self.counts = torch.zeros(len(self.rows), vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(len(self.rows), vocab, dtype=torch.bool, device=device)
        answers = [(slot, t) for slot, ids in enumerate(self._answers) for t in ids if t < vocab]
        if answers:
            slots, ids = (_upload(list(v), torch.long, device) for v in zip(*answers))
            self.counts.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.int32),
                                   accumulate=True)
        self.seen |= self.counts > 0
        prompts = [(slot, t) for slot, ids in enumerate(self._prompts) for t in ids if t < vocab]
        if prompts:
            slots, ids = (_upload(list(v), torch.long, device) for v in zip(*prompts))
            self.seen[slots, ids] = True
        biased = [(slot, t, b) for slot, pairs in enumerate(self._biases) for t, b in pairs
                  if t < vocab]  # intake refused ids past the tokenizer's vocabulary
        if biased:
            slots, ids, values = zip(*biased)
            self.bias = torch.zeros(len(self.rows), vocab, dtype=torch.float32, device=device)
            self.bias[_upload(list(slots), torch.long, device),
                      _upload(list(ids), torch.long, device)] = _upload(list(values),
                                                                        torch.float32, device)
