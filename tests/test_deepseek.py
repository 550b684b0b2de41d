"""DeepSeek-V3/R1 (MLA + MoE) vs HF DeepseekV3ForCausalLM on tiny random weights: greedy
tokens and logits, naive vs absorbed MLA, FP8 block checkpoints, expert offloading and tiny
KV pools (unload / eviction with the latent cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import greedy_requests, hf_greedy, load_ours, make_engine, make_engine_pages
from safetensors.torch import load_file, save_file

from batchgen.config import ModelConfig
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.models.fp8 import dequantize_blocks, quantize_blocks
from batchgen.models.loader import build_model, load_hf_config, read_safetensors

VOCAB = 512
NEW_TOKENS = 48
CPU = torch.device("cpu")


def tiny_config(**overrides):
    """3 layers (1 dense + 2 MoE), 16 routed experts in 4 groups, q LoRA on, YaRN x4."""
    from transformers import DeepseekV3Config

    params = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 16, "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 32,
        "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "tie_word_embeddings": False,
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    params.update(overrides)
    return DeepseekV3Config(**params)


def save_tiny(folder: Path, seed: int = 0, **overrides):
    """Save a random HF model (per-expert tensor names, as real checkpoints) and return it."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():  # HF zero-initialises it; a non-zero bias exercises its role
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def prompts(seed=0, lengths=(3, 17, 64, 65, 150)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def generate(model, ps, max_tokens=NEW_TOKENS, **engine_kw):
    engine = make_engine(model, **engine_kw)
    try:
        results = engine.generate(greedy_requests(ps, max_tokens, ignore_eos=True))
        engine.scheduler.check_integrity()
        return [r.completions[0].token_ids for r in results], engine.stats()
    finally:
        engine.close()  # unpins the host KV segment on CUDA before it is unmapped


def prefill_logits(model, prompt, page_count=8):
    """Last-row logits of one prompt prefilled in a single forward."""
    layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, torch.float32,
                      torch.float32)
    pool = KVPool(layout, page_count, "cpu")
    batch = ForwardBatch.build([prompt], [0], [list(range(page_count))], [True], pool, CPU)
    with torch.inference_mode():
        return model(batch)[0]


def load_with(folder: Path, **options):
    cfg = load_hf_config(folder)
    return build_model(cfg, read_safetensors(folder), torch.float32, CPU, ModelConfig(**options))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek")
    hf = save_tiny(folder)
    return folder, hf, load_ours(folder)


@pytest.fixture(scope="module")
def hf_tokens(tiny):
    _, hf, _ = tiny
    with torch.inference_mode():
        return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def test_kv_cache_holds_latent_and_rope_key(tiny):
    _, _, ours = tiny
    assert ours.kv_token_shape == (1, 32 + 16)
    engine = make_engine(ours)
    assert engine.layout.bytes_per_token == 3 * 48 * 4  # layers x (latent + rope) x float32


def test_greedy_tokens_match_hf_batched(tiny, hf_tokens):
    _, _, ours = tiny
    tokens, _ = generate(ours, prompts())
    assert tokens == hf_tokens


def test_logits_match_hf_prefill_and_decode(tiny):
    _, hf, ours = tiny
    prompt = prompts(1)[4]
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, prompt), hf_logits[-1], rtol=1e-4, atol=1e-4)
    # Decode step (absorbed path) after a prefill of all but the last token (naive path).
    layout = KVLayout(3, ours.kv_token_shape, torch.float32, torch.float32)
    pool = KVPool(layout, 4, "cpu")
    pages = [[2, 0, 3]]
    with torch.inference_mode():
        ours(ForwardBatch.build([prompt[:-1]], [0], pages, [False], pool, CPU))
        step = ForwardBatch.build([prompt[-1:]], [len(prompt) - 1], pages, [True], pool, CPU)
        decode = ours(step)
    torch.testing.assert_close(decode[0], hf_logits[-1], rtol=1e-4, atol=1e-4)


def test_naive_and_absorbed_mla_agree(tiny, hf_tokens):
    folder, _, _ = tiny
    naive, absorbed = load_ours(folder), load_ours(folder)
    naive.set_mla_impl(prefill="naive", decode="naive")
    absorbed.set_mla_impl(prefill="absorb", decode="absorb")
    prompt = prompts(2)[4]
    torch.testing.assert_close(prefill_logits(absorbed, prompt), prefill_logits(naive, prompt),
                               rtol=1e-4, atol=1e-4)
    assert generate(naive, prompts())[0] == hf_tokens
    assert generate(absorbed, prompts())[0] == hf_tokens


@pytest.mark.parametrize("variant", [
    {"q_lora_rank": None},
    {"rope_interleave": False},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "topk_group": 4},
    {"n_shared_experts": 0},  # HF saves zero-sized shared-expert tensors: nothing to load
    {"hidden_act": "gelu", "num_hidden_layers": 1},  # dense layers take any activation
])
def test_config_variants_match_hf(tmp_path, variant):
    hf = save_tiny(tmp_path, seed=1, **variant)
    ours = load_ours(tmp_path)
    prompt = prompts(3)[4]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, rtol=1e-4, atol=1e-4)


def test_routed_experts_refuse_an_activation_other_than_silu(tmp_path):
    from batchgen.models.registry import UnsupportedModelError

    save_tiny(tmp_path, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(UnsupportedModelError, match="gelu_pytorch_tanh.*SiLU only"):
        load_ours(tmp_path)


def test_hf_grouped_expert_layout_loads(tiny):
    """HF 5.x holds experts as 3-D gate_up_proj / down_proj in memory; those names load too."""
    _, hf, ours = tiny
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    grouped = build_model(hf.config, state.items(), torch.float32, CPU)
    prompt = prompts(4)[3]
    assert torch.equal(prefill_logits(grouped, prompt), prefill_logits(ours, prompt))


def test_checkpoint_mtp_layer_is_skipped_and_missing_tensors_fail(tiny):
    folder, _, ours = tiny
    state = load_file(str(folder / "model.safetensors"))
    extra = dict(state, **{"model.layers.3.self_attn.o_proj.weight": torch.zeros(2, 2)})
    build_model(ours.config, extra.items(), torch.float32, CPU)
    del state["model.layers.2.mlp.experts.7.up_proj.weight"]
    with pytest.raises(ValueError, match="experts.7.up_proj"):
        build_model(ours.config, state.items(), torch.float32, CPU)


# -- FP8 block-quantized checkpoints -----------------------------------------------------------
def write_fp8_checkpoint(src: Path, dst: Path, block=(16, 16)) -> None:
    """Quantize every projection matrix of `src` (as R1 does: not norms, router, embeddings or
    lm_head) with our quantizer; also write `dst`-dequant/ holding the dequantized weights."""
    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale = quantize_blocks(tensor, block)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, block)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(dst / "model.safetensors"))
    (dst / "dequant").mkdir()
    (dst / "dequant" / "config.json").write_text((src / "config.json").read_text())
    save_file(dequantized, str(dst / "dequant" / "model.safetensors"))


def all_logits(model, prompt):
    """Logits of every prompt position, one prefill forward."""
    layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, torch.float32,
                      torch.float32)
    pool = KVPool(layout, 8, "cpu")
    batch = ForwardBatch.build([prompt], [0], [list(range(8))], [True], pool, CPU)
    batch.logits_indices = torch.arange(len(prompt))
    with torch.inference_mode():
        return model(batch)


def test_fp8_checkpoint_loads_and_matches_reference(tmp_path):
    # A smoother model than `tiny` (init 0.02, not 0.2): at 0.2 the tiny network is chaotic
    # enough that 2% random weight noise already moves logits by ~25%.
    save_tiny(tmp_path / "src", initializer_range=0.02)
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8")
    fp8_model = load_ours(tmp_path / "fp8")
    assert fp8_model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float32  # CPU
    prompt = prompts(5)[4]
    fp8_logits = all_logits(fp8_model, prompt)
    # Dequantizing at load is exactly the dequantized checkpoint...
    assert torch.equal(fp8_logits, all_logits(load_ours(tmp_path / "fp8" / "dequant"), prompt))
    # ...and within FP8 rounding (e4m3: ~2.6% relative error per weight matrix) of the
    # full-precision model; measured: mean 0.04, max 0.10.
    full = all_logits(load_ours(tmp_path / "src"), prompt)
    rel = (fp8_logits - full).norm(dim=-1) / full.norm(dim=-1)
    assert rel.mean() < 0.08 and rel.max() < 0.2, (rel.mean(), rel.max())


# -- expert offloading --------------------------------------------------------------------------
def test_expert_offloading_ratios_give_identical_tokens(tiny, hf_tokens):
    folder, _, _ = tiny
    outputs = {}
    for ratio in (0.0, 0.3, 1.0):
        model = load_with(folder, enable_ep_with_offloading=True, ep_offloading_ratio=ratio)
        experts = model.model.layers[1].mlp.experts
        assert experts.num_offloaded == round(ratio * 16)
        outputs[ratio], _ = generate(model, prompts())
        stager = model.expert_stager
        if ratio == 0.0:
            assert stager is None
        else:
            assert stager.copied_experts > 0 and stager.copied_bytes > 0
    assert outputs[0.0] == outputs[0.3] == outputs[1.0] == hf_tokens


# -- tiny KV pools: unload / eviction with the MLA cache ------------------------------------------
def test_tiny_pools_unload_and_evict_with_latent_cache(tiny):
    _, _, ours = tiny
    ps = prompts(6, lengths=(5, 10, 20, 30, 40, 50))  # short prompts that grow past 2 pages
    roomy, _ = generate(ours, ps, 120)
    engine = make_engine_pages(
        ours, device_pages=6, host_pages=8, initial_gpu_page_buffer=1,
        extension_gpu_page_buffer=1, decision_frequency_pages=1, host_kv_chunk_size=64,
        adaptive_chunk=False, max_prefill_tokens=96, host_kv_watermark=50.0)
    results = engine.generate(greedy_requests(ps, 120, ignore_eos=True))
    engine.scheduler.check_integrity()
    stats = engine.stats()
    engine.close()
    assert [r.completions[0].token_ids for r in results] == roomy
    assert stats["unloads"] > 0 and stats["loads"] > 0
    assert stats["evictions"] > 0 and stats["reprefill_tokens"] > 0
    assert stats["peak_device_pages"] <= 6 and stats["peak_host_pages"] <= 8


# -- CUDA (bf16, FP8 kept as FP8, streamed experts) --------------------------------------------
def cuda_model(folder: Path, dtype=torch.bfloat16, **options):
    cfg = load_hf_config(folder)
    return build_model(cfg, read_safetensors(folder), dtype, torch.device("cuda"),
                       ModelConfig(**options))


def cuda_prefill_logits(model, prompt):
    layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, torch.bfloat16,
                      torch.bfloat16)
    pool = KVPool(layout, 8, "cuda")
    batch = ForwardBatch.build([prompt], [0], [list(range(8))], [True], pool, torch.device("cuda"))
    batch.logits_indices = torch.arange(len(prompt), device="cuda")
    with torch.inference_mode():
        return model(batch).cpu()


@pytest.mark.gpu
def test_cuda_bf16_matches_cpu_float32(tmp_path):
    save_tiny(tmp_path, initializer_range=0.02)
    prompt = prompts(7)[4]
    expected = all_logits(load_ours(tmp_path), prompt)
    got = cuda_prefill_logits(cuda_model(tmp_path), prompt)
    rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    # Typical rows ~0.6% (bf16); a row whose routing sits on a near-tie may flip an expert.
    assert rel.median() < 0.02 and rel.max() < 0.3, (rel.median(), rel.max())
    tokens = {r: generate(cuda_model(tmp_path, enable_ep_with_offloading=True,
                                     ep_offloading_ratio=r), prompts())[0] for r in (0.0, 0.3, 1.0)}
    assert tokens[0.0] == tokens[0.3] == tokens[1.0]


@pytest.mark.gpu
def test_cuda_fp8_checkpoint_runs_block_scaled_gemms(tmp_path):
    from batchgen.models.fp8 import Fp8Linear

    dims = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
            "q_lora_rank": 128, "kv_lora_rank": 128, "initializer_range": 0.02}
    save_tiny(tmp_path / "src", **dims)
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", block=(128, 128))
    model = cuda_model(tmp_path / "fp8", enable_ep_with_offloading=True, ep_offloading_ratio=0.3)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj, Fp8Linear) and not isinstance(attn.kv_b_proj, Fp8Linear)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    prompt = prompts(8)[4]
    expected = all_logits(load_ours(tmp_path / "fp8" / "dequant"), prompt)
    got = cuda_prefill_logits(model, prompt)
    rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    # Typical rows ~6% (1x128 e4m3 activations + bf16); near-tie routing rows flip experts.
    assert rel.median() < 0.1, rel.median()
    assert generate(model, prompts()[:3], 8)[0]  # decode runs through the same kernels
