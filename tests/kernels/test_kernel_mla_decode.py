"""mla_decode_attention against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import mla_decode_attention, reference
from kernel_testing import (DEVICES, PAGE_SIZE, TOLERANCE, assert_rel_close, make_paged_pool,
                            poisoned)


def make_latent_cache(ctx_lens: list[int], width: int, kv_dtype: torch.dtype, device: str):
    """An MLA pool: one shared "head" of latent + rope values per token."""
    return make_paged_pool(ctx_lens, (1, width), kv_dtype, device)


# (heads, latent, rope, num_splits, block_n): 20 heads leave a partial second head block;
# latent 40 / rope 8 are padded to the 64- and 16-wide blocks; splits 1 (the kernel finishes
# the softmax) and several (the merge), more splits than some sequences have tiles.
CASES = [
    (4, 64, 16, 1, 32),
    (20, 32, 16, 3, 16),
    (3, 40, 8, 2, 64),
    (16, 64, 32, 5, 32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,latent,rope,num_splits,block_n", CASES)
def test_mla_decode_matches_reference(device, dtype, fp8, heads, latent, rope, num_splits,
                                      block_n):
    ctx_lens = [1, 64, 65, int(torch.randint(2, 200, ()))]
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    kv, kv_scales, table = make_latent_cache(ctx_lens, latent + rope, kv_dtype, device)
    # q_pe as a strided view of a wider projection, like the model's split of q.
    q = torch.randn(len(ctx_lens), heads, latent + rope + 8, device=device).to(dtype)
    q_nope, q_pe = q[..., :latent], q[..., latent:latent + rope]
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = (latent + rope) ** -0.5

    out = poisoned((len(ctx_lens), heads, latent), dtype, device)
    mla_decode_attention(q_nope, q_pe, kv, kv_scales, table, context_lens, scale,
                         num_splits=num_splits, out=out, block_n=block_n)

    ref = reference.mla_decode_attention(q_nope, q_pe, kv, kv_scales, table, context_lens,
                                         scale, math_dtype=torch.float64)
    assert_rel_close(out, ref, TOLERANCE[dtype], "mla decode")


@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_rejects_mismatched_shapes(device):
    kv, _, table = make_latent_cache([5], 48, torch.float16, device)
    q_nope = torch.randn(1, 4, 32, device=device, dtype=torch.float16)
    q_pe = torch.randn(1, 4, 8, device=device, dtype=torch.float16)  # 32 + 8 != 48
    with pytest.raises(ValueError):
        mla_decode_attention(q_nope, q_pe, kv, None, table, table.new_tensor([5]), 1.0)


def _tiny_mla(dtype: torch.dtype):
    """One DeepSeek MLA layer with random weights (4 heads, latent 32, rope 16)."""
    from transformers import DeepseekV3Config

    from batchgen.models.mla import MlaRope, MLAttention

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                           qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                           max_position_embeddings=256, num_hidden_layers=1)
    attn = MLAttention(cfg, 0, MlaRope(cfg))
    for name, param in attn.named_parameters():
        param.data.normal_(0.0, 0.2) if "norm" not in name else param.data.fill_(1.0)
    return attn.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=["fp32", "bf16", "bf16-kv8"])
def test_mla_layer_kernel_path_matches_torch_path(device, dtype, kv_dtype):
    """The model's CUDA wiring (Triton store + absorbed weights around the kernel) against its
    PyTorch decode path, on the same pool; run here through the interpreter."""
    from types import SimpleNamespace

    from batchgen_kernels import store_mla_kv

    from batchgen.engine.kv_cache import KVLayout, KVPool

    attn = _tiny_mla(dtype).to(device)
    ctx_lens = [1, 64, 65, 130]
    pages = [-(-c // PAGE_SIZE) for c in ctx_lens]
    pool = KVPool(KVLayout(1, (1, 48), kv_dtype, dtype), sum(pages) + 2, device)
    twin = KVPool(pool.layout, pool.num_pages, device)
    order = torch.randperm(pool.num_pages)[: sum(pages)].tolist()
    table = torch.zeros(len(ctx_lens), max(pages), dtype=torch.int32)
    slots = []
    for b, (ctx, n) in enumerate(zip(ctx_lens, pages)):
        table[b, :n] = torch.tensor(order[:n])
        order = order[n:]
        slots += [int(table[b, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in range(ctx)]
    slots = torch.tensor(slots, device=device)
    rows = torch.randn(len(slots), 48, device=device).to(dtype)
    pool.store(0, slots, rows[:, None])
    store_mla_kv(rows, *twin.layer(0), slots)
    if pool.scales is None:
        assert torch.equal(pool.data.float(), twin.data.float()), "Triton store != KVPool.store"
    else:  # KVPool.store divides by a Python scalar: on CUDA a reciprocal, so a value on a
        # rounding boundary lands one e4m3 ulp (2^-3 relative) away at times (seen on the H200)
        torch.testing.assert_close(twin.gather(0, table.long().to(device)),
                                   pool.gather(0, table.long().to(device)), rtol=0.13, atol=1e-6)

    q_nope = torch.randn(len(ctx_lens), 4, 16, device=device).to(dtype)
    q_pe = torch.randn(len(ctx_lens), 4, 16, device=device).to(dtype)
    batch = SimpleNamespace(kv_pool=twin)
    table, context_lens = table.to(device), torch.tensor(ctx_lens, dtype=torch.int32,
                                                           device=device)
    with torch.inference_mode():
        got = attn._decode_triton(q_nope, q_pe, table, context_lens, batch)
        want = attn._decode_torch(q_nope, q_pe, table, context_lens, batch)
    assert got.shape == want.shape == (len(ctx_lens), 4, 24)
    assert_rel_close(got, want, 4 * TOLERANCE[dtype], "MLA layer decode")
