"""What every model family shares.

PreNormDecoderLayer: x + attn(norm(x)), then x + mlp(norm(x)); a subclass builds self_attn, mlp,
input_layernorm and post_attention_layernorm. DecoderStack: embed_tokens -> layers -> norm.
PagedCausalLM: the LM head over the rows that sample and tied embeddings; a subclass builds
`config`, `model` (a DecoderStack) and `lm_head`, then sets `kv_token_shape` and `max_context`.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.forward_batch import ForwardBatch


class PreNormDecoderLayer(nn.Module):
    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


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
