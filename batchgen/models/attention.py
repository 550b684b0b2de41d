"""Paged attention in pure PyTorch: the CPU path, and on CUDA the Triton kernels.

`paged_attention` writes this step's K/V into the pages, then attends each query row to the
KV of its own sequence read back through the page table. On CUDA, the one-row sequences of a
batch (its decode rows) with prefix groups (`ForwardBatch.prefix_groups`) read each group's
shared prefix pages once (`shared_prefix_decode`) in layers without a sliding window.
`_attend` is the plain reference (gather padded, explicit mask, softmax); the CPU fast paths
next to it are checked against it in tests/test_cpu_attention.py:
- a whole prompt attends to its own fresh K/V with SDPA's causal flash kernel (no gather);
- a decode-only batch attends page by page (`_decode`): no padding to the longest sequence,
  no mask tensor, no GQA expansion, a softmax combined across each sequence's pages.
`dense_attention` serves dense batches (embeddings): right-padded [B, L] prompts, causal SDPA
on their own K/V, no pool at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch


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


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                    rope=None) -> torch.Tensor:
    """Attention of a dense batch: q [B*L, H, D], k/v [B*L, KVH, D] -> [B*L, H, D], each
    sequence's L rows causally over its own rows as [B, H, L, D] tensors (no KV pool, no
    pages, nothing kept). Padding rows follow a sequence's tokens, so causal attention keeps
    them from every real row; their own outputs are garbage that the caller never reads.
    Plain attention is SDPA's causal kernel (flash on CUDA; GQA without repeating K/V); a
    sliding window or attention sinks take `_attend` with positions 0...L-1."""
    if rope is not None:
        q, k = rope(batch.positions, q, k)
    seqs, length = batch.dense.seqs, batch.dense.length
    q4, k4, v4 = (x.reshape(seqs, length, *x.shape[1:]) for x in (q, k, v))
    if window is None and sinks is None:
        out = F.scaled_dot_product_attention(q4.transpose(1, 2), k4.transpose(1, 2),
                                             v4.transpose(1, 2), is_causal=True, scale=scale,
                                             enable_gqa=True).transpose(1, 2)
    else:
        q_pos = torch.arange(length, device=q.device)[None].expand(seqs, -1)
        k_len = torch.full((seqs,), length, device=q.device)
        out = _attend(q4, k4, v4, q_pos, k_len, scale, window, sinks)
    return out.reshape(q.shape)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    batch: ForwardBatch, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None, rope=None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]. Stores k/v in the pool first.

    `rope` (a RotaryEmbedding) rotates q and k by `batch.positions` first; on CUDA in the
    same kernel as the store, so the rotated k never goes through memory.
    On CUDA the Triton kernels run (batchgen_kernels); elsewhere the PyTorch paths below.
    A dense batch (`batch.dense`) stores nothing: `dense_attention`."""
    if batch.dense is not None:
        return dense_attention(q, k, v, batch, scale, window, sinks, rope)
    if q.is_cuda:
        return _triton_attention(q, k, v, layer, batch, scale, window, sinks, rope)
    if rope is not None:
        q, k = rope(batch.positions, q, k)
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
            # 4-D inputs: SDPA's CPU flash kernel takes only those (3-D falls back to the
            # math path, ~2.5x slower at 400 tokens).
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None], is_causal=True, scale=scale,
                enable_gqa=True)[0].transpose(0, 1)
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
    """All sequences have one query token: attend over the pages each one uses.

    Flash-decoding on CPU: scores page by page (a batched `[G, D] x [D, 64]` matmul per page
    and KV head, GQA as a reshape of q), then one softmax across each sequence's pages from
    per-page maxima. Work and copies follow the tokens actually cached, not batch x longest.
    """
    seqs, heads, dim = q.shape
    owner, pages, key_pos = _decode_pages(batch, window)
    kv = batch.kv_pool.gather_heads(layer, pages).float()  # [2, KVH, N, 64, D]
    kv_heads = kv.shape[1]
    qg = (q.float() * scale).view(seqs, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(qg[:, owner], kv[0].transpose(-1, -2))  # [KVH, N, G, 64]
    q_pos = (batch.context_lens.long() - 1)[owner][:, None]
    hidden = key_pos > q_pos
    if window is not None:
        hidden |= key_pos <= q_pos - window
    scores.masked_fill_(hidden[None, :, None], float("-inf"))
    out = _softmax_pages(scores, kv[1], owner, seqs, sinks)  # [KVH, B, G, D]
    return out.transpose(0, 1).reshape(seqs, heads, dim).to(q.dtype)


def _decode_pages(batch, window):
    """The pages decode attends to, as flat lists over the batch: owning sequence [N], page
    id [N] and the positions of its 64 slots [N, 64]. A window skips pages wholly before it."""
    table = batch.page_table.long()
    ctx = batch.context_lens.long()
    page = torch.arange(table.shape[1], device=table.device)[None].expand_as(table)
    used = page <= ((ctx - 1) // PAGE_SIZE)[:, None]
    if window is not None:
        used &= page >= ((ctx - window) // PAGE_SIZE)[:, None]
    owner = torch.arange(len(ctx), device=table.device)[:, None].expand_as(table)[used]
    offset = torch.arange(PAGE_SIZE, device=table.device)
    return owner, table[used], page[used][:, None] * PAGE_SIZE + offset


def _softmax_pages(scores, v, owner, seqs, sinks):
    """Softmax over each sequence's pages and the weighted sum of V: scores [KVH, N, G, 64],
    v [KVH, N, 64, D], owner [N] -> [KVH, B, G, D]. Page maxima are combined per sequence
    first, so the exponentials never overflow."""
    kv_heads, _, group, _ = scores.shape
    shape = (kv_heads, seqs, group)
    # A sink is an extra logit per head that takes probability mass but carries no value:
    # it seeds the per-sequence maximum and the denominator.
    sink = None if sinks is None else sinks.float().view(kv_heads, 1, group)
    device = scores.device
    top = (torch.full(shape, float("-inf"), device=device) if sink is None
           else sink.expand(shape).clone())
    index = owner.view(1, -1, 1).expand(kv_heads, -1, group)
    top.scatter_reduce_(1, index, scores.amax(-1), "amax")
    probs = torch.exp(scores - top[:, owner, :, None])
    denom = torch.zeros(shape, device=device) if sink is None else torch.exp(sink - top)
    denom.index_add_(1, owner, probs.sum(-1))
    out = torch.zeros(*shape, v.shape[-1], device=device)
    out.index_add_(1, owner, torch.matmul(probs, v))
    return out / denom[..., None]


def _triton_attention(q, k, v, layer, batch, scale, window, sinks, rope=None):
    import batchgen_kernels as K

    kv, scales = batch.kv_pool.layer(layer)
    if rope is None:
        K.store_kv(k, v, kv, scales, batch.slot_mapping)
    else:
        q = K.rope_store_kv(q, k, v, batch.positions, rope.cos, rope.sin, kv, scales,
                            batch.slot_mapping)
    if batch.decode_only:
        return _decode_rows(q, kv, scales, batch, batch.page_table, batch.context_lens, scale,
                            window, sinks)
    # A mixed step's one-row sequences (decodes, mostly) go to the decode kernels: the prefill
    # kernel would read their KV once per query head, in 64-row tiles holding one real row.
    one_row = batch.one_row_part
    out = K.paged_prefill_attention(q, kv, scales, batch.cu_seqlens_q, batch.context_lens,
                                    batch.page_table, scale, max(batch.q_lens), window=window,
                                    sinks=sinks, skip_one_row=one_row is not None)
    if one_row is not None:
        rows, table, ctx = one_row
        out[rows] = _decode_rows(q[rows], kv, scales, batch, table, ctx, scale, window, sinks)
    return out


def _decode_rows(q, kv, scales, batch: ForwardBatch, table: torch.Tensor, ctx: torch.Tensor,
                 scale, window, sinks) -> torch.Tensor:
    """Attention of one-row sequences (`table`, `ctx`: theirs): each prefix group's shared
    pages read once where the batch has groups (`batch.prefix_groups`, over these rows) and
    the layer has no sliding window, else the plain paged decode."""
    import batchgen_kernels as K

    if batch.prefix_groups is not None and window is None:
        plan, own_table, own_lens = _shared_prefix_parts(batch, q.shape[1] // kv.shape[3],
                                                         table, ctx)
        return K.shared_prefix_decode(q, kv, scales, plan, own_table, own_lens, scale,
                                      sinks=sinks)
    return K.paged_decode_attention(q, kv, scales, table, ctx, scale, window=window,
                                    sinks=sinks)


def _shared_prefix_parts(batch: ForwardBatch, group_size: int, table: torch.Tensor,
                         ctx: torch.Tensor):
    """(plan, own page table, own context lengths) of the one-row sequences with page table
    `table` and context lengths `ctx` that the batch's prefix groups cover, made once per
    forward on the device: each grouped row's page table and context shifted past its group's
    prefix pages."""
    key = ("shared_prefix", group_size)
    if key not in batch.derived:
        import batchgen_kernels as K

        groups = batch.prefix_groups
        plan = K.plan_shared_prefix(groups.row_group, groups.prefix_pages,
                                    groups.prefix_num_pages, group_size)
        grouped = groups.row_group >= 0
        shift = torch.where(grouped, groups.prefix_num_pages[groups.row_group.long().clamp(min=0)],
                            torch.zeros_like(groups.row_group)).long()
        width = table.shape[1]
        index = (torch.arange(width, device=table.device)[None] + shift[:, None])
        own_table = table.gather(1, index.clamp(max=width - 1))
        own_lens = (ctx - shift * PAGE_SIZE).to(torch.int32)
        batch.derived[key] = (plan, own_table, own_lens)
    return batch.derived[key]
