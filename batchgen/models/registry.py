"""Maps `config.architectures` to our model classes (imported lazily)."""

from __future__ import annotations

import importlib

ARCHITECTURES = {
    "LlamaForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "batchgen.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "batchgen.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "batchgen.models.llama:Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM": "batchgen.models.deepseek_v3:DeepseekV3ForCausalLM",
    "GptOssForCausalLM": "batchgen.models.gpt_oss:GptOssForCausalLM",
    # The bare decoder stacks, as embedding models ship them (no LM head; their tensors named
    # without the "model." prefix): the same classes, answering /v1/embeddings lines only.
    "LlamaModel": "batchgen.models.llama:LlamaForCausalLM",
    "MistralModel": "batchgen.models.llama:MistralForCausalLM",
    "Qwen2Model": "batchgen.models.llama:Qwen2ForCausalLM",
    "Qwen3Model": "batchgen.models.llama:Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


def model_class(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    module, _, name = ARCHITECTURES[supported_architecture(archs)].partition(":")
    return getattr(importlib.import_module(module), name)


def supported_architecture(archs: list[str]) -> str:
    """The first of a config's `architectures` batchgen runs; UnsupportedModelError if none."""
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"unsupported architecture {archs or '(none in config.json)'}; batchgen supports "
        + ", ".join(sorted(ARCHITECTURES)))
