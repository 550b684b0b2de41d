"""Tiny random-weight HF models of each family, saved as local folders (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def tiny_config(family: str):
    from transformers import (Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if family == "llama":
        return LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama_tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "qwen3_moe":  # 8 experts of 32, top 2 (renormalised); layer 1 dense
        return Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True,
                              mlp_only_layers=[1], tie_word_embeddings=False)
    if family == "mixtral":  # 4 experts of intermediate_size (128), top 2
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=None, tie_word_embeddings=False)
    if family == "phi3":  # checkpoints hold fused qkv_proj / gate_up_proj
        return Phi3Config(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "granite":  # Granite 3.x's four multipliers, none of them 1
        return GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0625, logits_scaling=8.0,
                             tie_word_embeddings=True)
    if family == "gemma3":  # both layer kinds, a window shorter than the prompts, linear rope
        # scaling on the full layers only, head_dim != hidden / heads, scale != 1/sqrt(head_dim)
        return Gemma3TextConfig(
            **common, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6,
            rope_local_base_freq=10000.0, tie_word_embeddings=True)
    raise ValueError(family)


def save_tiny_model(family: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """`overrides` set config attributes after the family's defaults."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "gemma3":  # HF starts Gemma's (1 + w) norms at w = 0: give them weight
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def embedded_tokenizer():
    """SmolLM2's real tokenizer and chat template, from the embedded model's converted folder."""
    from batchgen.config import ModelConfig
    from batchgen.models.factory import load_tokenizer, model_folder

    folder, _ = model_folder(ModelConfig())
    return load_tokenizer(folder)


def save_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A 3-layer random Llama with SmolLM2's tokenizer: real chat templates, fast on CPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = embedded_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder
