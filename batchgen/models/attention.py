"""Paged attention, pure PyTorch: the reference every GPU kernel is tested against.

`paged_attention` writes this step's K/V into the pages, then attends each query row to the
KV of its own sequence read back through the page table, so prefill chunks, prefix caches
and decode tokens all take the same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.core import PAGE_SIZE
from batchgen.engine.forward_batch import ForwardBatch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_len: torch.Tensor, scale: float, window: int | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, K, KVH, D]; q_pos [B, Q] absolute positions; k_len [B]."""
    key_pos = torch.arange(k.shape[1], device=q.device)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]
    allowed &= key_pos[None, None, :] < k_len[:, None, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > q_pos[:, :, None] - window
    if sinks is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=allowed[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    heads, kv_heads = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    # A sink is an extra logit per head that takes probability mass but carries no value.
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    batch: ForwardBatch, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]. Stores k/v in the pool first.

    On CUDA the Triton kernels run (batchgen_kernels); elsewhere the reference below."""
    if q.is_cuda:
        return _triton_attention(q, k, v, layer, batch, scale, window, sinks)
    pool = batch.kv_pool
    pool.store(layer, batch.slot_mapping, torch.stack([k, v], dim=1))
    if batch.decode_only:
        return _decode(q, layer, batch, scale, window, sinks)
    out = torch.empty_like(q)
    start = 0
    # A whole prompt (no cached prefix) attends only to its own fresh K/V: causal SDPA on them
    # directly skips the page gather and the materialised mask.
    plain = window is None and sinks is None and not pool.layout.quantized
    for b, (q_len, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        if plain and q_len == ctx and q_len > 1:
            rows = slice(start, start + q_len)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
            start += q_len
            continue
        pages = batch.page_table[b, : -(-ctx // PAGE_SIZE)].long()
        kv = pool.gather(layer, pages)[:ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[None]
        rows = slice(start, start + q_len)
        out[rows] = _attend(q[rows][None], kv[None, :, 0], kv[None, :, 1], q_pos,
                            torch.tensor([ctx], device=q.device), scale, window, sinks)[0]
        start += q_len
    return out


def _decode(q, layer, batch, scale, window, sinks):
    """All sequences have one query token: gather their pages padded and attend at once."""
    kv = batch.kv_pool.gather(layer, batch.page_table.long())  # [B, P*PAGE, 2, KVH, D]
    ctx = batch.context_lens.long()
    out = _attend(q[:, None], kv[:, :, 0], kv[:, :, 1], (ctx - 1)[:, None], ctx, scale,
                  window, sinks)
    return out[:, 0]


def _triton_attention(q, k, v, layer, batch, scale, window, sinks):
    import batchgen_kernels as K

    kv, scales = batch.kv_pool.layer(layer)
    K.store_kv(k, v, kv, scales, batch.slot_mapping)
    if batch.decode_only:
        return K.paged_decode_attention(q, kv, scales, batch.page_table, batch.context_lens,
                                        scale, window=window, sinks=sinks)
    return K.paged_prefill_attention(q, kv, scales, batch.cu_seqlens_q, batch.context_lens,
                                     batch.page_table, scale, max(batch.q_lens), window=window,
                                     sinks=sinks)
