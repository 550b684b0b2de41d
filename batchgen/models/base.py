"""What every model family shares.

PreNormDecoderLayer: x + attn(norm(x)), then x + mlp(norm(x)); a subclass builds self_attn, mlp,
input_layernorm and post_attention_layernorm. DecoderStack: embed_tokens -> layers -> norm.
PagedCausalLM: the LM head over the rows that sample and tied embeddings; a subclass builds
`config`, `model` (a DecoderStack) and `lm_head`, then sets `kv_token_shape` and `max_context`.

The model runs as a chain of segments, each `(x, batch) -> x` (the first ignores x): the
forward is that chain, and per-segment CUDA graphs (BATCHGEN_SEGMENTED_GRAPH=1) capture one
graph per link.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from batchgen.engine.forward_batch import ForwardBatch

Segment = Callable[[torch.Tensor | None, ForwardBatch], torch.Tensor]
"""One link of a model's forward: `(x, batch) -> x`."""


class PreNormDecoderLayer(nn.Module):
    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch)
        add_and_norm = getattr(self.post_attention_layernorm, "add_and_norm", None)
        if add_and_norm is not None:  # one fused kernel on CUDA
            normed, x = add_and_norm(attn, x)
        else:
            x = x + attn
            normed = self.post_attention_layernorm(x)
        return x + self.mlp(normed)


class DecoderStack(nn.Module):
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module

    def segments(self) -> list[Segment]:
        """The embedding, each decoder layer, the final norm."""
        return [lambda _, batch: self.embed_tokens(batch.input_ids), *self.layers,
                lambda x, _: self.norm(x)]


class PagedCausalLM(nn.Module):
    config: object
    model: nn.Module
    lm_head: nn.Linear

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after to_empty)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def segments(self) -> list[Segment]:
        """The stack's segments, then the LM head."""
        return [*self.model.segments(),
                lambda hidden, batch: self.lm_head(hidden[batch.logits_indices]).float()]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[S, vocab]` (float32) of the rows in `batch.logits_indices` only."""
        x = None
        for segment in self.segments():
            x = segment(x, batch)
        return x
