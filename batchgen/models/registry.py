"""Maps `config.architectures` to our model classes (imported lazily)."""

from __future__ import annotations

import importlib
import math

ARCHITECTURES = {
    "LlamaForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "batchgen.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "batchgen.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "batchgen.models.llama:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "batchgen.models.llama:Phi3ForCausalLM",
    "GraniteForCausalLM": "batchgen.models.llama:GraniteForCausalLM",
    "DeepseekV3ForCausalLM": "batchgen.models.deepseek_v3:DeepseekV3ForCausalLM",
    "GptOssForCausalLM": "batchgen.models.gpt_oss:GptOssForCausalLM",
    "Qwen3MoeForCausalLM": "batchgen.models.softmax_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "batchgen.models.softmax_moe:MixtralForCausalLM",
    "Gemma3ForCausalLM": "batchgen.models.gemma3:Gemma3ForCausalLM",
    # The bare decoder stacks, as embedding models ship them (no LM head; their tensors named
    # without the "model." prefix): the same classes, answering /v1/embeddings lines only.
    "LlamaModel": "batchgen.models.llama:LlamaForCausalLM",
    "MistralModel": "batchgen.models.llama:MistralForCausalLM",
    "Qwen2Model": "batchgen.models.llama:Qwen2ForCausalLM",
    "Qwen3Model": "batchgen.models.llama:Qwen3ForCausalLM",
}

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM"}
"""config.json's model_type -> the class transformers' AutoModelForCausalLM builds for it: the
architecture of a config that lists none (one a config's own save_pretrained wrote)."""
REFUSED = {
    "Gemma2ForCausalLM": "Gemma 2 caps its attention logits (attn_logit_softcapping), which "
                         "batchgen's attention kernels do not compute",
    "Gemma3ForConditionalGeneration": "batchgen runs Gemma 3's text-only checkpoints "
                                      "(Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b and their "
                                      "-it releases), not its image-text ones",
}
"""Architectures batchgen knows and does not run, each with the reason a user is told."""
REFUSED_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}
"""model_type -> its REFUSED architecture, for a config that lists none."""
QUANT_METHODS = ("fp8", "compressed-tensors", "mxfp4")
"""quantization_config.quant_method values batchgen reads (FP8 checkpoints, gpt-oss's MXFP4
experts); another (awq, gptq, bitsandbytes, ...) has weights no model class has a place for."""


class UnsupportedModelError(ValueError):
    pass


def model_class(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = supported_architecture(archs, getattr(hf_config, "model_type", None))
    module, _, name = ARCHITECTURES[arch].partition(":")
    return getattr(importlib.import_module(module), name)


def supported_architecture(archs: list[str], model_type: str | None = None) -> str:
    """The first of a config's `architectures` batchgen runs, or without any, the class of its
    `model_type` (as transformers picks it); UnsupportedModelError if none."""
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    refused = [a for a in archs if a in REFUSED] or (
        [REFUSED_TYPES[model_type]] if not archs and model_type in REFUSED_TYPES else [])
    if refused:
        raise UnsupportedModelError(f"{refused[0]} is not supported: {REFUSED[refused[0]]}")
    supported = ", ".join(sorted(ARCHITECTURES))
    if archs:
        raise UnsupportedModelError(f"unsupported architecture {archs}; batchgen supports "
                                    + supported)
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"config.json lists no architectures and its model_type {model_type!r} is not one "
        f"batchgen runs ({', '.join(sorted(MODEL_TYPES))}); if the weights are one of those "
        f"models, add its class to config.json, e.g. \"architectures\": [\"LlamaForCausalLM\"]. "
        f"batchgen supports {supported}")


def model_type_of(arch: str) -> str | None:
    """The model_type transformers reads a config of architecture `arch` with (None for one
    batchgen does not run)."""
    target = ARCHITECTURES.get(arch)
    return next((t for t, a in MODEL_TYPES.items() if ARCHITECTURES[a] == target), None)


def check_quant_method(method: str) -> None:
    """UnsupportedModelError for a quantization_config.quant_method batchgen cannot read
    ("" = unquantized)."""
    if method and method.lower() not in QUANT_METHODS:
        raise UnsupportedModelError(
            f"config.json's quantization_config has quant_method {method!r}, which batchgen "
            f"does not read (it reads {', '.join(QUANT_METHODS)} checkpoints and unquantized "
            "bfloat16/float16/float32 ones): use the model's unquantized or FP8 release")


def yarn_positions(params: dict) -> int:
    """original_max_position_embeddings x factor of a YaRN rope's settings (0 for another
    rope, or one that leaves either out)."""
    kind = params.get("rope_type", params.get("type"))
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    if kind != "yarn" or not isinstance(factor, (int, float)) or not isinstance(original, int):
        return 0
    return int(original * factor) if math.isfinite(factor) and factor > 0 else 0
