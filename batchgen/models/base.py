"""What every model class shares: the LM head over the rows that sample, and tied embeddings.

A subclass builds `self.config`, `self.model` (embed_tokens ... norm, called with a
ForwardBatch) and `self.lm_head`, then sets `kv_token_shape` and `max_context`.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.forward_batch import ForwardBatch


class PagedCausalLM(nn.Module):
    config: object
    model: nn.Module
    lm_head: nn.Linear

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after to_empty)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[S, vocab]` (float32) of the rows in `batch.logits_indices` only."""
        hidden = self.model(batch)
        return self.lm_head(hidden[batch.logits_indices]).float()
