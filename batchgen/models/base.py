"""What every model family shares.

PreNormDecoderLayer: x + attn(norm(x)), then x + mlp(norm(x)); a subclass builds self_attn, mlp,
input_layernorm and post_attention_layernorm. Each residual add happens inside the next norm
(`add_then_norm`), so a layer hands on (residual, its MLP output). DecoderStack: embed_tokens
-> layers -> norm.
PagedCausalLM: the LM head over the rows that sample and tied embeddings; a subclass builds
`config`, `model` (a DecoderStack) and `lm_head`, then sets `kv_token_shape` and `max_context`.

The model runs as a chain of segments, each `(x, batch) -> x` (the first ignores x): the
forward is that chain, and per-segment CUDA graphs (BATCHGEN_SEGMENTED_GRAPH=1) capture one
graph per link.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from batchgen.forward_batch import ForwardBatch

Segment = Callable[[object, ForwardBatch], object]
"""One link of a model's forward: `(x, batch) -> x`, where x is whatever the link before
returned (a tensor, or a decoder layer's (residual, pending) pair)."""


Stream = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What a decoder layer passes on: the residual stream, or (residual, pending) where pending
is the previous layer's MLP output that the next norm adds in (one fused kernel on CUDA)."""


def add_then_norm(norm: nn.Module, x: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream) with a pending output added to the residual stream first."""
    if not isinstance(x, tuple):
        return norm(x), x
    residual, pending = x
    add_and_norm = getattr(norm, "add_and_norm", None)
    if add_and_norm is not None:
        return add_and_norm(pending, residual)
    summed = residual + pending
    return norm(summed), summed


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(...)); each branch's output times
    `residual_multiplier` before it is added (Granite's; 1 elsewhere)."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    residual_multiplier = 1.0

    def forward(self, x: Stream, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x + attn(norm(x)), then that + mlp(norm(that)); the last add is left pending:
        -> (residual, mlp output) for the next layer's input norm or the final norm."""
        normed, residual = add_then_norm(self.input_layernorm, x)
        attn = self._scaled(self.self_attn(normed, batch))
        normed, residual = add_then_norm(self.post_attention_layernorm, (residual, attn))
        return residual, self._scaled(self.mlp(normed))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        multiplier = self.residual_multiplier
        return branch if multiplier == 1.0 else branch * multiplier


class DecoderStack(nn.Module):
    """embed_tokens (times `embedding_multiplier`: Granite's; 1 elsewhere) -> layers -> norm."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    embedding_multiplier = 1.0

    def segments(self) -> list[Segment]:
        """The embedding, each decoder layer, the final norm."""
        return [self._embed, *self.layers, lambda x, _: add_then_norm(self.norm, x)[0]]

    def _embed(self, _, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier


class PagedCausalLM(nn.Module):
    config: object
    model: nn.Module
    lm_head: nn.Linear
    shared_prefix_decode = True
    """Whether decode attention reads a group's shared prefix pages once
    (`ForwardBatch.prefix_groups`); False where attention keeps another cache layout."""
    logits_scaling = 1.0
    """The LM head's output is divided by it (Granite's `logits_scaling`; 1 elsewhere)."""
    generates = True
    """False for a checkpoint with no LM head (a bare decoder stack, as embedding models ship):
    it answers /v1/embeddings lines only."""
    probe_without_kernels = True
    """Whether a forward may run with its Triton kernels skipped, as start-up's precompile pass
    does (`engine.precompile`): True where every kernel's output only feeds arithmetic, False
    where one is read as indices or on the host (MoE routing), which garbage would break."""

    @contextmanager
    def probe_layers(self):
        """Inside, a forward runs the first two and the last two decoder layers only: start-up's
        precompile pass (`engine.precompile`), for which the layers between launch the same
        kernel variants, runs 8x faster on a 32-layer model."""
        layers = self.model.layers
        if len(layers) > 4:
            self.model.layers = nn.ModuleList([layers[0], layers[1], layers[-2], layers[-1]])
        try:
            yield
        finally:
            self.model.layers = layers

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after to_empty)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def segments(self) -> list[Segment]:
        """The stack's segments, then the LM head."""
        return [*self.model.segments(), self._logits]

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = self.lm_head(hidden[batch.logits_indices])
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[S, vocab]` of the rows in `batch.logits_indices` only, in the model's
        dtype: the sampler casts them to float32 unless an argmax is all it needs."""
        x = None
        for segment in self.segments():
            x = segment(x, batch)
        return x
