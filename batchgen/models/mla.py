"""Multi-head latent attention (DeepSeek-V2/V3/R1) on the paged KV cache, pure PyTorch.

Per token the cache holds only `[latent (kv_lora_rank) | k_pe (qk_rope_head_dim)]`, i.e.
KV token shape (1, C + R) = (1, 576) for R1: the latent after kv_a_layernorm and the shared,
already-rotated rope key. Shapes below: T packed tokens, H heads, dn = qk_nope_head_dim,
R = qk_rope_head_dim, dv = v_head_dim, C = kv_lora_rank, K keys of one sequence.

Two ways to attend, equal in exact arithmetic:
- naive (the reference): expand every cached latent through kv_b_proj into per-head
  K_nope [K, H, dn] and V [K, H, dv], then ordinary attention with q = [q_nope | q_pe].
- absorbed: fold W_UK into the query (q_lat = q_nope W_UK, [T, H, C]) and W_UV into the
  output, so attention runs over the latent itself: one shared "KV head" of width C + R.
  Decode (one query per sequence) uses it by default: it reads 576 values per cached token
  instead of H * (dn + R + dv). Long prefill chunks default to naive, which costs fewer FLOPs
  once many queries share the expanded keys.

On CUDA the cache rows are written by a Triton store (which skips the padding rows of CUDA
graphs) and absorbed decode rows run the paged Triton kernel `mla_decode_attention`
(batchgen_kernels), which walks each sequence's pages instead of gathering them; elsewhere
the PyTorch paths below run, and they stay the reference the kernels are tested against.
A whole prompt (no cached prefix) attends to its fresh rows directly, without a page gather,
when the pool stores them exactly (same dtype, not fp8), by causal SDPA without a mask tensor.
Nothing in a layer copies from the host: per-layer `torch.tensor(..., device=cuda)` calls
would each synchronise the stream.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch
from batchgen.models.fp8 import dense_weight
from batchgen.models.layers import (
    SINGLE,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    default_max_positions,
    rope_inv_freq,
    rope_parameters,
)
from batchgen.parallel import TensorParallel

LORA_NORM_EPS = 1e-6
"""q_a_layernorm / kv_a_layernorm use RMSNorm's default eps in HF and DeepSeek's reference,
not config.rms_norm_eps."""
IMPLS = ("naive", "absorb")


class MlaRope(nn.Module):
    """YaRN (or plain) rope over the R rope dims, shared by every layer.

    With `rope_interleave` (DeepSeek's checkpoints) the pairs are (x0, x1), (x2, x3), ... and
    the output is laid out [rotated evens | rotated odds], exactly as HF's
    `apply_rotary_pos_emb_interleave`; the cached k_pe keeps that layout, and since q_pe gets
    the same one, scores are unchanged. Otherwise rotate-half, as `RotaryEmbedding` does."""

    def __init__(self, cfg):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg, cfg.qk_rope_head_dim)
        self.table = RotaryEmbedding(inv_freq, default_max_positions(cfg, quiet=True), scaling)
        self.interleave = bool(getattr(cfg, "rope_interleave", True))

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor):
        """q_pe [T, H, R], k_pe [T, 1, R] -> both rotated."""
        if not self.interleave:
            return self.table(positions, q_pe, k_pe)
        half = q_pe.shape[-1] // 2
        cos = self.table.cos[positions, :half].unsqueeze(1).to(q_pe.dtype)
        sin = self.table.sin[positions, :half].unsqueeze(1).to(q_pe.dtype)
        return _rotate_interleaved(q_pe, cos, sin), _rotate_interleaved(k_pe, cos, sin)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def mla_softmax_scale(cfg) -> float:
    """1/sqrt(dn + R), times mscale^2 under YaRN with mscale_all_dim (DeepSeek's long-context
    temperature correction; HF `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    factor = params.get("factor") or 1.0
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """Tensor parallel by heads: q_b_proj / kv_b_proj rows and o_proj columns are split; the
    latent projection (and so the cached latent) is whole on every rank, shared by all heads."""

    def __init__(self, cfg, layer: int, rope: MlaRope, tp: TensorParallel = SINGLE):
        super().__init__()
        bias = bool(getattr(cfg, "attention_bias", False))
        self.layer = layer
        self.heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.dn, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.dv, self.latent = cfg.v_head_dim, cfg.kv_lora_rank
        q_out = self.heads * (self.dn + self.rope_dim)
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.latent + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent, self.heads * (self.dn + self.dv), bias=False)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.dv, cfg.hidden_size,
                                        bias=bias, tp=tp)
        self.rope = rope
        self.scale = mla_softmax_scale(cfg)
        self.prefill_impl = "naive"
        """Path for sequences with more than one query row in the step."""
        self.decode_impl = "absorb"
        """Path for sequences with one query row (decode)."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's latent + k_pe into the pool."""
        q = self._query(x).view(-1, self.heads, self.dn + self.rope_dim)
        q_nope, q_pe = q.split([self.dn, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rope(batch.positions, q_pe, k_pe[:, None])
        cache_rows = torch.cat([latent, k_pe[:, 0]], dim=-1)  # [T, C+R]
        self._store(cache_rows, batch)
        out = self._attend(q_nope, q_pe, cache_rows, batch)
        return self.o_proj(out.reshape(-1, self.heads * self.dv))

    def _store(self, rows: torch.Tensor, batch: ForwardBatch) -> None:
        pool = batch.kv_pool
        if rows.is_cuda:
            import batchgen_kernels as K

            kv, scales = pool.layer(self.layer)
            K.store_mla_kv(rows, kv, scales, batch.slot_mapping)
        else:
            pool.store(self.layer, batch.slot_mapping, rows[:, None])

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def _attend(self, q_nope, q_pe, fresh, batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, R] -> [T, H, dv], each row over its own sequence.
        `fresh` [T, C+R] are this step's cache rows (already stored)."""
        if batch.decode_only:
            return self._decode(q_nope, q_pe, batch.page_table, batch.context_lens, batch)
        out = q_nope.new_empty(q_nope.shape[0], self.heads, self.dv)
        # Decode rows of a mixed step go together, as in a decode-only step.
        one_row = batch.one_row_part
        if one_row is not None:
            rows, table, ctx = one_row
            out[rows] = self._decode(q_nope[rows], q_pe[rows], table, ctx, batch)
        pool = batch.kv_pool
        layout = pool.layout
        exact = not layout.quantized and layout.dtype == fresh.dtype == layout.compute_dtype
        attend = self._impl(self.prefill_impl)
        start = 0
        for b, (q_len, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
            rows = slice(start, start + q_len)
            start += q_len
            if q_len == 1:
                continue
            if exact and q_len == ctx:
                # A whole prompt: its keys are exactly its fresh rows, so plain causal
                # attention (no mask tensor: SDPA's flash kernels apply).
                cache, q_pos = fresh[rows], None
            else:
                pages = batch.page_table[b, : -(-ctx // PAGE_SIZE)].long()
                cache = pool.gather(self.layer, pages)[:ctx, 0]  # [K, C+R]
                q_pos = torch.arange(ctx - q_len, ctx, device=q_nope.device)[None]
            # The cache holds exactly this sequence's ctx keys: no key-length mask.
            out[rows] = attend(q_nope[rows][None], q_pe[rows][None], cache[None], q_pos,
                               None)[0]
        return out

    def _decode(self, q_nope, q_pe, page_table, context_lens, batch: ForwardBatch):
        """One query row per sequence: q_nope [B, H, dn], q_pe [B, H, R] -> [B, H, dv]."""
        if q_nope.is_cuda and self.decode_impl == "absorb":
            return self._decode_triton(q_nope, q_pe, page_table, context_lens, batch)
        return self._decode_torch(q_nope, q_pe, page_table, context_lens, batch)

    def _decode_torch(self, q_nope, q_pe, page_table, context_lens, batch: ForwardBatch):
        """All sequences at once, pages gathered and padded to the longest."""
        cache = batch.kv_pool.gather(self.layer, page_table.long())[:, :, 0]  # [B, P*64, C+R]
        ctx = context_lens.long()
        out = self._impl(self.decode_impl)(q_nope[:, None], q_pe[:, None], cache,
                                           (ctx - 1)[:, None], ctx)
        return out[:, 0]

    def _decode_triton(self, q_nope, q_pe, page_table, context_lens, batch: ForwardBatch):
        """The absorbed path with the paged kernel: no gather, no padding to the longest."""
        import batchgen_kernels as K

        w_uk, w_uv = self._absorbed_weights(q_nope.dtype)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        kv, scales = batch.kv_pool.layer(self.layer)
        out_lat = K.mla_decode_attention(q_lat, q_pe, kv, scales, page_table, context_lens,
                                         self.scale)
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, dn, C] and W_UV [H, dv, C]."""
        w = dense_weight(self.kv_b_proj, dtype).view(self.heads, self.dn + self.dv, self.latent)
        return w[:, : self.dn], w[:, self.dn:]

    def _impl(self, name: str):
        assert name in IMPLS, f"MLA path {name!r} is not one of {IMPLS}"
        return self.attend_naive if name == "naive" else self.attend_absorbed

    def attend_naive(self, q_nope, q_pe, cache, q_pos, k_len) -> torch.Tensor:
        """q_nope [B, Q, H, dn], q_pe [B, Q, H, R], cache [B, K, C+R] -> [B, Q, H, dv]; q_pos
        [B, Q] and k_len [B] as `_masked_attention` takes them (None: whole prompts / all keys)."""
        latent, k_pe = cache.to(q_nope.dtype).split([self.latent, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(*latent.shape[:2], self.heads, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return _masked_attention(q, k, v, q_pos, k_len, self.scale)

    def attend_absorbed(self, q_nope, q_pe, cache, q_pos, k_len) -> torch.Tensor:
        """Same contract as `attend_naive`, attending over the latent directly."""
        w_uk, w_uv = self._absorbed_weights(q_nope.dtype)  # [H, dn, C], [H, dv, C]
        q_lat = torch.einsum("bqhd,hdc->bqhc", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, Q, H, C+R]
        kv = cache.to(q.dtype)[:, :, None]  # one shared head: keys [latent | k_pe], values latent
        out_lat = _masked_attention(q, kv, kv[..., : self.latent], q_pos, k_len, self.scale)
        return torch.einsum("bqhc,hvc->bqhv", out_lat, w_uv)


def _masked_attention(q, k, v, q_pos, k_len, scale) -> torch.Tensor:
    """Causal attention with per-sequence lengths: q [B, Q, H, D], k [B, K, KH, D],
    v [B, K, KH, Dv] (KH divides H), q_pos [B, Q] absolute positions, k_len [B] -> [B, Q, H, Dv].
    q_pos None: whole prompts (query i is key i), plain causal attention without a mask tensor;
    k_len None: every key of k is valid."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = k.shape[1] != q.shape[1]
    if q_pos is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    key_pos = torch.arange(k.shape[2], device=q.device)[None, None, :]
    allowed = key_pos <= q_pos[:, :, None]
    if k_len is not None:
        allowed = allowed & (key_pos < k_len[:, None, None])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                         enable_gqa=gqa)
    return out.transpose(1, 2)
