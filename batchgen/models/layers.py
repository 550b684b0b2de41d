"""Building blocks shared by the model families (pure PyTorch; kernels replace them on GPU)."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from batchgen.models.fp8_rowwise import QuantizedRows
from batchgen.models.registry import UnsupportedModelError, yarn_positions
from batchgen.parallel import TensorParallel

log = logging.getLogger("batchgen.models")

SINGLE = TensorParallel()
"""No tensor parallelism: layers built without a group get this one (immutable)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp8_rows = False
        """Return QuantizedRows on CUDA: the output feeds only a row-scaled FP8 projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedRows:
        if x.is_cuda and x.dim() == 3 and not self.fp8_rows:  # per-head: Qwen3's q/k norms
            from batchgen_kernels import rmsnorm_heads

            return rmsnorm_heads(x, self.weight, self.eps)
        if x.is_cuda and x.dim() == 2:
            from batchgen_kernels import rmsnorm, rmsnorm_fp8

            if self.fp8_rows:
                return QuantizedRows(*rmsnorm_fp8(x, self.weight, self.eps))
            return rmsnorm(x, self.weight, self.eps)
        return self._reference(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum rounded to x's dtype first: one kernel
        on CUDA instead of an add and a norm."""
        if x.is_cuda and x.dim() == 2:
            from batchgen_kernels import fused_add_rmsnorm, fused_add_rmsnorm_fp8

            if self.fp8_rows:
                q, scales, h = fused_add_rmsnorm_fp8(x, residual, self.weight, self.eps)
                return QuantizedRows(q, scales), h
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        h = residual + x
        return self._reference(h), h

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as HF Llama does: bitwise
        # agreement with the reference matters more than a fused cast here.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """Rope settings across transformers versions (`rope_parameters` in 5.x, else
    `rope_theta` + `rope_scaling`). `layer_type`: the settings of that kind of layer, for a
    config with one rope per kind (Gemma 3's "sliding_attention" / "full_attention": nested
    in 5.x; in 4.x its sliding layers take `rope_local_base_freq` unscaled)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and hasattr(hf_config, "rope_local_base_freq"):
        params = {"rope_type": "default", "rope_theta": hf_config.rope_local_base_freq}
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(hf_config, head_dim: int,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, llama3/linear/yarn scaling included; of
    `layer_type`'s rope where a config has one per kind of layer (`rope_parameters`).

    Scaled variants come from transformers' own table so they match the reference exactly.
    """
    params = rope_parameters(hf_config, layer_type)
    kind = params["rope_type"]
    if kind == "default":
        base = params["rope_theta"]
        share = params.get("partial_rotary_factor",
                           getattr(hf_config, "partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * share)  # Phi-4-mini rotates 3/4 of each head
        even = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / (base ** (even / rotary_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(sorted(ROPE_INIT_FUNCTIONS))
        raise UnsupportedModelError(f"rope_type {kind!r} (config.json's rope scaling) is not "
                                    f"supported; batchgen takes {known}")
    nested = isinstance((getattr(hf_config, "rope_parameters", None) or {}).get(layer_type), dict)
    extra = {"layer_type": layer_type} if nested else {}
    with torch.device("cpu"):  # models are built under the meta device; this table is real
        inv, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", **extra)
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table.

    Models are built on the meta device; `reset_buffers()` fills the table once the module
    has real storage (the loader calls it on every module that has one).
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        super().__init__()
        self.inv_freq = inv_freq.float().cpu()
        self.max_positions = max_positions
        self.scaling = scaling
        dim = 2 * inv_freq.numel()
        self.register_buffer("cos", torch.empty(max_positions, dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.cos.device
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self.scaling).to(self.cos.dtype)
        self.sin = (emb.sin() * self.scaling).to(self.sin.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, KVH, D]; rotates the first `rotary_dim` features."""
        if q.is_cuda:
            from batchgen_kernels import apply_rope

            return apply_rope(q, k, positions, self.cos, self.sin, torch.empty_like(q),
                              torch.empty_like(k))
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    # Multiply in the activation dtype, as the HF reference does (bitwise parity in bf16).
    out = rot * cos + rotated * sin
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


class RowParallelLinear(nn.Linear):
    """y = x W^T + b where each TP rank holds a slice of W's input columns (and of x's
    features): the partial products are summed over the group, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce_output: bool = True):
        super().__init__(tp.split(in_features, "input features"), out_features, bias=bias)
        self.tp = tp
        self.reduce_output = reduce_output
        """False: the caller sums the partial outputs (with others, in one all-reduce)."""
        assert reduce_output or not bias, "an unreduced partial output cannot take the bias"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = nn.functional.linear(x, self.weight)
        if self.reduce_output:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def gate_activation(hidden_act: str | None) -> nn.Module | None:
    """The gated MLP's activation from the config's `hidden_act`: None for SiLU (the fused
    kernels' case), else transformers' own module, so the numbers are HF's."""
    if hidden_act in (None, "silu", "swish"):
        return None
    from transformers.activations import ACT2FN

    act = ACT2FN[hidden_act] if hidden_act in ACT2FN else None
    if act is None or any(True for _ in act.parameters()):
        raise UnsupportedModelError(
            f"hidden_act {hidden_act!r} is not supported; batchgen's MLPs take SiLU or any "
            "parameter-free activation of transformers.activations.ACT2FN")
    return act


class GatedMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), SiLU unless the config says otherwise;
    TP splits the intermediate features."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce_output: bool = True,
                 hidden_act: str | None = None):
        super().__init__()
        local = tp.split(intermediate, "intermediate_size")
        self.gate_proj = nn.Linear(hidden, local, bias=bias)
        self.up_proj = nn.Linear(hidden, local, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp,
                                           reduce_output=reduce_output)
        self.act = gate_activation(hidden_act) or nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """GatedMLP with gate and up in one matmul: down(act(gate) * up), x @ [gate | up]; with
    SiLU one kernel applies it on the GPU. TP splits the intermediate features: each rank
    holds [its gate rows | its up rows]."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, hidden_act: str | None = None):
        super().__init__()
        self.local_intermediate = tp.split(intermediate, "intermediate_size")
        self.gate_up_proj = nn.Linear(hidden, 2 * self.local_intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp)
        self.act = gate_activation(hidden_act)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is None and gate_up.is_cuda:
            from batchgen_kernels import silu_and_mul, silu_and_mul_fp8

            if getattr(self.down_proj, "row_scaled", False):  # an FP8 down_proj takes rows
                return self.down_proj(QuantizedRows(*silu_and_mul_fp8(gate_up)))
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        act = nn.functional.silu if self.act is None else self.act
        return self.down_proj(act(gate) * up)


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """The token embedding with uninitialised weights: a model is built on the meta device and
    its weights are always loaded, and nn.Embedding's own normal_ init, even on the meta
    device, costs about a second of CPU the first time a process runs it."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


def default_max_positions(hf_config, quiet: bool = False) -> int:
    """The longest context the model runs: `max_position_embeddings`, except for longrope.
    HF switches a longrope model to its long factors in every forward whose sequence passes
    `original_max_position_embeddings` (keys cached earlier keep their rotation), which a
    static cos/sin table cannot follow; up to that length the short factors hold and results
    are exact, so the context stops there: longer prompts become per-line errors naming it.
    Dynamic NTK scaling likewise begins only past `max_position_embeddings`: below it the rope
    is unscaled, and the context stops there too (with a warning, as for longrope). A config
    with a rope per kind of layer (Gemma 3's) stops where the first of them would change.
    YaRN's frequencies are fixed, so its context reaches `original_max_position_embeddings` x
    `factor` where that passes `max_position_embeddings` (Qwen's recommended long-context
    settings leave the latter at the trained length), as vLLM derives it. `quiet`: without
    the log lines saying so (the model's max_context says them; its rope table asks again)."""
    log_info = (lambda *a: None) if quiet else log.info
    log_warning = (lambda *a: None) if quiet else log.warning
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 32768)
    ropes = _every_rope(hf_config)
    stretched = max((yarn_positions(params) for params in ropes), default=0)
    if stretched > limit:
        log_info("yarn: context %d tokens (original_max_position_embeddings x factor; "
                 "max_position_embeddings is %d)", stretched, limit)
        limit = stretched
    for params in ropes:
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if params["rope_type"] == "longrope" and original and int(original) < limit:
            log_warning("longrope: context limited to original_max_position_embeddings = %d "
                        "tokens (of %d); its long factors are not implemented", original, limit)
            limit = int(original)
    if any(params["rope_type"] == "dynamic" for params in ropes):
        log_warning("dynamic rope scaling: context limited to max_position_embeddings = %d "
                    "tokens, where its scaling would begin (the factor does not lengthen it)",
                    limit)
    return limit


def _every_rope(hf_config) -> list[dict]:
    """The settings of each rope a config sets: one, or one per kind of layer where
    `rope_parameters` nests them (Gemma 3's "sliding_attention" / "full_attention")."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    kinds = [kind for kind, value in nested.items() if isinstance(value, dict)]
    return [rope_parameters(hf_config, kind) for kind in kinds] or [rope_parameters(hf_config)]


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
