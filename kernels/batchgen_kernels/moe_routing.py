"""DeepSeek-V3 routing in one launch: sigmoid scores, bias-corrected grouped top-k, weights.

For each token (one program), with E experts in n_group groups of E / n_group:
  scores = sigmoid(logits); choice = scores + e_score_correction_bias
  group score = sum of its two best choice values (its only one if groups have one expert)
  keep the topk_group best groups; top_k experts by choice among the kept groups' experts
  weights = scores of those experts (the bias only steers the choice), divided by their sum
  (+1e-20) when norm_topk_prob, times routed_scaling_factor.
This is batchgen.models.moe.TopkRouter after its float32 router matmul, which stays in torch.

Selection is iterative argmax over the [n_group, group size] tile held in registers, so
outputs come in descending choice order. Ties break toward the lower index, for groups and
experts alike (torch.topk leaves tie order unspecified, so on exact ties the chosen set may
differ from the torch path; nothing else does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_shape, next_pow2

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, stride_w, stride_i,
                  scaling, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_NG: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_NG)
    j = tl.arange(0, BLOCK_GS)
    expert = g[:, None] * GROUP_SIZE + j[None, :]  # [BLOCK_NG, BLOCK_GS]
    valid = (g < N_GROUP)[:, None] & (j < GROUP_SIZE)[None, :]
    logit = tl.load(logits_ptr + t * stride_l + expert, mask=valid, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logit))
    bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, scores + bias, NEG_INF)

    # Group score: best + second best (the first position of the best is taken out).
    best = tl.max(choice, axis=1)
    if GROUP_SIZE > 1:
        first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_GS), axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], NEG_INF, choice), axis=1)
        group_score = best + second
    else:
        group_score = best
    # A group is kept when fewer than TOPK_GROUP groups beat it (higher, or equal and lower).
    other = group_score[None, :]
    mine = group_score[:, None]
    beats = (other > mine) | ((other == mine) & (g[None, :] < g[:, None]))
    rank = tl.sum(beats.to(tl.int32), axis=1)
    keep = (rank < TOPK_GROUP) & (g < N_GROUP)
    candidates = tl.where(keep[:, None], choice, NEG_INF)

    slot = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_K,), tl.float32)
    picked_id = tl.zeros((BLOCK_K,), tl.int32)
    for i in tl.static_range(TOP_K):
        top = tl.max(tl.max(candidates, axis=1), axis=0)
        at_top = tl.where(candidates == top, expert, BLOCK_NG * BLOCK_GS)
        pick = tl.min(tl.min(at_top, axis=1), axis=0)
        hit = (expert == pick) & valid  # padding columns alias the next group's ids
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        candidates = tl.where(hit, NEG_INF, candidates)
        picked_w = tl.where(slot == i, weight, picked_w)
        picked_id = tl.where(slot == i, pick, picked_id)
    if NORM:
        picked_w = picked_w / (tl.sum(picked_w, axis=0) + 1e-20)
    picked_w = picked_w * scaling
    mask = slot < TOP_K
    tl.store(weights_ptr + t * stride_w + slot, picked_w, mask=mask)
    tl.store(ids_ptr + t * stride_i + slot, picked_id.to(ids_ptr.dtype.element_ty), mask=mask)


def deepseek_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                   top_k: int, norm_topk_prob: bool, routed_scaling_factor: float,
                   ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped top-k routing from router logits.

    logits      [T, E] float32 (x @ router_weight^T), last dim contiguous.
    bias        [E] e_score_correction_bias, any float dtype (read as float32).
    n_group     groups of E / n_group consecutive experts; topk_group of them are kept.
    top_k       experts per token, chosen inside the kept groups (topk_group * E / n_group
                >= top_k).
    Returns (weights [T, top_k] float32, ids [T, top_k] ids_dtype (int64/int32)), in
    descending order of the bias-corrected score; ties go to the lower index.
    """
    check_device(logits, bias)
    check_dtype("logits", logits, (torch.float32,))
    check_dtype("bias", bias, FLOAT_DTYPES)
    if ids_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids_dtype {ids_dtype}: torch.int64 or torch.int32")
    if not (logits.dim() == 2 and logits.stride(1) == 1):
        raise ValueError("logits is [T, E], last dim contiguous")
    tokens, experts = logits.shape
    check_shape("bias", bias, (experts,))
    if bias.stride(0) != 1:
        raise ValueError("bias must be contiguous")
    if not (n_group >= 1 and experts % n_group == 0):
        raise ValueError(f"{experts} experts in {n_group} groups")
    group_size = experts // n_group
    if not (1 <= topk_group <= n_group):
        raise ValueError(f"topk_group {topk_group} of {n_group} groups")
    if not (1 <= top_k <= topk_group * group_size):
        raise ValueError(f"top_k {top_k} > {topk_group} kept groups x {group_size} experts")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=ids_dtype, device=logits.device)
    if tokens == 0:
        return weights, ids
    block = next_pow2(n_group) * next_pow2(group_size)
    _route_kernel[(tokens,)](
        logits, bias, weights, ids, logits.stride(0), weights.stride(0), ids.stride(0),
        float(routed_scaling_factor), N_GROUP=n_group, GROUP_SIZE=group_size,
        TOPK_GROUP=topk_group, TOP_K=top_k, NORM=bool(norm_topk_prob),
        BLOCK_NG=next_pow2(n_group), BLOCK_GS=next_pow2(group_size),
        BLOCK_K=next_pow2(top_k), num_warps=max(1, min(4, block // 256)))
    return weights, ids
