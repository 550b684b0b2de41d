"""Gemma 3's text models (Gemma3ForCausalLM, model_type gemma3_text: gemma-3-270m/1b and
their -it releases) on the Llama family's attention, MLP and weight loading (llama.py).

What differs from Llama, as HF's modeling_gemma3 computes it:
- every RMSNorm scales by (1 + weight), in float32, cast to the activation dtype after the
  weight (`GemmaRMSNorm`), the per-head q/k norms included;
- four norms a layer: the attention and the MLP outputs are normalised again before their
  residual adds (`Gemma3DecoderLayer`);
- the embedding times sqrt(hidden_size), that factor rounded to the model dtype first;
- the softmax scale is query_pre_attn_scalar ** -0.5;
- the MLP's activation is `hidden_activation` (GELU-tanh);
- the layers `layer_types` marks "sliding_attention" see a window of `sliding_window` keys and
  have their own rope (base `rope_local_base_freq`, unscaled); the others use `rope_theta` and
  its scaling;
- `final_logit_softcapping`, when set, caps the logits at tanh(x / c) * c.

Attention logit softcapping (Gemma 2's, and Gemma 3 configs that set it) is refused: the
attention kernels have no softcap. So is bidirectional attention (EmbeddingGemma).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from batchgen.forward_batch import ForwardBatch
from batchgen.models.base import DecoderStack, Stream, add_then_norm
from batchgen.models.layers import (SINGLE, FusedGatedMLP, RotaryEmbedding,
                                    default_max_positions, rope_inv_freq, token_embedding)
from batchgen.models.llama import Biases, LlamaAttention, LlamaForCausalLM
from batchgen.models.registry import UnsupportedModelError
from batchgen.parallel import TensorParallel


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back after the weight, as HF's
    Gemma3RMSNorm (Llama's RMSNorm casts before the weight). The weight is the checkpoint's,
    zero-centred; the +1 is added in float32 at each call, as HF does, so no precision is lost
    to a folded weight in bf16. Plain PyTorch on every device: the fused norm kernels round the
    normalised row before the weight multiply, which this form does not."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then that + post_ff_norm(mlp(pre_ff_norm(..))).
    Keeps base.py's stream contract: it takes (residual, pending) or a tensor and hands on
    (residual, its normalised MLP output), which the next layer's input norm (or the final
    norm) adds in."""

    def __init__(self, cfg, layer: int, kind: str, rope: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        bias = bool(getattr(cfg, "attention_bias", False))
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, layer, rope, Biases(bias, bias, False), True, tp)
        self.self_attn.q_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)
        self.self_attn.k_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)
        self.self_attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        window = getattr(cfg, "sliding_window", None)
        self.self_attn.window = int(window) if window and kind == "sliding_attention" else None
        self.mlp = FusedGatedMLP(hidden, cfg.intermediate_size, tp=tp,
                                 hidden_act=_activation(cfg))
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: Stream, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = add_then_norm(self.input_layernorm, x)
        attn = self.post_attention_layernorm(self.self_attn(normed, batch))
        normed, residual = add_then_norm(self.pre_feedforward_layernorm, (residual, attn))
        return residual, self.post_feedforward_layernorm(self.mlp(normed))


def _activation(cfg) -> str:
    """The MLP's activation: `hidden_activation` (Gemma's name), else `hidden_act`."""
    return (getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
            or "gelu_pytorch_tanh")


def layer_ropes(cfg, head_dim: int) -> list[tuple[str, RotaryEmbedding]]:
    """Each layer's kind and rope: one table per kind of layer (sliding / full), shared by the
    layers of that kind."""
    tables: dict[str, RotaryEmbedding] = {}
    kinds = _layer_types(cfg)
    for kind in dict.fromkeys(kinds):
        inv_freq, scaling = rope_inv_freq(cfg, head_dim, kind)
        tables[kind] = RotaryEmbedding(inv_freq, default_max_positions(cfg, quiet=True), scaling)
    return [(kind, tables[kind]) for kind in kinds]


def _layer_types(cfg) -> list[str]:
    """`layer_types`, or HF's default of every `sliding_window_pattern`-th layer full."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds:
        return list(kinds)
    pattern = int(getattr(cfg, "sliding_window_pattern", 6) or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(cfg.num_hidden_layers)]


class Gemma3Model(DecoderStack):
    def __init__(self, cfg, tp: TensorParallel):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        self.embedding_multiplier = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, kind, rope, tp)
                                    for i, (kind, rope) in enumerate(layer_ropes(cfg, head_dim)))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _embed(self, _, batch: ForwardBatch) -> torch.Tensor:
        """The embedding times sqrt(hidden_size) rounded to its dtype first, as HF's (55.4256
        is 55.5 in bf16)."""
        x = self.embed_tokens(batch.input_ids)
        return x * float(torch.tensor(self.embedding_multiplier, dtype=x.dtype))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text: the Llama family's weight loading (fused q|k|v and gate|up, tensor
    parallel by heads and intermediate features; the norms replicated) over Gemma3Model."""

    def __init__(self, hf_config, options=None, tp: TensorParallel = SINGLE):
        check_gemma_config(hf_config)
        super().__init__(hf_config, options, tp)
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    def _stack(self, hf_config, tp: TensorParallel) -> DecoderStack:
        return Gemma3Model(hf_config, tp)

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = super()._logits(hidden, batch)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def check_gemma_config(hf_config) -> None:
    """UnsupportedModelError for what the config asks that batchgen does not compute."""
    if getattr(hf_config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            f"config.json sets attn_logit_softcapping = {hf_config.attn_logit_softcapping}: "
            "batchgen's attention kernels have no logit softcapping, so this model would give "
            "wrong answers")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "config.json sets use_bidirectional_attention (an EmbeddingGemma-style encoder): "
            "batchgen runs causal attention only")
