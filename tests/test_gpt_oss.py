"""gpt-oss vs HF GptOssForCausalLM on a tiny random model whose experts went through our MXFP4
quantizer: both sides use the same dequantized values, ours reading the packed checkpoint
(on-the-fly dequant, or pre-dequantized at load) and HF the dense weights."""

import json
from types import SimpleNamespace

import pytest
import torch
from engine_utils import greedy_requests, hf_greedy, make_engine
from safetensors.torch import save_file

from batchgen.config import ModelConfig
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.models.gpt_oss import (
    ExpertWeights,
    GptOssExperts,
    GptOssForCausalLM,
    looped_grouped_gemm,
    torch_grouped_gemm,
    triton_grouped_gemm,
)
from batchgen.models.loader import build_model, load_hf_config, read_safetensors
from batchgen.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

VOCAB = 512
WINDOW = 16
NEW_TOKENS = 40
PROMPT_LENGTHS = [5, 20, 64, 70, 140]  # shorter than the window, one page, crossing pages
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def tiny_config():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
        initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["GptOssForCausalLM"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128})


def quantize_hf_experts(hf) -> dict[str, torch.Tensor]:
    """Replace HF's dense expert weights by their MXFP4 round trip (in place); returns the
    packed tensors under the real checkpoint names."""
    packed = {}
    for name, param in hf.named_parameters():
        if not name.endswith(tuple("experts." + w for w in EXPERT_WEIGHTS)):
            continue
        blocks, scales = quantize_mxfp4(param.data.transpose(1, 2))  # HF [E, in, out]
        with torch.no_grad():
            param.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    return packed


def randomize_biases(hf, gen: torch.Generator) -> None:
    """HF initialises most biases to zero; random ones make the parity test cover them. The
    large gate_up biases push a few percent of the SwiGLU inputs past the +-7 clamp."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                std = 4.0 if name.endswith("gate_up_proj_bias") else 0.2
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def save_mxfp4_checkpoint(hf, packed: dict, folder):
    """The layout of the real gpt-oss checkpoints: packed experts + quantization_config."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()
               if not n.endswith(tuple("experts." + w for w in EXPERT_WEIGHTS))}
    save_file({**tensors, **packed}, str(folder / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF model, MXFP4 folder, dense folder written by HF save_pretrained)."""
    from transformers import GptOssForCausalLM as HFGptOss

    torch.manual_seed(0)
    hf = HFGptOss(tiny_config()).float().eval()
    randomize_biases(hf, torch.Generator().manual_seed(1))
    packed = quantize_hf_experts(hf)
    root = tmp_path_factory.mktemp("gpt_oss")
    mxfp4 = save_mxfp4_checkpoint(hf, packed, root / "mxfp4")
    hf.save_pretrained(str(root / "dense"), safe_serialization=True)
    return hf, mxfp4, root / "dense"


def load_ours(folder, pre_dequantize=False, dtype=torch.float32):
    options = ModelConfig(pre_dequantize_weights=pre_dequantize)
    return build_model(load_hf_config(folder), read_safetensors(folder), dtype,
                       torch.device("cpu"), options)


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_continuations(checkpoints):
    hf = checkpoints[0]
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def last_token_logits(model, prompt):
    pages = -(-len(prompt) // 64)
    layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, torch.float32,
                      torch.float32)
    pool = KVPool(layout, pages, "cpu")
    batch = ForwardBatch.build([prompt], [0], [list(range(pages))], [True], pool,
                               torch.device("cpu"))
    with torch.inference_mode():
        return model(batch)[0]


@pytest.mark.parametrize("pre_dequantize", [False, True], ids=["on_the_fly", "pre_dequantized"])
def test_greedy_tokens_match_hf_batched(checkpoints, hf_continuations, pre_dequantize):
    ours = load_ours(checkpoints[1], pre_dequantize)
    results = make_engine(ours).generate(greedy_requests(prompts(), NEW_TOKENS, ignore_eos=True))
    assert [r.completions[0].token_ids for r in results] == hf_continuations


@pytest.mark.parametrize("source", ["mxfp4", "mxfp4_pre_dequantized", "dense"])
def test_logits_match_hf(checkpoints, source):
    hf, mxfp4, dense = checkpoints
    ours = load_ours(dense if source == "dense" else mxfp4, source == "mxfp4_pre_dequantized")
    prompt = prompts(1)[-1]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(last_token_logits(ours, prompt), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hidden,inter", [(48, 64), (64, 24)])
def test_dense_checkpoint_of_widths_mxfp4_cannot_pack(tmp_path, hidden, inter):
    """Widths that are not multiples of 32 only rule out MXFP4; a dense checkpoint loads."""
    from transformers import AutoModelForCausalLM

    config = tiny_config()
    config.hidden_size, config.intermediate_size = hidden, inter
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    prompt = prompts(4)[3]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(last_token_logits(load_ours(tmp_path), prompt), expected,
                               rtol=1e-4, atol=1e-4)


def expert_storage(model) -> list[ExpertWeights]:
    return [m for m in model.modules() if isinstance(m, ExpertWeights)]


def test_mxfp4_experts_stay_packed(checkpoints):
    ours = load_ours(checkpoints[1])
    storage = expert_storage(ours)
    assert len(storage) == 2 * ours.config.num_hidden_layers
    for weights in storage:
        assert weights.packed and weights.blocks.dtype == torch.uint8
        assert not hasattr(weights, "weight")
    packed_bytes = sum(b.numel() for w in storage for b in (w.blocks, w.scales))
    dense_values = sum(w.shape[0] * w.shape[1] * w.shape[2] for w in storage)
    assert packed_bytes * 8 / dense_values == pytest.approx(4.25)  # bits per weight


def test_pre_dequantize_gives_model_dtype_experts(checkpoints):
    packed = load_ours(checkpoints[1], dtype=torch.bfloat16)
    dense = load_ours(checkpoints[1], pre_dequantize=True, dtype=torch.bfloat16)
    for p, d in zip(expert_storage(packed), expert_storage(dense)):
        assert not d.packed and d.weight.dtype == torch.bfloat16
        for e in range(p.shape[0]):
            assert torch.equal(d.weight[e], p.expert(e, torch.bfloat16))


def test_dense_checkpoint_loads_dense(checkpoints):
    hf, _, dense = checkpoints
    ours = load_ours(dense)
    for name, weights in zip(("gate_up_proj", "down_proj"), expert_storage(ours)[:2]):
        assert not weights.packed
        hf_weight = getattr(hf.model.layers[0].mlp.experts, name)
        assert torch.equal(weights.weight, hf_weight.transpose(1, 2))


def test_layer_windows_alternate(checkpoints):
    ours = load_ours(checkpoints[1])
    windows = [layer.self_attn.window for layer in ours.model.layers]
    assert windows == [WINDOW, None, WINDOW, None]  # HF's default layer_types
    assert ours.kv_token_shape == (2, 2, 16)


def test_missing_scales_is_an_error(checkpoints):
    folder = checkpoints[1]
    cfg = load_hf_config(folder)
    weights = [(n, t) for n, t in read_safetensors(folder) if not n.endswith("down_proj_scales")]
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="down_proj"):
        model.load_weights(weights)


def random_experts(packed: bool, dtype=torch.float32, device="cpu", hidden=64, inter=64,
                   experts=8) -> GptOssExperts:
    """A GptOssExperts with random MXFP4-representable weights and random biases."""
    cfg = SimpleNamespace(num_local_experts=experts, hidden_size=hidden, intermediate_size=inter)
    module = GptOssExperts(cfg, packed)
    gen = torch.Generator().manual_seed(3)
    for proj in (module.gate_up_proj, module.down_proj):
        blocks, scales = quantize_mxfp4(torch.randn(proj.shape, generator=gen) * 0.2)
        if packed:
            proj.load("blocks", blocks, dtype)
            proj.load("scales", scales, dtype)
        else:
            proj.load("dense", dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2),
                      dtype)
    with torch.no_grad():
        module.gate_up_proj_bias.copy_(torch.randn(module.gate_up_proj_bias.shape,
                                                   generator=gen) * 4.0)
        module.down_proj_bias.copy_(torch.randn(module.down_proj_bias.shape, generator=gen))
    return module.to(device=device, dtype=dtype)


def random_routing(tokens: int, experts: int, k: int, dtype, device, seed=0):
    """(x-independent) routing weights [T, k] summing to 1 and distinct expert ids [T, k]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    return weights.to(device=device, dtype=dtype), ids.to(device)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_grouped_experts_match_loop(packed, tokens):
    """Sorting, offsets (empty experts included), bias gather, SwiGLU and the un-permuting
    combine of the grouped path, with per-group matmuls standing in for the CUDA GEMM."""
    experts = random_experts(packed)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen)
    weights, ids = random_routing(tokens, 8, 3, torch.float32, "cpu", seed=tokens)
    with torch.inference_mode():
        expected = experts.forward_loop(x, weights, ids)
        got = experts.forward_grouped(x, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_grouped_offsets_cover_each_expert():
    """looped_grouped_gemm multiplies exactly rows [offs[e-1], offs[e]) by w[e]."""
    w = torch.randn(4, 5, 6)
    x = torch.randn(7, 6)
    offs = torch.tensor([2, 2, 6, 7], dtype=torch.int32)  # expert 1 has no rows
    out = looped_grouped_gemm(x, w, offs)
    expected = torch.cat([x[0:2] @ w[0].T, x[2:6] @ w[2].T, x[6:7] @ w[3].T])
    torch.testing.assert_close(out, expected)


def test_model_with_grouped_experts_matches_hf(checkpoints, monkeypatch):
    monkeypatch.setattr(GptOssExperts, "forward", GptOssExperts.forward_grouped)
    hf, mxfp4, _ = checkpoints
    prompt = prompts(1)[-1]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(last_token_logits(load_ours(mxfp4), prompt), expected,
                               rtol=1e-4, atol=1e-4)


cuda = pytest.mark.gpu  # skipped on CPU-only machines (conftest)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@cuda
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemm", [None, triton_grouped_gemm], ids=["default", "triton"])
def test_cuda_grouped_experts_match_loop(packed, dtype, gemm):
    """The CUDA grouped path (forward's default: _grouped_mm for bf16, Triton for float32)
    against the float32 per-expert loop of the same weights."""
    reference = random_experts(packed, torch.float32, "cuda", hidden=128, inter=96, experts=16)
    experts = random_experts(packed, dtype, "cuda", hidden=128, inter=96, experts=16)
    x = torch.randn(50, 128, device="cuda")
    weights, ids = random_routing(50, 16, 4, torch.float32, "cuda")
    with torch.inference_mode():
        expected = reference.forward_loop(x, weights, ids)
        args = (x.to(dtype), weights.to(dtype), ids)
        got = experts(*args) if gemm is None else experts.forward_grouped(*args, gemm)
    assert got.dtype == dtype
    # bf16 output rounding alone is ~2e-3 relative; float32 runs the IEEE Triton kernel.
    assert relative_error(got, expected) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


GEMMS = [pytest.param(torch_grouped_gemm, id="grouped_mm", marks=pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")),
         pytest.param(triton_grouped_gemm, id="triton")]


@cuda
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_cuda_grouped_experts_capture_in_a_graph(packed, gemm):
    """No host sync: the forward captures into a CUDA graph, and replays follow new routing."""
    experts = random_experts(packed, torch.bfloat16, "cuda", hidden=128, inter=96, experts=16)
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    weights, ids = random_routing(8, 16, 4, torch.bfloat16, "cuda", seed=1)
    with torch.inference_mode():
        for _ in range(2):  # Triton compiles outside the capture
            experts.forward_grouped(x, weights, ids, gemm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts.forward_grouped(x, weights, ids, gemm)
        new_weights, new_ids = random_routing(8, 16, 4, torch.bfloat16, "cuda", seed=2)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        expected = experts.forward_grouped(x, weights, ids, gemm)
    torch.testing.assert_close(out, expected)  # the replay followed the new routing


@pytest.mark.parametrize("source", ["mxfp4", "mxfp4_pre_dequantized", "dense"])
def test_a_converted_folder_loads_and_matches_hf(checkpoints, source, tmp_path):
    """`batchgen convert` writes the experts under our own names (`.blocks`/`.scales`, or a
    dense `.weight` in our [E, out, in] layout): the converted folder loads back, packed or
    not, with HF's logits."""
    from batchgen.models.export import convert_model
    from batchgen.models.factory import load_model

    hf, mxfp4, dense = checkpoints
    folder = dense if source == "dense" else mxfp4
    options = ModelConfig(model=str(folder), dtype="float32",
                          pre_dequantize_weights=source == "mxfp4_pre_dequantized")
    out = convert_model(options, tmp_path / "conv")
    for pre_dequantize in (False, True):
        loaded = load_model(ModelConfig(converted_ckpt_dir=str(out), dtype="float32",
                                        pre_dequantize_weights=pre_dequantize),
                            torch.device("cpu"))
        prompt = prompts(1)[-1]
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(last_token_logits(loaded.model, prompt), expected,
                                   rtol=1e-4, atol=1e-4)
