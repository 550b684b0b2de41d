"""Pure-PyTorch references for every kernel: the definition each kernel is tested against.

They favour plainness over speed (loops over sequences, float math in `math_dtype`, float32
unless a test asks for float64) and return results in `math_dtype` without a final rounding,
except where the rounding is part of the contract (stored KV, the updated residual).
"""

from __future__ import annotations

import torch

from ._common import FP8_DTYPE, FP8_MAX, PAGE_SIZE, fp8_v_logical, fp8_v_stored


def dequantize_pages(kv: torch.Tensor, kv_scales: torch.Tensor | None, pages: torch.Tensor,
                     math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kv [num_pages, 64, 2, KVH, D] (+ scales) -> [len(pages) * 64, 2, KVH, D] in math_dtype."""
    picked = kv[pages.long()]  # [P, 64, 2, KVH, D]
    if kv.dtype == FP8_DTYPE:
        picked = convert_v_blocks(picked, fp8_v_logical)
    picked = picked.to(math_dtype)
    if kv_scales is not None:
        picked = picked * kv_scales[pages.long()].to(math_dtype).unsqueeze(-1)
    return picked.reshape(-1, *picked.shape[2:])


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                    page_table: torch.Tensor, sm_scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None,
                    math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal paged attention over packed sequences; decode is the case q_len = 1.

    q [T, H, D]; kv [num_pages, 64, 2, KVH, D]; kv_scales [num_pages, 64, 2, KVH] or None;
    cu_seqlens_q [B+1]; context_lens [B]; page_table [B, max_pages]; sinks [H] or None.
    Returns [T, H, D] in math_dtype.
    """
    heads, kv_heads = q.shape[1], kv.shape[3]
    out = torch.empty(q.shape, dtype=math_dtype, device=q.device)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        rows = slice(cu[b], cu[b + 1])
        q_len = cu[b + 1] - cu[b]
        pages = page_table[b, : -(-ctx // PAGE_SIZE)]
        keys = dequantize_pages(kv, kv_scales, pages, math_dtype)[:ctx]  # [ctx, 2, KVH, D]
        k = keys[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        v = keys[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].to(math_dtype), k) * sm_scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))  # [H, q_len, ctx]
        if sinks is not None:
            sink = sinks.to(math_dtype).view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn values, float32 scales [...]) with scale = amax / 448 and
    values x * (1 / scale) rounded to nearest even (the store kernel divides once per row).

    Both divisions are tensor / tensor, IEEE-rounded on every device: CUDA torch turns a
    division by a Python scalar into a multiplication by its reciprocal (1 ulp off at times).
    """
    amax = x.float().abs().amax(dim=-1).clamp_min(1e-8)
    scale = amax / torch.full_like(amax, FP8_MAX)
    inverse = torch.ones_like(scale) / scale
    # NaN is stored as 0: fp8 pools never hold NaN (the attention kernels rely on it).
    return torch.nan_to_num(x.float() * inverse.unsqueeze(-1), nan=0.0).to(FP8_DTYPE), scale


def store_kv(kv: torch.Tensor, kv_scales: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of kv [num_pages, 64, 2, KVH, D] (and scales) with k/v [T, KVH, D] written at
    slot_mapping [T] (page * 64 + offset; negative slots are skipped). fp8 pools hold each
    page's V block of a head transposed (`fp8_v_stored`)."""
    if kv.dtype != FP8_DTYPE:
        return _store_tokens(kv, kv_scales, torch.stack([k, v], dim=1), slot_mapping)
    logical = convert_v_blocks(kv, fp8_v_logical)
    logical, kv_scales = _store_tokens(logical, kv_scales, torch.stack([k, v], dim=1),
                                       slot_mapping)
    return convert_v_blocks(logical, fp8_v_stored), kv_scales


def convert_v_blocks(kv: torch.Tensor, convert) -> torch.Tensor:
    """A copy of kv [P, 64, 2, KVH, D] with each (page, head) V block [64, D] passed through
    `convert` (fp8_v_stored or fp8_v_logical)."""
    out = kv.clone()
    out[:, :, 1] = convert(kv[:, :, 1].movedim(1, 2)).movedim(2, 1)
    return out


def _store_tokens(kv, kv_scales, new, slot_mapping):
    """Copies of kv [num_pages, 64, *token] (and scales [num_pages, 64, *token[:-1]]) with
    new [T, *token] written at slot_mapping [T]; negative slots skipped, fp8 quantized."""
    kv, kv_scales = kv.clone(), None if kv_scales is None else kv_scales.clone()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    new = new[keep]
    flat = kv.view(-1, *kv.shape[2:])
    if kv_scales is None:
        flat[slots] = new.to(kv.dtype)
    else:
        values, scales = quantize_fp8(new)
        flat[slots] = values
        kv_scales.view(-1, *kv_scales.shape[2:])[slots] = scales
    return kv, kv_scales


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, math_dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(h), h) with h = x + residual rounded to x's dtype (h = x without one).

    x, residual [T, N]; weight [N]. The output is in math_dtype; h in x's dtype.
    """
    h = x if residual is None else (x.to(math_dtype) + residual.to(math_dtype)).to(x.dtype)
    hf = h.to(math_dtype)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(math_dtype) * normed, (None if residual is None else h)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, math_dtype: torch.dtype = torch.float32
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on the first rot_dim features of q [T, H, D] and k [T, KVH, D].

    cos/sin [max_pos, rot_dim] (each half repeated, as batchgen's RotaryEmbedding builds
    them); positions [T]. Returns rotated copies in math_dtype.
    """
    def rotate(x):
        rot_dim = cos.shape[-1]
        x = x.to(math_dtype)
        c = cos[positions.long()].to(math_dtype).unsqueeze(1)
        s = sin[positions.long()].to(math_dtype).unsqueeze(1)
        rot, rest = x[..., :rot_dim], x[..., rot_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat([rot * c + torch.cat([-x2, x1], dim=-1) * s, rest], dim=-1)
    return rotate(q), rotate(k)


def rmsnorm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, math_dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of weight * rmsnorm of every head of q [T, H, D] and k [T, KVH, D], all in
    math_dtype with no rounding between."""
    q_normed, _ = add_rmsnorm(q, None, q_weight, eps, math_dtype)
    k_normed, _ = add_rmsnorm(k, None, k_weight, eps, math_dtype)
    return rope(q_normed, k_normed, positions, cos, sin, math_dtype)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                  kv_scales: torch.Tensor | None, slot_mapping: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rotated q, kv, kv_scales) as RoPE in float32 rounded to q's dtype, then `store_kv` of
    the rotated k and v into copies of the pool."""
    q_rot, k_rot = rope(q, k, positions, cos, sin)
    kv, kv_scales = store_kv(kv, kv_scales, k_rot.to(k.dtype), v, slot_mapping)
    return q_rot.to(q.dtype), kv, kv_scales


def silu_and_mul(x: torch.Tensor, math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] in math_dtype."""
    gate, up = x.to(math_dtype).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                         kv_scales: torch.Tensor | None, page_table: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float,
                         math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache: one query row per sequence.

    q_nope [B, H, C] (W_UK absorbed); q_pe [B, H, R]; kv [num_pages, 64, 1, C + R], each token
    [latent | k_pe]; kv_scales [num_pages, 64, 1] or None; page_table [B, max_pages];
    context_lens [B]. Scores (q_nope . latent + q_pe . k_pe) * sm_scale over the sequence's
    keys, values the latents. Returns [B, H, C] in math_dtype.
    """
    latent = q_nope.shape[-1]
    out = torch.empty(q_nope.shape, dtype=math_dtype, device=q_nope.device)
    for b, ctx in enumerate(context_lens.tolist()):
        pages = page_table[b, : -(-ctx // PAGE_SIZE)].long()
        cache = kv[pages].to(math_dtype)  # [P, 64, 1, C+R]
        if kv_scales is not None:
            cache = cache * kv_scales[pages].to(math_dtype).unsqueeze(-1)
        cache = cache.reshape(-1, cache.shape[-1])[:ctx]  # [ctx, C+R]
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1).to(math_dtype)  # [H, C+R]
        probs = torch.softmax(q @ cache.T * sm_scale, dim=-1)  # [H, ctx]
        out[b] = probs @ cache[:, :latent]
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, silu_mul: bool = False,
                 math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] rows grouped by offsets [G] (group ends) times w[g]^T, w [E, N, K]; with
    silu_mul, silu(gate) * up of w[g] = [gate | up] -> [M, N / 2]. Rows past offsets[-1] are
    zero. Returns math_dtype."""
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = torch.zeros(x.shape[0], n, dtype=math_dtype, device=x.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        y = x[start:end].to(math_dtype) @ w[g].to(math_dtype).T
        out[start:end] = silu_and_mul(y, math_dtype) if silu_mul else y
        start = end
    return out


def quantize_fp8_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K / group]): scale = max(amax, 1e-12) / 448
    per row and group of columns, values x / scale rounded to nearest even."""
    tiles = x.float().reshape(x.shape[0], -1, group)
    amax = tiles.abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE on every device
    q = (tiles / scale.unsqueeze(-1)).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): scale = max(amax, 1e-12) / 448 per
    row, values x * (1 / scale) rounded to nearest even, the reciprocal an IEEE division (the
    row kernels divide once per row, not once per value; the result differs from x / scale
    only where a value sits within a float32 ulp of an e4m3 rounding tie)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE on every device
    return (xf * (torch.ones_like(scale) / scale)).to(FP8_DTYPE), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                          math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] times its block scales [..., N / bn, K / bk], in math_dtype."""
    full = scale.to(math_dtype).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.to(math_dtype) * full


def grouped_gemm_fp8(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     offsets: torch.Tensor, block: tuple[int, int] = (128, 128),
                     silu_mul: bool = False, math_dtype: torch.dtype = torch.float32):
    """`grouped_gemm` of the dequantized operands: x = xq * xs per (row, bk columns), w[g] per
    bn x bk block."""
    x = dequantize_fp8_blocks(xq, xs, (1, block[1]), math_dtype)
    return grouped_gemm(x, dequantize_fp8_blocks(w, w_scale, block, math_dtype), offsets,
                        silu_mul, math_dtype)


def deepseek_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                   top_k: int, norm_topk_prob: bool, routed_scaling_factor: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing from float32 logits [T, E] (models.moe.TopkRouter after its matmul):
    returns (weights [T, k] float32, ids [T, k] int64), ids in descending choice order."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    per_group = choice.view(logits.shape[0], n_group, -1)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1),
                                float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def store_mla_kv(kv: torch.Tensor, kv_scales: torch.Tensor | None, rows: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of an MLA layer kv [num_pages, 64, 1, W] (and scales [num_pages, 64, 1]) with
    rows [T, W] written at slot_mapping [T] (negative slots are skipped); fp8 pools get one
    scale per token."""
    return _store_tokens(kv, kv_scales, rows[:, None], slot_mapping)


def concat_prefix_pages(prefix_pages: torch.Tensor, prefix_num_pages: torch.Tensor,
                        row_group: torch.Tensor, page_table: torch.Tensor,
                        suffix_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's whole page list: its group's prefix pages (prefix_pages [G, P], the first
    prefix_num_pages[g] of row g) then its own pages (page_table [B, S]); row_group [B] holds
    -1 (or any value outside [0, G)) for rows in no group. Returns (page table [B, P + S]
    int32, context lengths [B] int32: prefix pages * 64 + suffix_lens)."""
    batch, groups = page_table.shape[0], prefix_pages.shape[0]
    table = torch.zeros(batch, prefix_pages.shape[1] + page_table.shape[1], dtype=torch.int32,
                        device=page_table.device)
    ctx = torch.empty(batch, dtype=torch.int32, device=page_table.device)
    for b, (g, own) in enumerate(zip(row_group.tolist(), suffix_lens.tolist())):
        n = int(prefix_num_pages[g]) if 0 <= g < groups else 0
        own_pages = -(-own // PAGE_SIZE)
        if n:
            table[b, :n] = prefix_pages[g, :n]
        table[b, n:n + own_pages] = page_table[b, :own_pages]
        ctx[b] = n * PAGE_SIZE + own
    return table, ctx


def shared_prefix_decode(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None,
                         prefix_pages: torch.Tensor, prefix_num_pages: torch.Tensor,
                         row_group: torch.Tensor, page_table: torch.Tensor,
                         suffix_lens: torch.Tensor, sm_scale: float,
                         sinks: torch.Tensor | None = None,
                         math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode attention (q [B, H, D], one token per row) over each row's group prefix pages
    followed by its own pages: `paged_attention` over `concat_prefix_pages`. Returns
    [B, H, D] in math_dtype."""
    table, ctx = concat_prefix_pages(prefix_pages, prefix_num_pages, row_group, page_table,
                                     suffix_lens)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, kv, kv_scales, cu, ctx, table, sm_scale, sinks=sinks,
                           math_dtype=math_dtype)
