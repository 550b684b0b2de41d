"""Host reservation chunk: static, or adapted to observed decode lengths (EMA)."""

from __future__ import annotations

from batchgen.config import SchedulerConfig


class ChunkSizer:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.ema: float | None = None
        self.history: list[tuple[int, int]] = []
        """(finished count, chunk) each time the adaptive chunk changed."""
        self._finished = 0

    @property
    def chunk_tokens(self) -> int:
        if not self.cfg.adaptive_chunk or self.ema is None:
            return self.cfg.host_kv_chunk_size
        estimate = int(self.ema * self.cfg.adaptive_chunk_multiplier)
        return max(self.cfg.adaptive_chunk_min, min(self.cfg.adaptive_chunk_max, estimate))

    def observe(self, decode_len: int) -> None:
        """Record the decode length of a sequence that finished."""
        self._finished += 1
        alpha = self.cfg.adaptive_chunk_ema_alpha
        before = self.chunk_tokens
        self.ema = decode_len if self.ema is None else alpha * decode_len + (1 - alpha) * self.ema
        if self.cfg.adaptive_chunk and self.chunk_tokens != before:
            self.history.append((self._finished, self.chunk_tokens))
