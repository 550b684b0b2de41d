"""deepseek_route against the reference and batchgen's TopkRouter, on tie-free inputs (the
kernel breaks ties toward the lower index, torch.topk leaves them unspecified)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from batchgen_kernels import deepseek_route, reference
from kernel_testing import DEVICES

from batchgen.models.moe import TopkRouter

# (experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
SETTINGS = {
    "tiny-deepseek": (16, 4, 2, 4, True, 2.5),  # tests/test_deepseek.py's tiny_config
    "v3-like": (64, 8, 4, 8, True, 2.5),
    "odd-group-size": (24, 4, 2, 3, False, 1.0),  # 6 experts per group: padded tile columns
    "odd-group-count": (12, 3, 2, 5, True, 1.0),
    "one-group": (16, 1, 1, 6, True, 1.0),
    "one-expert-groups": (8, 8, 3, 2, False, 0.5),
}


def tie_free_logits(tokens, experts, n_group, device):
    """Random router logits and bias whose choice scores and group scores have no ties (a
    draw with any is redrawn), so the chosen set is unique."""
    for _ in range(10):
        logits = torch.randn(tokens, experts, device=device) * 2
        bias = torch.randn(experts, device=device) * 0.1
        choice = logits.sigmoid() + bias
        per_group = choice.view(tokens, n_group, -1)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
        if all(len(set(row.tolist())) == len(row) for rows in (choice, group_scores)
               for row in rows):
            return logits, bias
    raise AssertionError("no tie-free draw in 10 tries")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_route_matches_reference(device, setting):
    experts, n_group, topk_group, top_k, norm, scaling = SETTINGS[setting]
    logits, bias = tie_free_logits(11, experts, n_group, device)
    weights, ids = deepseek_route(logits, bias, n_group, topk_group, top_k, norm, scaling)
    want_weights, want_ids = reference.deepseek_route(logits, bias, n_group, topk_group, top_k,
                                                      norm, scaling)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)  # same descending order
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((11,), scaling, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", ["tiny-deepseek", "odd-group-size"])
def test_route_equals_topk_router(device, setting):
    experts, n_group, topk_group, top_k, norm, scaling = SETTINGS[setting]
    hidden, tokens = 32, 9
    cfg = SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=norm,
                          routed_scaling_factor=scaling, hidden_size=hidden)
    router = TopkRouter(cfg).requires_grad_(False)
    router.weight.normal_(0, 0.3)
    router.e_score_correction_bias.uniform_(-0.1, 0.1)
    x = torch.randn(tokens, hidden)
    want_weights, want_ids = router._route_torch(F.linear(x, router.weight))
    logits = F.linear(x, router.weight).to(device)
    weights, ids = deepseek_route(logits, router.e_score_correction_bias.to(device), n_group,
                                  topk_group, top_k, norm, scaling)
    order, want_order = ids.cpu().sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.cpu().gather(1, order.indices),
                               want_weights.gather(1, want_order.indices), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_route_int32_ids_bf16_bias_and_empty_batch(device):
    logits, bias = tie_free_logits(5, 16, 4, device)
    weights, ids = deepseek_route(logits, bias.bfloat16(), 4, 2, 4, True, 2.5,
                                  ids_dtype=torch.int32)
    want_weights, want_ids = reference.deepseek_route(logits, bias.bfloat16().float(), 4, 2, 4,
                                                      True, 2.5)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    weights, ids = deepseek_route(logits[:0], bias, 4, 2, 4, True, 2.5)
    assert weights.shape == (0, 4) and ids.shape == (0, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_route_rejects_bad_settings(device):
    logits = torch.randn(3, 16, device=device)
    bias = torch.zeros(16, device=device)
    with pytest.raises(ValueError):  # 1 kept group of 4 experts cannot give 5
        deepseek_route(logits, bias, 4, 1, 5, True, 1.0)
    with pytest.raises(ValueError):  # 16 experts do not split into 3 groups
        deepseek_route(logits, bias, 3, 1, 2, True, 1.0)
    with pytest.raises(TypeError):  # logits must be float32
        deepseek_route(logits.bfloat16(), bias, 4, 2, 4, True, 1.0)


@pytest.mark.gpu
@pytest.mark.gpu
def test_topk_router_routes_with_the_kernel_on_cuda():
    cfg = SimpleNamespace(n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                          norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=128)
    router = TopkRouter(cfg).requires_grad_(False).cuda()
    router.weight.normal_(0, 0.3)
    router.e_score_correction_bias.uniform_(-0.1, 0.1)
    x = torch.randn(300, 128, device="cuda").bfloat16()
    weights, ids = router(x)  # the kernel
    want_weights, want_ids = router._route_torch(F.linear(x.float(), router.weight))
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    same = (order.values == want_order.values).all(dim=-1)
    assert same.float().mean() > 0.99  # rows on an ulp-level near-tie may differ
    torch.testing.assert_close(weights.gather(1, order.indices)[same],
                               want_weights.gather(1, want_order.indices)[same],
                               rtol=1e-5, atol=1e-6)
