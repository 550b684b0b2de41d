"""Qwen3-MoE and Mixtral vs HF transformers on tiny random weights saved with save_pretrained:
greedy tokens and logits, both checkpoint layouts, config variants, FP8 checkpoints, expert
offloading, and a `batchgen run` of chat lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import assert_last_logits_match, hf_greedy, load_ours
from family_checks import NEW_TOKENS, check_chat_run_matches_transformers, greedy, hf_model, prompts
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model

from batchgen.config import ModelConfig
from batchgen.models.fp8 import dequantize_blocks, quantize_blocks
from batchgen.models.loader import build_model, load_hf_config, read_safetensors

FAMILIES = ["qwen3_moe", "mixtral"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, hf_model(folder), load_ours(folder)


def test_layers_and_checkpoint_names_are_the_families(family):
    name, folder, _, ours = family
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    names = set(load_file(str(folder / "model.safetensors")))
    if name == "qwen3_moe":  # mlp_only_layers=[1]: a dense MLP there
        assert kinds == ["SoftmaxMoE", "FusedGatedMLP", "SoftmaxMoE"]
        assert {"model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.7.gate_proj.weight"} <= names
    else:
        assert kinds == ["SoftmaxMoE"] * 3
        assert {"model.layers.0.block_sparse_moe.gate.weight",
                "model.layers.0.block_sparse_moe.experts.3.w1.weight"} <= names


def test_greedy_tokens_match_hf_batched(family):
    _, _, hf, ours = family
    ps = prompts()
    assert greedy(ours, ps) == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


def test_logits_match_hf(family):
    _, _, hf, ours = family
    assert_last_logits_match(ours, hf, prompts(1)[4])


def test_hf_grouped_expert_layout_loads(family):
    """transformers holds experts as 3-D gate_up_proj / down_proj (and Mixtral's under
    `mlp.`): that state dict loads to the same logits as the per-expert checkpoint."""
    _, _, hf, ours = family
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    grouped = build_model(hf.config, state.items(), torch.float32, CPU)
    assert greedy(grouped, prompts(2)[:2], 12) == greedy(ours, prompts(2)[:2], 12)


def test_missing_expert_or_router_is_named(family):
    """By the name the family's checkpoints give it (Mixtral's block_sparse_moe, w3)."""
    name, folder, _, ours = family
    state = load_file(str(folder / "model.safetensors"))
    prefix = "mlp" if name == "qwen3_moe" else "block_sparse_moe"
    proj = "up_proj" if name == "qwen3_moe" else "w3"
    for gone in (f"model.layers.2.{prefix}.experts.1.{proj}.weight",
                 f"model.layers.2.{prefix}.gate.weight"):
        partial = {k: v for k, v in state.items() if k != gone}
        with pytest.raises(ValueError, match=rf"lacks 1 tensors, e\.g\. \['{gone}'\]"):
            build_model(ours.config, partial.items(), torch.float32, CPU)


@pytest.mark.parametrize("rows", [100, 1])  # 1: copy_ would broadcast it over every row
def test_an_expert_of_another_shape_is_a_checkpoint_error_naming_it(family, rows):
    """Not a RuntimeError that crashes the worker (and every rerun) or a silent broadcast."""
    from batchgen.models.loader import CheckpointError

    name, folder, _, ours = family
    state = load_file(str(folder / "model.safetensors"))
    bad = ("model.layers.0.mlp.experts.2.gate_proj.weight" if name == "qwen3_moe"
           else "model.layers.0.block_sparse_moe.experts.2.w1.weight")
    state[bad] = torch.zeros(rows, state[bad].shape[1])
    with pytest.raises(CheckpointError, match=rf"{bad}: checkpoint shape \({rows}, 64\)"):
        build_model(ours.config, state.items(), torch.float32, CPU)


@pytest.mark.parametrize("case", [
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[])),  # MoE on layer 1 only
    ("qwen3_moe", dict(norm_topk_prob=False, attention_bias=True)),  # raw softmax weights
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16)),  # every layer windowed
    ("mixtral", dict(sliding_window=16)),
    ("mixtral", dict(num_experts_per_tok=1)),
], ids=["qwen3_sparse_step", "qwen3_unnormalised", "qwen3_window", "mixtral_window",
        "mixtral_top1"])
def test_config_variants_match_hf(case, tmp_path):
    name, overrides = case
    folder = save_tiny_model(name, tmp_path, seed=1, **overrides)
    hf, ours = hf_model(folder), load_ours(folder)
    ps = prompts(3)[1:]
    assert greedy(ours, ps, 24) == [hf_greedy(hf, p, 24) for p in ps]
    assert_last_logits_match(ours, hf, ps[-1])


def test_routed_experts_refuse_an_activation_other_than_silu(tmp_path):
    from batchgen.models.registry import UnsupportedModelError

    save_tiny_model("mixtral", tmp_path, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'.*SiLU only"):
        load_ours(tmp_path)


def test_config_without_architectures_is_read_by_model_type(tmp_path):
    folder = save_tiny_model("qwen3_moe", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert type(load_ours(folder)).__name__ == "Qwen3MoeForCausalLM"


# -- expert offloading ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_expert_offloading_ratios_give_identical_tokens(name, tmp_path):
    folder = save_tiny_model(name, tmp_path)
    cfg = load_hf_config(folder)
    outputs = {}
    for ratio in (0.0, 0.5, 1.0):
        options = ModelConfig(enable_ep_with_offloading=True, ep_offloading_ratio=ratio)
        model = build_model(cfg, read_safetensors(folder), torch.float32, CPU, options)
        experts = model.model.layers[0].mlp.experts
        assert experts.num_offloaded == round(ratio * experts.num_experts)
        outputs[ratio] = greedy(model, prompts(4)[:3], 24)
        if ratio:
            assert model.expert_stager.copied_experts > 0
        else:
            assert model.expert_stager is None
    assert outputs[0.0] == outputs[0.5] == outputs[1.0]


# -- FP8 checkpoints -----------------------------------------------------------------------------
def write_fp8_checkpoint(src: Path, dst: Path, block=(16, 16)) -> None:
    """Quantize every projection and expert matrix of `src` (not norms, routers, embeddings or
    the LM head) into `dst`; `dst`/dequant holds the same weights dequantized."""
    (dst / "dequant").mkdir(parents=True)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            q, scale = quantize_blocks(tensor, block)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, block)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((src / "config.json").read_text())
    (dst / "dequant" / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dequantized, str(dst / "dequant" / "model.safetensors"))


@pytest.mark.parametrize("name", FAMILIES)
def test_fp8_checkpoint_loads_as_its_dequantized_weights(name, tmp_path):
    """On CPU FP8 weights (experts included) are dequantized at load: exactly the model of the
    dequantized checkpoint."""
    save_tiny_model(name, tmp_path / "src")
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8")
    ps = prompts(5)[1:3]
    assert greedy(load_ours(tmp_path / "fp8"), ps, 16) == greedy(
        load_ours(tmp_path / "fp8" / "dequant"), ps, 16)


# -- a job ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_batchgen_run_answers_chat_lines_like_transformers(name, tmp_path):
    check_chat_run_matches_transformers(name, tmp_path)


# -- CUDA (bf16 grouped GEMMs, streamed experts) -------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_bf16_matches_cpu_float32_and_offloading_keeps_tokens(name, tmp_path):
    """On CUDA the experts run moe.py's grouped GEMMs (no host sync) or, with offloading, the
    staged path; both give the same tokens, close to the float32 CPU model."""
    from batchgen.engine.kv_cache import KVLayout, KVPool
    from batchgen.forward_batch import ForwardBatch

    save_tiny_model(name, tmp_path, initializer_range=0.02)
    cuda = torch.device("cuda")

    def cuda_model(**options):
        return build_model(load_hf_config(tmp_path), read_safetensors(tmp_path), torch.bfloat16,
                           cuda, ModelConfig(**options))

    def last_logits(model, device, dtype):
        layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, dtype, dtype)
        pool = KVPool(layout, 8, device.type)
        prompt = prompts(7)[4]
        batch = ForwardBatch.build([prompt], [0], [list(range(8))], [True], pool, device)
        batch.logits_indices = torch.arange(len(prompt), device=device)
        with torch.inference_mode():
            return model(batch).float().cpu()

    expected = last_logits(load_ours(tmp_path), CPU, torch.float32)
    got = last_logits(cuda_model(), cuda, torch.bfloat16)
    rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    # Typical rows well under 2% (bf16); a row whose routing sits on a near-tie may flip.
    assert rel.median() < 0.02 and rel.max() < 0.3, (rel.median(), rel.max())
    tokens = {r: greedy(cuda_model(enable_ep_with_offloading=r > 0, ep_offloading_ratio=r),
                        prompts(), 16) for r in (0.0, 0.5)}
    assert tokens[0.0] == tokens[0.5]
