"""FP8 checkpoints of dense models (the Llama family): e4m3 projection weights with 128x128
block scales (`weight_scale_inv`), or one scale per tensor or per output channel
(`weight_scale`); fp8.py reads them all.

On CUDA a projection stays FP8 and runs the block- or row-scaled GEMM of fp8.py (`Fp8Linear`);
a row-scaled q|k|v or gate|up then takes its input quantized by the RMSNorm before it, and a
row-scaled down_proj by the SiLU-and-mul (`feed_quantized_rows`: fused kernels). Fused
projections (q|k|v, gate|up) are joined along their rows once every piece has arrived, which
needs each piece to end on a scale-block edge. Whatever cannot stay FP8 (a misaligned piece, a
biased projection) is dequantized and loaded as a dense tensor, so the model is always whole.
On CPU pair_scales dequantizes at read time and none of this runs.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.models.fp8 import (
    Fp8Linear,
    QuantizedWeight,
    dequantize_blocks,
    quant_method,
    quantization_config,
)
from batchgen.models.layers import RowParallelLinear


def is_fp8_checkpoint(hf_config) -> bool:
    """quant_method "fp8" (DeepSeek's blocks, AutoFP8's per-tensor scales), or
    "compressed-tensors" whose weights are 8-bit floats (llm-compressor's FP8 and FP8_DYNAMIC
    schemes: per-tensor or per-channel `weight_scale`). Other compressed-tensors schemes are
    refused by name rather than loaded wrong."""
    method = quant_method(hf_config)
    if method == "compressed-tensors":
        return _compressed_fp8(quantization_config(hf_config))
    return method == "fp8"


def _compressed_fp8(quant: dict) -> bool:
    groups = quant.get("config_groups") or {}
    weights = [group.get("weights") or {} for group in groups.values()]
    if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
        return True
    schemes = [f"{w.get('type')}{w.get('num_bits')}" for w in weights] or ["none"]
    raise ValueError(f"compressed-tensors checkpoint with {', '.join(schemes)} weights: batchgen "
                     "reads its FP8 (float8) schemes only; use an FP8 or unquantized checkpoint")


class Fp8Projections:
    """Collects the FP8 pieces of each projection of `model` and swaps in one Fp8Linear per
    projection when its last piece arrives. `pieces(target)` says how many checkpoint pieces
    a fused parameter has (1 for a plain projection)."""

    def __init__(self, model: nn.Module, pieces, dtype: torch.dtype):
        self.model, self.pieces, self.dtype = model, pieces, dtype
        self.waiting: dict[str, dict[int, QuantizedWeight]] = {}

    def accept(self, target: str, slot: int, value: QuantizedWeight):
        """Take one piece; returns [(slot, dense tensor)] to load the usual way when the
        projection cannot stay FP8 (empty while pieces are missing or once installed)."""
        whole = slot < 0
        got = self.waiting.setdefault(target, {})
        got[max(slot, 0)] = value
        if not whole and len(got) < self.pieces(target):
            return []
        del self.waiting[target]
        ordered = [got[i] for i in sorted(got)]
        if self._can_install(target, ordered):
            self._install(target, ordered)
            return []
        return [(-1 if whole else i, dequantize_blocks(q.weight, q.scale_inv, q.block, self.dtype))
                for i, q in zip(sorted(got), ordered)]

    def check_done(self) -> None:
        if self.waiting:
            raise ValueError(f"FP8 projections missing pieces: {sorted(self.waiting)[:3]}")

    def _can_install(self, target: str, ordered: list[QuantizedWeight]) -> bool:
        module = self.model.get_submodule(target[: -len(".weight")])
        if not isinstance(module, nn.Linear) or module.bias is not None:
            return False
        if len({q.block for q in ordered}) != 1:
            return False
        rows = ordered[0].block[0]
        return all(q.weight.shape[0] % rows == 0 for q in ordered[:-1])

    def _install(self, target: str, ordered: list[QuantizedWeight]) -> None:
        path = target[: -len(".weight")]
        old = self.model.get_submodule(path)
        weight = torch.cat([q.weight for q in ordered]) if len(ordered) > 1 else ordered[0].weight
        scale = (torch.cat([q.scale_inv for q in ordered]) if len(ordered) > 1
                 else ordered[0].scale_inv)
        if tuple(weight.shape) != tuple(old.weight.shape):
            raise ValueError(f"{target}: FP8 checkpoint shape {tuple(weight.shape)} != model "
                             f"shape {tuple(old.weight.shape)}")
        reduce = (isinstance(old, RowParallelLinear) and old.reduce_output and old.tp.size > 1)
        device = weight.device if old.weight.is_meta else old.weight.device  # deferred: meta
        self.model.set_submodule(path, Fp8Linear(weight.to(device), scale.to(device),
                                                 ordered[0].block, old.tp if reduce else None,
                                                 self.dtype))


def keeps_fp8(hf_config, device: torch.device, options=None) -> bool:
    """An FP8 checkpoint whose weights stay FP8 on `device`: CUDA, without
    --pre-dequantize-weights (elsewhere they are dequantized as they are read)."""
    return (device.type == "cuda" and not getattr(options, "pre_dequantize_weights", False)
            and is_fp8_checkpoint(hf_config))


FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The decoder projections an FP8 checkpoint of the Llama family replaces with Fp8Linear."""


def deferred_projections(model: nn.Module, hf_config, device: torch.device,
                         options=None) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the projections whose weights stay on the meta device until the
    checkpoint's FP8 tensors replace them (Fp8Projections): those of a model that loads through
    Fp8Projections (`fp8_projections` set), from an FP8 checkpoint kept FP8 (CUDA, no
    --pre-dequantize-weights), without bias. Materialised in the model dtype they would need
    twice the FP8 weights' memory first (a 70 B checkpoint: 140 GB before its 70 GB of FP8)."""
    if not getattr(model, "fp8_projections", False) or not keeps_fp8(hf_config, device, options):
        return []
    return [(name, module) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in FP8_PROJECTIONS and isinstance(module, nn.Linear)
            and module.bias is None]


def feed_quantized_rows(layers) -> None:
    """Have each decoder layer's norms hand a row-scaled FP8 q|k|v and gate|up their input as
    QuantizedRows (one fused kernel instead of a norm and a quantizer): each norm's output
    feeds only that projection. FusedGatedMLP does the same for its down_proj by itself. A
    mixture-of-experts layer's norm also feeds its router: it keeps its plain output."""
    for layer in layers:
        layer.input_layernorm.fp8_rows = _row_scaled(layer.self_attn.qkv_proj)
        gate_up = getattr(layer.mlp, "gate_up_proj", None)
        layer.post_attention_layernorm.fp8_rows = _row_scaled(gate_up)


def _row_scaled(module: nn.Module) -> bool:
    return isinstance(module, Fp8Linear) and module.row_scaled
