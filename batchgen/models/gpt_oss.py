"""gpt-oss on the paged KV cache: GQA attention with biases, learned attention sinks and
alternating sliding-window / full layers (config.layer_types), YaRN rope, and a top-k routed
MoE of clamped-SwiGLU experts whose weights ship as MXFP4 (see batchgen/models/mxfp4.py).

Expert weights stay packed (uint8 blocks + e8m0 scales, ~4.25 bits per weight) and are
dequantized on the fly; `options.pre_dequantize_weights` dequantizes them to the model dtype
once at load time instead (~3.8x the memory, no per-step dequant).

Experts on CUDA (`GptOssExperts.forward_grouped`): the T*k assignments are sorted by expert on
the device, each projection is one grouped GEMM over the sorted rows (torch._grouped_mm for
bf16, the Triton `grouped_gemm` otherwise), after one dequantize launch of the whole packed bank
[E, out, in]. Nothing reads back to the host, so CUDA graphs can capture it. Elsewhere the
per-expert loop (`forward_loop`, dequantizing only the experts a batch uses) is the reference.
Dequantizing the whole bank each step writes and re-reads E * out * in bf16 values per projection
(~1.6 GB per gpt-oss-20b layer), where a fused MXFP4 grouped GEMM would read only the packed
bytes; pre-dequantized weights skip that traffic.

Parameter names follow the HF checkpoints; `load_weights` also takes the dense
`mlp.experts.gate_up_proj` / `down_proj` tensors HF `save_pretrained` writes for a bf16 model.

KV pages: a sliding layer never reads keys older than its window, but the scheduler must not
free those pages: gpt-oss interleaves full-attention layers that read every position, and a
page holds all layers' KV for its 64 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from batchgen.forward_batch import ForwardBatch
from batchgen.models.attention import paged_attention
from batchgen.models.base import DecoderStack, PagedCausalLM, PreNormDecoderLayer
from batchgen.models.fp8 import quant_method
from batchgen.models.layers import (
    RotaryEmbedding,
    default_max_positions,
    rope_inv_freq,
    softmax_scale,
    token_embedding,
)
from batchgen.models.mxfp4 import BLOCK, dequantize_mxfp4

DEFAULT_SLIDING_WINDOW = 128


class GptOssRMSNorm(nn.Module):
    """RMSNorm that multiplies by the weight in float32 before casting back (HF gpt-oss keeps
    its norms in float32; Llama casts first), which matters for bf16 parity."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def sliding_window(cfg, layer: int) -> int | None:
    """The window of a "sliding_attention" layer; None for full attention."""
    layer_types = getattr(cfg, "layer_types", None) or []
    if layer < len(layer_types) and layer_types[layer] == "sliding_attention":
        return int(getattr(cfg, "sliding_window", None) or DEFAULT_SLIDING_WINDOW)
    return None


class GptOssAttention(nn.Module):
    def __init__(self, cfg, layer: int, rope: RotaryEmbedding):
        super().__init__()
        bias = bool(getattr(cfg, "attention_bias", True))
        self.layer = layer
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        # One learned logit per head that joins every softmax but contributes no value.
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.rope = rope
        self.window = sliding_window(cfg, layer)
        self.scale = softmax_scale(self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer, batch, self.scale, window=self.window,
                              sinks=self.sinks, rope=self.rope)
        return self.o_proj(out.reshape(-1, self.heads * self.head_dim))


class TopKRouter(nn.Module):
    """Linear (with bias) over the experts, top-k, softmax over the k chosen logits."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_local_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class ExpertWeights(nn.Module):
    """The `[E, out, in]` weights of one projection of every expert, stored either packed
    (MXFP4 `blocks` [E, out, in/32, 16] + `scales` [E, out, in/32] uint8 buffers) or dense
    (`weight` [E, out, in] parameter in the model dtype)."""

    def __init__(self, experts: int, out_features: int, in_features: int, packed: bool):
        super().__init__()
        if packed and in_features % BLOCK:
            raise ValueError(f"MXFP4 experts need in_features divisible by {BLOCK}, got "
                             f"{in_features}: this checkpoint cannot be MXFP4-packed")
        self.shape = (experts, out_features, in_features)
        self._pending: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()
        if packed:
            groups = in_features // BLOCK
            self.register_buffer("blocks", torch.empty(experts, out_features, groups, BLOCK // 2,
                                                       dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(experts, out_features, groups,
                                                       dtype=torch.uint8))
        else:
            self.weight = nn.Parameter(torch.empty(self.shape), requires_grad=False)

    @property
    def packed(self) -> bool:
        return "weight" not in self._parameters

    def expert(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `index`'s weight `[out, in]` in `dtype` (dequantized now if packed)."""
        if self.packed:
            return dequantize_mxfp4(self.blocks[index], self.scales[index], dtype)
        return self.weight[index].to(dtype)

    def bank(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight `[E, out, in]` in `dtype`: one dequantize launch if packed."""
        if self.packed:
            return dequantize_mxfp4(self.blocks, self.scales, dtype)
        return self.weight.to(dtype)

    def load(self, part: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """part: "blocks" / "scales" (MXFP4 checkpoint), "dense" (HF layout [E, in, out]) or
        "weight" (ours, [E, out, in])."""
        if part in ("dense", "weight"):
            self._set_dense(tensor.transpose(1, 2) if part == "dense" else tensor, dtype)
        elif self.packed:
            _copy_checked(getattr(self, part), tensor, part)
            self._loaded.add(part)
        else:  # dense storage (pre-dequantized): wait for the other half, then dequantize
            self._pending[part] = tensor
            if self._pending.keys() == {"blocks", "scales"}:
                blocks, scales = self._pending.pop("blocks"), self._pending.pop("scales")
                self._set_dense(dequantize_mxfp4(blocks, scales, self.weight.dtype), dtype)

    def _set_dense(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        if self.packed:  # a dense checkpoint for a packed model: keep what the checkpoint has
            del self.blocks, self.scales
            self.weight = nn.Parameter(torch.empty(self.shape, dtype=dtype,
                                                   device=weight.device), requires_grad=False)
        _copy_checked(self.weight, weight, "weight")
        self._loaded.update(("blocks", "scales"))  # dense weights stand for both halves

    def check_loaded(self, name: str) -> None:
        if self._loaded != {"blocks", "scales"}:
            raise ValueError(f"checkpoint lacks {name}_blocks/_scales (or dense {name})")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class GptOssExperts(nn.Module):
    def __init__(self, cfg, packed: bool):
        super().__init__()
        experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        # gate_up rows alternate gate, up, gate, up... (interleaved, as the checkpoints ship).
        self.gate_up_proj = ExpertWeights(experts, 2 * inter, hidden, packed)
        self.down_proj = ExpertWeights(experts, hidden, inter, packed)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        self.limit = float(getattr(cfg, "swiglu_limit", 7.0))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights / expert ids [T, k] -> [T, H]."""
        if x.is_cuda:
            return self.forward_grouped(x, weights, ids, cuda_grouped_gemm)
        return self.forward_loop(x, weights, ids)

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        """Reference: a loop over the touched experts (host syncs; dequantizes only those)."""
        out = torch.zeros_like(x)
        # Experts in ascending order, each adding into `out`: the same summation order as HF.
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            h = F.linear(x[token], self.gate_up_proj.expert(expert, x.dtype),
                         self.gate_up_proj_bias[expert])
            h = clamped_swiglu(h, self.alpha, self.limit)
            y = F.linear(h, self.down_proj.expert(expert, x.dtype), self.down_proj_bias[expert])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        gemm: GroupedGemm | None = None) -> torch.Tensor:
        """The same as `forward_loop` with assignments sorted by expert and one `gemm` call per
        projection; no host sync outside `gemm`. Outputs are summed over k in top-k order in
        float32 (not in expert order like the loop), so results differ by rounding only."""
        gemm = gemm or looped_grouped_gemm
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        experts = torch.arange(self.gate_up_proj.shape[0], device=x.device)
        # Group ends by binary search over the sorted ids: CUDA bincount reads max() back to
        # the host, which would break graph capture.
        offs = torch.searchsorted(expert_of_row, experts, right=True, out_int32=True)
        h = x[order // ids.shape[1]]
        h = gemm(h, self.gate_up_proj.bank(x.dtype), offs)
        h = clamped_swiglu(h + self.gate_up_proj_bias[expert_of_row].to(x.dtype),
                           self.alpha, self.limit)
        y = gemm(h, self.down_proj.bank(x.dtype), offs)
        y = y + self.down_proj_bias[expert_of_row].to(x.dtype)
        # Un-permute with a gather (the inverse permutation built by a scatter).
        rows = torch.arange(order.numel(), device=x.device)
        inverse = torch.empty_like(order).scatter_(0, order, rows)
        per_slot = y.index_select(0, inverse).view(*ids.shape, -1)  # [T, k, H]
        return (per_slot.float() * weights[..., None].float()).sum(dim=1).to(x.dtype)


GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [M, K] rows sorted by group, w [E, N, K], offs [E] int32 group ends) -> [M, N], where
rows [offs[e-1], offs[e]) are multiplied by w[e]^T."""


def looped_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """GroupedGemm as one matmul per non-empty group (reads offs back to the host)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[expert])
        start = end
    return out


def cuda_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """GroupedGemm on CUDA without host syncs: torch._grouped_mm for bf16 (it needs 16-byte
    aligned rows, i.e. K and N multiples of 8), the Triton grouped_gemm otherwise."""
    if (x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0):
        return torch_grouped_gemm(x, w, offs)
    return triton_grouped_gemm(x, w, offs)


def torch_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offs)


def triton_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from batchgen_kernels import grouped_gemm

    return grouped_gemm(x.contiguous(), w.contiguous(), offs)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped above, up clamped both sides, sigmoid gain alpha, and
    (up + 1) instead of up."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMLP(nn.Module):
    def __init__(self, cfg, packed: bool):
        super().__init__()
        self.router = TopKRouter(cfg)
        self.experts = GptOssExperts(cfg, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, layer: int, rope: RotaryEmbedding, packed: bool):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer, rope)
        self.mlp = GptOssMLP(cfg, packed)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssModel(DecoderStack):
    def __init__(self, cfg, packed: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, scaling = rope_inv_freq(cfg, head_dim)
        rope = RotaryEmbedding(inv_freq, default_max_positions(cfg, quiet=True), scaling)
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, rope, packed)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def checkpoint_is_mxfp4(hf_config) -> bool:
    """Real gpt-oss checkpoints say `quantization_config: {"quant_method": "mxfp4"}`."""
    return quant_method(hf_config) == "mxfp4"


class GptOssForCausalLM(PagedCausalLM):
    probe_without_kernels = False  # routing ids feed gathers and host reads
    def __init__(self, hf_config, options=None):
        super().__init__()
        self.config = hf_config
        pre_dequantize = bool(getattr(options, "pre_dequantize_weights", False))
        self.packed = checkpoint_is_mxfp4(hf_config) and not pre_dequantize
        self.model = GptOssModel(hf_config, self.packed)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.tie_weights()
        attn = self.model.layers[0].self_attn
        self.kv_token_shape = (2, attn.kv_heads, attn.head_dim)
        self.max_context = default_max_positions(hf_config)


    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        experts = {name: m for name, m in self.named_modules() if isinstance(m, ExpertWeights)}
        dtype = self.model.embed_tokens.weight.dtype
        seen = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target, part = _expert_target(name)
            if target in experts:
                experts[target].load(part, tensor, dtype)
            elif name in params:
                _copy_checked(params[name], tensor, name)
                seen.add(name)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        for name, module in experts.items():
            module.check_loaded(name)
        self._check_complete(params, seen)

    def _check_complete(self, params: dict, seen: set) -> None:
        missing = {n for n in set(params) - seen if not n.endswith((".gate_up_proj.weight",
                                                                   ".down_proj.weight"))}
        if getattr(self.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
            if "lm_head.weight" in seen:
                missing.discard("model.embed_tokens.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _expert_target(name: str) -> tuple[str, str]:
    """`...experts.gate_up_proj_blocks` -> (`...experts.gate_up_proj`, "blocks"); a dense
    `...experts.gate_up_proj` -> (itself, "dense"). The names of our own state dict (a
    `batchgen convert` folder) too: `.blocks` / `.scales`, and `.weight` (dense, our [E, out,
    in] layout) -> "weight". Other names come back unchanged."""
    for suffix in ("blocks", "scales"):
        for sep in ("_", "."):
            if name.endswith(sep + suffix):
                return name[: -len(suffix) - 1], suffix
    if name.endswith(".weight") and ".experts." in name:
        return name[: -len(".weight")], "weight"
    return name, "dense"
