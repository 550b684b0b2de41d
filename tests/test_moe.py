"""DeepSeek MoE pieces vs HF's modules on random weights: grouped sigmoid routing, routed +
shared experts, FP8 experts, and expert offloading (identical outputs, only touched experts
copied)."""

from __future__ import annotations

import pytest
import torch
from test_deepseek import tiny_config

from batchgen.models.fp8 import QuantizedWeight, dequantize_blocks, quantize_blocks
from batchgen.models.expert_bank import ExpertStager
from batchgen.models.moe import DeepseekMoE, RoutedExperts, TopkRouter

CFG = tiny_config()
E, I, H = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size


def hf_moe(seed=0):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    module = DeepseekV3MoE(CFG).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
        module.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return module


def ours_from(hf, num_offloaded=0, stager=None, quantize_block=None) -> DeepseekMoE:
    """Our DeepseekMoE loaded with `hf`'s weights through the per-expert load path."""
    moe = DeepseekMoE(CFG, num_offloaded, stager).requires_grad_(False)
    with torch.no_grad():
        moe.gate.weight.copy_(hf.gate.weight)
        moe.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_experts, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    for e in range(E):
        gate, up = hf.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        for proj, w in (("gate_proj", gate), ("up_proj", up),
                        ("down_proj", hf.experts.down_proj[e].detach())):
            if quantize_block is not None:
                w = QuantizedWeight(*quantize_blocks(w, quantize_block), quantize_block)
            moe.experts.load(e, proj, w)
    assert not moe.experts.missing()
    return moe


def tokens(n=40, seed=1):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_router_matches_hf():
    hf = hf_moe()
    router = TopkRouter(CFG).requires_grad_(False)
    router.weight.copy_(hf.gate.weight)
    router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
    x = tokens()
    weights, ids = router(x)
    _, hf_weights, hf_ids = hf.gate(x)
    ours_sorted, hf_sorted = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(ours_sorted.values, hf_sorted.values)
    torch.testing.assert_close(weights.gather(1, ours_sorted.indices),
                               hf_weights.gather(1, hf_sorted.indices))
    # Grouped top-k: every choice lies in one of the token's topk_group best groups.
    groups = ids // (E // CFG.n_group)
    assert all(len(set(row.tolist())) <= CFG.topk_group for row in groups)
    # norm_topk_prob then routed_scaling_factor: each token's weights sum to the factor.
    torch.testing.assert_close(weights.sum(-1), torch.full((len(x),), CFG.routed_scaling_factor))


def test_moe_matches_hf():
    hf = hf_moe()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours_from(hf)(x), hf(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_offloaded", [5, 16])
def test_offloaded_experts_give_identical_outputs(num_offloaded):
    hf = hf_moe()
    x = tokens(60)
    resident = ours_from(hf)
    stager = ExpertStager(num_offloaded)
    offloaded = ours_from(hf, num_offloaded, stager)
    assert offloaded.experts.gate_up_proj.shape[0] == E - num_offloaded
    assert offloaded.experts.host.gate_up.shape == (num_offloaded, 2 * I, H)
    with torch.no_grad():
        assert torch.equal(offloaded(x), resident(x))
    _, ids = resident.gate(x)
    touched = {e for e in ids.flatten().tolist() if e >= E - num_offloaded}
    assert stager.copied_experts == len(touched) and stager.fetches == 1


def test_stager_alternates_slots_and_copies_only_touched_experts():
    hf = hf_moe()
    stager = ExpertStager(8)
    layers = [ours_from(hf, 8, stager), ours_from(hf, 8, stager)]
    x = tokens(1)  # one token: k = 4 experts
    with torch.no_grad():
        _, ids = layers[0].gate(x)
        for layer in layers:
            layer(x)
    expected = sum(e >= E - 8 for e in ids[0].tolist())
    assert stager.copied_experts == 2 * expected
    assert stager.fetches == (2 if expected else 0)
    assert stager.next == stager.fetches % ExpertStager.NUM_SLOTS  # the layers used both slots


def test_fp8_experts_run_as_their_dequantized_weights():
    hf = hf_moe()
    block = (16, 16)
    quantized = ours_from(hf, num_offloaded=4, stager=ExpertStager(4), quantize_block=block)
    assert quantized.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert quantized.experts.gate_up_scale.shape == (E - 4, 2 * I // 16, H // 16)
    dense = ours_from(hf)
    with torch.no_grad():  # the dense reference gets exactly the dequantized expert weights
        for e in range(E):
            gate, up = hf.experts.gate_up_proj[e].chunk(2, dim=0)
            down = hf.experts.down_proj[e]
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                dense.experts.load(e, proj, dequantize_blocks(*quantize_blocks(w, block), block))
        x = tokens()
        torch.testing.assert_close(quantized(x), dense(x), rtol=1e-5, atol=1e-5)


def test_routed_experts_reject_bad_offload_count():
    with pytest.raises(AssertionError):
        RoutedExperts(4, 8, 8, num_offloaded=5, stager=None)


# -- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_grouped_mm_and_streamed_offload_match_loop():
    hf = hf_moe()
    x = tokens(300).cuda().bfloat16()
    reference = ours_from(hf).bfloat16()  # CPU: loop path
    expected = reference(x.cpu()).float()
    resident = ours_from(hf).cuda().bfloat16()
    stager = ExpertStager(6)
    streamed = ours_from(hf, 6, stager)
    streamed = streamed.cuda().bfloat16()
    streamed.experts.host = None  # rebuild the host bank in bf16, pinned
    for e in range(E - 6, E):
        gate, up = hf.experts.gate_up_proj[e].detach().bfloat16().chunk(2, dim=0)
        streamed.experts.load(e, "gate_proj", gate)
        streamed.experts.load(e, "up_proj", up)
        streamed.experts.load(e, "down_proj", hf.experts.down_proj[e].detach().bfloat16())
    assert streamed.experts.host.gate_up.is_pinned()
    with torch.no_grad():
        out_resident = resident(x).float().cpu()
        out_streamed = streamed(x).float().cpu()
    torch.testing.assert_close(out_resident, expected, rtol=3e-2,
                               atol=3e-2 * expected.abs().max().item())
    assert torch.equal(out_streamed, out_resident)
    assert stager.stream is not None and stager.copied_experts > 0


@pytest.mark.parametrize("first,local", [(0, E), (0, E // 2), (E // 2, E // 2), (4, 4)])
def test_sync_free_path_matches_dispatch_path(first, local):
    """The static-shape path CUDA graphs capture (all assignments sorted, counts scattered on
    the device, other ranks' experts masked) == the host-counted path, with and without a
    share of the experts living on another rank."""
    hf = hf_moe()
    x = tokens(50)
    routed = RoutedExperts(local, H, I, 0, None, first_expert=first, total_experts=E)
    for e in range(E):
        gate, up = hf.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        for proj, w in (("gate_proj", gate), ("up_proj", up),
                        ("down_proj", hf.experts.down_proj[e].detach())):
            routed.load(e, proj, w)
    assert not routed.missing()
    weights, ids = ours_from(hf).gate(x)
    with torch.no_grad():
        expected = routed.finish(routed.dispatch(x, ids), weights)
        torch.testing.assert_close(routed.forward_on_device(x, ids, weights), expected,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_tensor", [True, False], ids=["tensor", "channel"])
def test_row_scaled_experts_load_on_a_block_grid_or_dense(per_tensor):
    """The grouped FP8 GEMM takes block scales only: a per-tensor expert scale is restated on
    the largest square block (<= 128) dividing both expert widths, values unchanged; a
    per-channel one is dequantized (then the bank stays dense)."""
    from batchgen.models.fp8 import FP8, QuantizedWeight, dequantize_blocks

    routed = RoutedExperts(2, 64, 32, 0, None)
    for expert in range(2):
        for proj, (n, k) in (("gate_proj", (32, 64)), ("up_proj", (32, 64)),
                             ("down_proj", (64, 32))):
            w = torch.randn(n, k)
            amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
            scale = (amax / 448.0).reshape(-1, 1).expand(n, 1).contiguous()
            q = (w / scale).to(FP8)
            routed.load(expert, proj, QuantizedWeight(q, scale, (1, k)))
            want = q.float() * scale
            if proj == "down_proj":
                got = (dequantize_blocks(routed.down_proj[expert], routed.down_scale[expert],
                                         routed.block) if per_tensor else routed.down_proj[expert])
                torch.testing.assert_close(got.float(), want)
    assert routed.block == ((32, 32) if per_tensor else None)


def test_experts_expected_fp8_hold_e4m3_and_quantize_a_dense_matrix():
    """A bank told up front that its checkpoint is FP8 (expect_fp8, on the meta model) holds
    e4m3 + block scales before any weight arrives; a dense matrix loaded into it anyway is
    quantized onto its grid, never cast into e4m3 without a scale."""
    hf = hf_moe()
    block = (16, 16)
    moe = DeepseekMoE(CFG, 0, None).requires_grad_(False)
    moe.experts.expect_fp8(block)
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert moe.experts.down_scale.shape == (E, H // 16, I // 16)
    for e in range(E):
        gate, up = hf.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        for proj, w in (("gate_proj", gate), ("up_proj", up),
                        ("down_proj", hf.experts.down_proj[e].detach())):
            moe.experts.load(e, proj, w if e % 2 else QuantizedWeight(*quantize_blocks(w, block),
                                                                        block))
    want = hf.experts.down_proj[1].detach()
    got = dequantize_blocks(moe.experts.down_proj[1], moe.experts.down_scale[1], block)
    torch.testing.assert_close(got, dequantize_blocks(*quantize_blocks(want, block), block))


def test_fp8_checkpoint_experts_are_e4m3_before_materialising_on_cuda():
    """The model of a block-scaled FP8 MoE checkpoint kept FP8 (CUDA) gets e4m3 expert stacks
    on the meta device, so the device never holds them in bf16 (twice the FP8 bytes); on CPU,
    or with --pre-dequantize-weights, they stay in the model dtype (dequantized at load)."""
    from types import SimpleNamespace

    from batchgen.models.loader import fp8_experts_up_front, meta_model

    cfg = tiny_config()
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16]}

    def expert_dtypes(device, **options):
        model = meta_model(cfg).to(torch.bfloat16)
        fp8_experts_up_front(model, cfg, torch.device(device), SimpleNamespace(**options))
        return {m.gate_up_proj.dtype for m in model.modules() if isinstance(m, RoutedExperts)}

    assert expert_dtypes("cuda") == {torch.float8_e4m3fn}
    assert expert_dtypes("cpu") == {torch.bfloat16}
    assert expert_dtypes("cuda", pre_dequantize_weights=True) == {torch.bfloat16}
    del cfg.quantization_config["weight_block_size"]  # per-tensor: switched as weights arrive
    assert expert_dtypes("cuda") == {torch.bfloat16}
