"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`) on the paged KV cache.

Layers: MLA attention (batchgen/models/mla.py) everywhere; a dense SwiGLU MLP on the first
`first_k_dense_replace` layers and the MoE (batchgen/models/moe.py) after. The KV cache holds
one (1, kv_lora_rank + qk_rope_head_dim) vector per token and layer: `kv_token_shape`, from
which the engine sizes pages (576 values for R1, not heads x dim x 2).

Weights load by their checkpoint names: per-expert `mlp.experts.N.{gate,up,down}_proj.weight`
(real checkpoints and HF `save_pretrained`) or HF's in-memory grouped
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]. FP8 checkpoints (e4m3 `weight`
+ `weight_scale_inv` per block) are dequantized on CPU (and with --pre-dequantize-weights);
on CUDA they stay FP8 and run block-scaled GEMMs (batchgen/models/fp8.py). The multi-token
prediction layer R1 ships as `model.layers.{num_hidden_layers}` is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from batchgen.models.base import DecoderStack, PagedCausalLM, PreNormDecoderLayer
from batchgen.models.fp8 import (
    Fp8Linear,
    QuantizedWeight,
    dequantize_blocks,
    pair_scales,
    weight_block_size,
)
from batchgen.models.layers import (SINGLE, GatedMLP, RMSNorm, RowParallelLinear,
                                    default_max_positions, token_embedding)
from batchgen.models.mla import MlaRope, MLAttention
from batchgen.models.expert_bank import ExpertStager
from batchgen.models.moe import DeepseekMoE, RoutedExperts, offloaded_share
from batchgen.models.tp_slices import local_part
from batchgen.parallel import TensorParallel

EXPERT_NAME = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
GROUPED_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
FLOAT32_PARAMS = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
"""Router tensors stay float32 whatever the model dtype, as in HF and DeepSeek's reference."""
KEEP_DENSE = (".kv_b_proj.weight",)
"""Dequantized even on CUDA: the absorbed MLA path uses kv_b_proj as a matrix, not a GEMM."""
TP_SPLIT = {
    **dict.fromkeys(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight",
                     "self_attn.kv_b_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"), 0),
    **dict.fromkeys(("self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "shared_experts.down_proj.weight"), 1),
}
"""Tensor-parallel split of the checkpoint (tp_slices): by output rows (heads, intermediate
features; routed experts are placed whole, per rank) or by input columns; the rest (LoRA
down-projections, norms, router, embedding, LM head) is replicated."""


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, layer: int, rope: MlaRope, num_offloaded: int,
                 stager: ExpertStager | None, tp: TensorParallel):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer, rope, tp)
        if layer >= (cfg.first_k_dense_replace or 0) and cfg.n_routed_experts:
            self.mlp = DeepseekMoE(cfg, num_offloaded, stager, tp)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp=tp,
                                hidden_act=getattr(cfg, "hidden_act", None))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3Model(DecoderStack):
    def __init__(self, cfg, num_offloaded: int, stager: ExpertStager | None, tp: TensorParallel):
        super().__init__()
        rope = MlaRope(cfg)
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, num_offloaded, stager, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def offloaded_experts(hf_config, options, tp: TensorParallel = SINGLE) -> int:
    """Routed experts per layer this rank keeps in host memory under --ep-offloading-ratio
    (the ratio applies to each rank's share of the experts)."""
    return offloaded_share(hf_config.n_routed_experts or 0, options, tp, "n_routed_experts")


class DeepseekV3ForCausalLM(PagedCausalLM):
    """Under tensor parallelism: MLA split by heads (each rank caches the whole latent, which
    all heads share), dense MLPs by columns/rows, MoE expert parallel (moe.py)."""

    supports_tensor_parallel = True
    shared_prefix_decode = False  # the latent cache has its own decode kernel
    probe_without_kernels = False  # routing ids feed scatters

    def __init__(self, hf_config, options=None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = hf_config
        self.options = options
        self.tp = tp
        num_offloaded = offloaded_experts(hf_config, options, tp)
        self.expert_stager = ExpertStager(num_offloaded) if num_offloaded else None
        self.model = DeepseekV3Model(hf_config, num_offloaded, self.expert_stager, tp)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.tie_weights()
        self.kv_token_shape = (1, hf_config.kv_lora_rank + hf_config.qk_rope_head_dim)
        self.max_context = default_max_positions(hf_config)

    def set_mla_impl(self, prefill: str | None = None, decode: str | None = None) -> None:
        """Choose the MLA path ("naive" or "absorb") for prefill rows and for decode rows."""
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.prefill_impl = prefill or attn.prefill_impl
            attn.decode_impl = decode or attn.decode_impl

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     presharded: bool = False) -> None:
        """`presharded`: the tensors are this TP rank's already (our per-rank converted files:
        sliced projections, grouped experts numbered from this rank's first expert)."""
        dtype = self.model.embed_tokens.weight.dtype
        device = self.model.embed_tokens.weight.device
        pre_dequantize = bool(getattr(self.options, "pre_dequantize_weights", False))
        keep_fp8 = device.type == "cuda" and not pre_dequantize
        experts = {n: m for n, m in self.named_modules() if isinstance(m, RoutedExperts)}
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        for name, value in pair_scales(weights, weight_block_size(self.config), keep_fp8, dtype):
            if self._skipped(name):
                continue
            if isinstance(value, QuantizedWeight) and name.endswith(KEEP_DENSE):
                value = dequantize_blocks(value.weight, value.scale_inv, value.block, dtype)
            if self._load_expert(experts, name, value, presharded):
                continue
            if not presharded:
                value = local_part(name, value, TP_SPLIT, self.tp, dtype)
            if isinstance(value, QuantizedWeight):
                self._install_fp8_linear(name, value)
                seen.update({name, name + "_scale_inv"})
            else:
                _copy_param(params, name, value)
                seen.add(name)
        self._check_complete(seen, experts)

    def _skipped(self, name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if ".shared_experts." in name and not self.config.n_shared_experts:
            return True  # HF saves n_shared_experts=0 as zero-sized shared-expert tensors
        match = LAYER_INDEX.match(name)  # the MTP layer(s) after the last decoder layer
        return match is not None and int(match.group(1)) >= self.config.num_hidden_layers

    def _load_expert(self, experts: dict, name: str, value, presharded: bool = False) -> bool:
        match = EXPERT_NAME.match(name)
        if match:
            try:
                experts[match.group(1)].load(int(match.group(2)), match.group(3), value)
            except ValueError as err:  # another shape: named by the checkpoint's tensor
                raise ValueError(f"{name}: {err}") from None
            return True
        match = GROUPED_EXPERT_NAME.match(name)
        if not match or match.group(1) not in experts:
            return False
        assert not isinstance(value, QuantizedWeight), "grouped experts come dense"
        experts[match.group(1)].load_stacked(match.group(2), value, presharded)
        return True

    def _install_fp8_linear(self, name: str, value: QuantizedWeight) -> None:
        path = name[: -len(".weight")]
        old = self.get_submodule(path)
        if not isinstance(old, nn.Linear) or old.bias is not None:
            raise KeyError(f"FP8 tensor {name!r} is not the weight of a bias-free linear layer")
        if tuple(old.weight.shape) != tuple(value.weight.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(value.weight.shape)} != model "
                             f"shape {tuple(old.weight.shape)}")
        device = old.weight.device
        reduce = isinstance(old, RowParallelLinear) and old.reduce_output and self.tp.size > 1
        self.set_submodule(path, Fp8Linear(value.weight.to(device), value.scale_inv.to(device),
                                           value.block, self.tp if reduce else None))

    def _check_complete(self, seen: set[str], experts: dict) -> None:
        params = {n for n, _ in self.named_parameters(remove_duplicate=False)}
        missing = {n for n in params - seen if not n.startswith(tuple(experts))}
        if getattr(self.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
            if "lm_head.weight" in seen:
                missing.discard("model.embed_tokens.weight")
        for name, module in experts.items():
            missing.update(f"{name}.{e}.{proj}.weight" for e, proj in module.missing())
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _copy_param(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in DeepseekV3ForCausalLM")
    param = params[name]
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                         f"shape {tuple(param.shape)}")
    if name.endswith(FLOAT32_PARAMS):
        param.data = tensor.to(device=param.device, dtype=torch.float32)
        return
    with torch.no_grad():
        param.copy_(tensor)
