"""The CPU fast paths of batchgen.models.attention against its plain reference `_attend`
(padded gather + explicit mask), and KVPool.gather_heads against KVPool.gather."""

import pytest
import torch

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.models.attention import _attend, paged_attention

LAYERS, KV_HEADS, DIM = 3, 2, 16


def filled_pool(kv_dtype, pages, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(KVLayout(LAYERS, (2, KV_HEADS, DIM), kv_dtype, torch.float32), pages, "cpu")
    for layer in range(LAYERS):
        kv = torch.randn(pages * PAGE_SIZE, 2, KV_HEADS, DIM, generator=gen)
        pool.store(layer, torch.arange(pages * PAGE_SIZE), kv)
    return pool


def decode_batch(pool, ctx_lens, seed=0):
    """One decode token per sequence, each on its own shuffled pages (the fresh token's KV is
    already in the pool, so paged_attention re-stores what is there)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(pool.num_pages, generator=gen).tolist()
    tables, start = [], 0
    for ctx in ctx_lens:
        count = -(-ctx // PAGE_SIZE)
        tables.append(order[start:start + count])
        start += count
    batch = ForwardBatch.build([[1]] * len(ctx_lens), [c - 1 for c in ctx_lens], tables,
                               [True] * len(ctx_lens), pool, torch.device("cpu"))
    return batch


def reference_decode(q, layer, batch, scale, window, sinks):
    kv = batch.kv_pool.gather(layer, batch.page_table.long())
    ctx = batch.context_lens.long()
    return _attend(q[:, None], kv[:, :, 0], kv[:, :, 1], (ctx - 1)[:, None], ctx, scale,
                   window, sinks)[:, 0]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_matches_reference(kv_dtype, group, window, with_sinks):
    ctx_lens = [1, 63, 64, 65, 130, 200, 7]
    pool = filled_pool(kv_dtype, sum(-(-c // PAGE_SIZE) for c in ctx_lens) + 2)
    batch = decode_batch(pool, ctx_lens)
    gen = torch.Generator().manual_seed(1)
    heads = KV_HEADS * group
    q = torch.randn(len(ctx_lens), heads, DIM, generator=gen)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    layer = 1
    slots = batch.slot_mapping
    k, v = (pool.gather(layer, slots // PAGE_SIZE)  # the fresh tokens' own KV, re-stored
            .view(len(ctx_lens), PAGE_SIZE, 2, KV_HEADS, DIM)[torch.arange(len(ctx_lens)),
                                                                slots % PAGE_SIZE].unbind(1))
    expected = reference_decode(q, layer, batch, 0.25, window, sinks)
    got = paged_attention(q, k, v, layer, batch, 0.25, window=window, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_whole_prompt_prefill_matches_reference():
    gen = torch.Generator().manual_seed(2)
    lens = [70, 1, 33]
    pool = KVPool(KVLayout(1, (2, KV_HEADS, DIM), torch.float32, torch.float32), 4, "cpu")
    batch = ForwardBatch.build([[1] * n for n in lens], [0] * len(lens), [[0, 1], [2], [3]],
                               [True] * len(lens), pool, torch.device("cpu"))
    total = sum(lens)
    q = torch.randn(total, 3 * KV_HEADS, DIM, generator=gen)
    k, v = torch.randn(2, total, KV_HEADS, DIM, generator=gen)
    got = paged_attention(q, k, v, 0, batch, 0.25)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        want = _attend(q[rows][None], k[rows][None], v[rows][None], torch.arange(n)[None],
                       torch.tensor([n]), 0.25, None, None)[0]
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_heads_is_gather_with_heads_first(kv_dtype):
    pool = filled_pool(kv_dtype, 6)
    pages = torch.tensor([4, 0, 5])
    heads_first = pool.gather_heads(2, pages).clone()
    assert heads_first.shape == (2, KV_HEADS, 3, PAGE_SIZE, DIM)
    plain = pool.gather(2, pages).view(3, PAGE_SIZE, 2, KV_HEADS, DIM)
    torch.testing.assert_close(heads_first, plain.permute(2, 3, 0, 1, 4), rtol=0, atol=0)
    # The scratch buffer is reused: a later, smaller gather must not leak older rows.
    again = pool.gather_heads(0, pages[:1])
    torch.testing.assert_close(again, pool.gather(0, pages[:1]).view(
        1, PAGE_SIZE, 2, KV_HEADS, DIM).permute(2, 3, 0, 1, 4), rtol=0, atol=0)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_dense_batch_matches_paged_whole_prompts(group, window, with_sinks):
    """A dense (right-padded, pool-less) batch gives each real row what the paged path gives
    the same prompts packed, rope included; padding rows change nothing real."""
    from batchgen.models.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    lens = [70, 1, 33]
    heads, length = KV_HEADS * group, max(lens)
    rope = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM), 256)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    dense = ForwardBatch.build_dense([[1] * n for n in lens], torch.device("cpu"))
    assert dense.kv_pool is None and dense.dense.seqs == 3 and dense.dense.length == length
    rows = len(lens) * length
    q = torch.randn(rows, heads, DIM, generator=gen)
    k, v = torch.randn(2, rows, KV_HEADS, DIM, generator=gen)
    got = paged_attention(q, k, v, 0, dense, 0.25, window=window, sinks=sinks, rope=rope)
    real = torch.cat([torch.arange(n) + b * length for b, n in enumerate(lens)])
    pool = KVPool(KVLayout(1, (2, KV_HEADS, DIM), torch.float32, torch.float32), 4, "cpu")
    paged = ForwardBatch.build([[1] * n for n in lens], [0] * len(lens), [[0, 1], [2], [3]],
                               [True] * len(lens), pool, torch.device("cpu"))
    expected = paged_attention(q[real], k[real], v[real], 0, paged, 0.25, window=window,
                               sinks=sinks, rope=rope)
    torch.testing.assert_close(got[real], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(dense.logits_indices, torch.tensor([69, length, 2 * length + 32]))
