"""Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral (`MixtralForCausalLM`): the Llama family's
stacks (llama.py: Qwen3's attention with per-head q/k RMSNorm, Mistral's with its sliding
window) whose MLP is a softmax-routed mixture of SwiGLU experts.

Routing (SoftmaxRouter, as HF's): router logits in the model dtype, softmax in float32 over all
experts, the top k kept and, where the family does (Mixtral always, Qwen3-MoE with
`norm_topk_prob`), renormalised to sum to 1. No shared experts, no bias.

Experts are moe.py's RoutedExperts, the ones DeepSeek-V3 runs: grouped GEMMs on CUDA (bf16 /
fp16, FP8 block-scaled), expert offloading (--enable-ep-with-offloading), FP8 expert weights
kept as FP8 on CUDA, and expert parallelism across the tensor-parallel group (each rank holds
E / TP experts, the router is replicated, one all-reduce sums the ranks' parts).

Which layers: Mixtral every layer; Qwen3-MoE those with (layer + 1) % decoder_sparse_step == 0
not in mlp_only_layers (a dense MLP of intermediate_size elsewhere). Expert width:
Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size.

Checkpoint names: per-expert `mlp.experts.N.{gate,up,down}_proj.weight` + `mlp.gate.weight`
(Qwen3-MoE), `block_sparse_moe.experts.N.{w1,w3,w2}.weight` + `block_sparse_moe.gate.weight`
(Mixtral: w1 gate, w3 up, w2 down), and the grouped `mlp.experts.gate_up_proj` [E, 2I, H] /
`down_proj` [E, H, I] that transformers holds in memory and our converted folders store.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.fp8 import QuantizedWeight, dequantize_blocks
from batchgen.models.layers import SINGLE
from batchgen.models.llama import Biases, LlamaForCausalLM, MlpFor
from batchgen.models.expert_bank import ExpertStager
from batchgen.models.moe import RoutedExperts, offloaded_share
from batchgen.models.registry import UnsupportedModelError
from batchgen.parallel import TensorParallel

EXPERT_NAME = re.compile(
    r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.weight$")
GROUPED_EXPERT_NAME = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|"
                                 r"down_proj)$")
ROUTER_NAME = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's expert matrix names -> the SwiGLU projection each one is."""


class SoftmaxRouter(nn.Module):
    """Softmax over every expert's logit, top k, renormalised when `renormalize`. The weights
    come back in float32, or rounded to the model dtype where HF rounds them (Qwen3-MoE)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool,
                 round_to_model_dtype: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.round_to_model_dtype = round_to_model_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k] int64)."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_to_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids


class MoeSpec(NamedTuple):
    """A family's MoE sizes and routing switches, read from its config."""

    num_experts: int
    top_k: int
    inter: int
    """One expert's intermediate width."""
    renormalize: bool
    """Rescale the top-k softmax weights to sum to 1."""
    round_weights: bool
    """Round the routing weights to the model dtype (as HF's Qwen3-MoE does)."""


class SoftmaxMoE(nn.Module):
    """Router + routed experts, expert parallel across the tensor-parallel group: each rank
    computes its experts' part for every token and one all-reduce sums the parts."""

    def __init__(self, cfg, spec: MoeSpec, num_offloaded: int, stager: ExpertStager | None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"hidden_act {cfg.hidden_act!r}: the routed experts' grouped kernels apply "
                "SiLU only (as Qwen3-MoE and Mixtral use)")
        self.tp = tp
        self.gate = SoftmaxRouter(spec.num_experts, cfg.hidden_size, spec.top_k,
                                  spec.renormalize, spec.round_weights)
        local = tp.split(spec.num_experts, "the number of routed experts")
        self.experts = RoutedExperts(local, cfg.hidden_size, spec.inter, num_offloaded, stager,
                                     first_expert=tp.rank * local,
                                     total_experts=spec.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's experts' weighted sum, all-reduced over the TP group."""
        weights, ids = self.gate(x)
        return self.tp.all_reduce(self.experts(x, ids, weights))


class SoftmaxMoeForCausalLM(LlamaForCausalLM):
    """A Llama-family stack with SoftmaxMoE layers (subclasses say which and how big). Tensor
    parallel: attention by heads (llama.py), experts by rank (SoftmaxMoE)."""

    probe_without_kernels = False  # routing ids feed scatters
    expert_stager: ExpertStager | None = None
    checkpoint_block = "mlp"
    """What the family's checkpoints call a layer's MoE block (and their expert matrices:
    checkpoint_proj), for naming a tensor they lack."""
    checkpoint_proj = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}

    @staticmethod
    def moe_spec(hf_config) -> MoeSpec:
        """The family's experts and routing, from its config."""
        raise NotImplementedError

    @staticmethod
    def is_moe_layer(hf_config, layer: int) -> bool:
        """Whether `layer` routes to experts (True) or keeps the dense MLP."""
        return True

    def _mlp_for(self, hf_config, tp: TensorParallel) -> MlpFor | None:
        spec = self.moe_spec(hf_config)
        if spec.num_experts <= 0:
            return None
        num_offloaded = offloaded_share(spec.num_experts, self.options, tp)
        self.expert_stager = ExpertStager(num_offloaded) if num_offloaded else None

        def mlp_for(layer: int) -> nn.Module | None:
            if not self.is_moe_layer(hf_config, layer):
                return None
            return SoftmaxMoE(hf_config, spec, num_offloaded, self.expert_stager, tp)
        return mlp_for

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights, presharded: bool = False) -> None:
        """As LlamaForCausalLM's, with routers and experts placed by `_load_other`."""
        self._routers_loaded: set[str] = set()
        self._blocks = self._moe_blocks()
        super().load_weights(weights, presharded)

    def _moe_blocks(self) -> dict[str, SoftmaxMoE]:
        return {n: m for n, m in self.named_modules() if isinstance(m, SoftmaxMoE)}

    def _block_of(self, blocks: dict[str, SoftmaxMoE], layer_prefix: str) -> str | None:
        for name in (f"{layer_prefix}.mlp", f"model.{layer_prefix}.mlp"):  # bare stacks too
            if name in blocks:
                return name
        return None

    def _load_other(self, name: str, tensor, presharded: bool) -> bool:
        for pattern, place in ((EXPERT_NAME, self._load_expert),
                               (GROUPED_EXPERT_NAME, self._load_grouped),
                               (ROUTER_NAME, self._load_router)):
            match = pattern.match(name)
            if match:
                block = self._block_of(self._blocks, match.group(1))
                if block is None:  # a dense layer: no place for it (reported as such)
                    return False
                place(block, self._blocks[block], match, tensor, presharded)
                return True
        return False

    def _load_expert(self, block_name: str, block: SoftmaxMoE, match, tensor,
                     presharded: bool) -> None:
        """One matrix of one expert, by its global index (other ranks' experts skipped)."""
        proj = MIXTRAL_PROJ.get(match.group(3), match.group(3))
        try:
            block.experts.load(int(match.group(2)), proj, tensor)
        except ValueError as err:  # another shape: named by the checkpoint's tensor
            raise ValueError(f"{match.group(0)}: {err}") from None

    def _load_grouped(self, block_name: str, block: SoftmaxMoE, match, tensor,
                      presharded: bool) -> None:
        """Every expert's gate|up [E, 2I, H] or down [E, H, I]; a converted TP shard's
        experts are numbered from this rank's first."""
        if isinstance(tensor, QuantizedWeight):
            raise ValueError(f"{match.group(0)}: grouped experts come dense, not FP8")
        try:
            block.experts.load_stacked(match.group(2), tensor, presharded)
        except ValueError as err:
            raise ValueError(f"{match.group(0)}: {err}") from None

    def _load_router(self, block_name: str, block: SoftmaxMoE, match, tensor,
                     presharded: bool) -> None:
        param = block.gate.weight
        if isinstance(tensor, QuantizedWeight):
            tensor = dequantize_blocks(tensor.weight, tensor.scale_inv, tensor.block, param.dtype)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{match.group(0)}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self._routers_loaded.add(block_name)

    def _checkpoint_block(self, block: str) -> str:
        """Our MoE block's name ('model.layers.3.mlp') as the checkpoint spells it."""
        return block[: -len("mlp")] + self.checkpoint_block

    def _check_complete(self, params: dict, seen: set[tuple[str, int]]) -> None:
        blocks = self._moe_blocks()
        inside = tuple(name + "." for name in blocks)
        super()._check_complete({n: p for n, p in params.items() if not n.startswith(inside)},
                                seen)
        missing = [f"{self._checkpoint_block(name)}.gate.weight" for name in blocks
                   if name not in self._routers_loaded]
        for name, block in blocks.items():
            missing += [f"{self._checkpoint_block(name)}.experts.{e}.{self.checkpoint_proj[p]}"
                        ".weight" for e, p in block.experts.missing()]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


class Qwen3MoeForCausalLM(SoftmaxMoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, `num_experts` experts of
    `moe_intermediate_size`, top `num_experts_per_tok`, renormalised with norm_topk_prob."""

    qk_norm = True

    @staticmethod
    def biases(hf_config) -> Biases:
        attention = bool(getattr(hf_config, "attention_bias", False))
        return Biases(attention, attention, False)

    @staticmethod
    def moe_spec(hf_config) -> MoeSpec:
        return MoeSpec(int(getattr(hf_config, "num_experts", 0) or 0),
                       int(hf_config.num_experts_per_tok),
                       int(hf_config.moe_intermediate_size),
                       bool(getattr(hf_config, "norm_topk_prob", False)), round_weights=True)

    @staticmethod
    def is_moe_layer(hf_config, layer: int) -> bool:
        """HF's rule: not in mlp_only_layers, and every decoder_sparse_step-th layer."""
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = getattr(hf_config, "mlp_only_layers", None) or []
        return layer not in dense and (layer + 1) % step == 0


class MixtralForCausalLM(SoftmaxMoeForCausalLM):
    """Mixtral (8x7B, 8x22B): Mistral's attention (no biases, sliding window if set),
    `num_local_experts` experts of `intermediate_size` on every layer, top
    `num_experts_per_tok`, always renormalised."""

    checkpoint_block = "block_sparse_moe"
    checkpoint_proj = {proj: name for name, proj in MIXTRAL_PROJ.items()}

    @staticmethod
    def biases(hf_config) -> Biases:
        return Biases(False, False, False)

    @staticmethod
    def moe_spec(hf_config) -> MoeSpec:
        return MoeSpec(int(hf_config.num_local_experts), int(hf_config.num_experts_per_tok),
                       int(hf_config.intermediate_size), renormalize=True, round_weights=False)
