"""The model's decode attention with prefix groups (rows sharing their first pages read them
once, `kernels/shared_prefix_attention.py`) equals the plain paged decode of the same batch,
whether the groups come from a decode burst's plan (`DecodeBurst`) or a graph-sized buffer
(groups padded with unused ones, prefixes cut short)."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import reference
from kernel_testing import DEVICES, assert_rel_close

import batchgen_kernels as K
from batchgen.core import PAGE_SIZE
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.forward_batch import ForwardBatch, PrefixGroups
from batchgen.models.attention import _triton_attention
from batchgen.sched.decode_groups import MAX_GROUPS

LAYERS, KV_HEADS, GROUP, DIM = 2, 2, 2, 32


def grouped_batch(device, kv_dtype, contexts, groups, prefix_pages):
    """Rows with `contexts` keys; rows of group g (groups[b] == g) start with the same
    `prefix_pages[g]` pages, then pages of their own."""
    own = [-(-c // PAGE_SIZE) - (prefix_pages[g] if g >= 0 else 0)
           for c, g in zip(contexts, groups)]
    total = sum(prefix_pages) + sum(own) + 1
    pool = KVPool(KVLayout(LAYERS, (2, KV_HEADS, DIM), kv_dtype, torch.float32), total, device)
    ids = torch.randperm(total).tolist()
    shared = []
    for n in prefix_pages:
        shared.append(ids[:n])
        ids = ids[n:]
    tables = []
    for g, n in zip(groups, own):
        tables.append((shared[g] if g >= 0 else []) + ids[:n])
        ids = ids[n:]
    layer = 1
    pool.store(layer, torch.arange(total * PAGE_SIZE, device=device),
               torch.randn(total * PAGE_SIZE, 2, KV_HEADS, DIM, device=device))
    batch = ForwardBatch.build([[1]] * len(contexts), [c - 1 for c in contexts], tables,
                               [True] * len(contexts), pool, torch.device(device))
    return pool, batch, shared, layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["kv32", "kv8"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "graph_buffers"])
def test_grouped_decode_equals_plain_decode(device, kv_dtype, with_sinks, padded):
    contexts = [200, 130, 300, 65, 150, 64 * 3 + 1]
    groups = [0, 1, 0, -1, 1, 0]
    prefix_pages = [3, 2]
    pool, batch, shared, layer = grouped_batch(device, kv_dtype, contexts, groups, prefix_pages)
    width = 5 if padded else max(prefix_pages)
    count = MAX_GROUPS if padded else len(prefix_pages)
    table = torch.zeros(count, width, dtype=torch.int32)
    for g, pages in enumerate(shared):
        table[g, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    counts = torch.tensor(prefix_pages + [0] * (count - len(prefix_pages)), dtype=torch.int32)
    batch.prefix_groups = PrefixGroups(torch.tensor(groups, dtype=torch.int32, device=device),
                                       table.to(device), counts.to(device))
    rows = len(contexts)
    q = torch.randn(rows, KV_HEADS * GROUP, DIM, device=device)
    kv, scales = pool.layer(layer)
    # The step's K/V go to each row's last slot, which holds random KV already: store the same.
    k, v = pool.gather(layer, batch.page_table.long().view(-1)).view(
        rows, -1, 2, KV_HEADS, DIM)[torch.arange(rows), torch.tensor(contexts) - 1].unbind(1)
    sinks = torch.randn(KV_HEADS * GROUP, device=device) if with_sinks else None
    out, cascade_rows = attend_watching_the_cascade(q, k, v, layer, batch, sinks)
    assert cascade_rows == [rows]
    ref = reference.paged_attention(q, kv, scales, batch.cu_seqlens_q, batch.context_lens,
                                    batch.page_table, 0.3, None, sinks,
                                    math_dtype=torch.float64)
    assert_rel_close(out, ref, 1e-4 if kv_dtype == torch.float32 else 2e-2, "grouped decode")


def attend_watching_the_cascade(q, k, v, layer, batch, sinks):
    """The model's attention of `batch` (scale 0.3, no window), and the row count of each call
    it made to the shared-prefix kernel."""
    rows = []
    cascade = K.shared_prefix_decode

    def spy(*args, **kwargs):
        rows.append(args[0].shape[0])
        return cascade(*args, **kwargs)

    K.shared_prefix_decode = spy
    try:
        out = _triton_attention(q, k.contiguous(), v.contiguous(), layer, batch, 0.3, None,
                                sinks)
    finally:
        K.shared_prefix_decode = cascade
    return out, rows


@pytest.mark.parametrize("device", DEVICES)
def test_window_layers_keep_the_plain_kernel(device, monkeypatch):
    """A sliding-window layer ignores the groups (the shared kernel has no window)."""
    pool, batch, shared, layer = grouped_batch(device, torch.float32, [200, 190], [0, 0], [2])
    batch.prefix_groups = PrefixGroups(
        torch.zeros(2, dtype=torch.int32, device=device),
        torch.tensor([shared[0]], dtype=torch.int32, device=device),
        torch.tensor([2], dtype=torch.int32, device=device))
    monkeypatch.setattr(K, "shared_prefix_decode", lambda *a, **k: pytest.fail("used"))
    q = torch.randn(2, KV_HEADS * GROUP, DIM, device=device)
    k, v = torch.randn(2, 2, KV_HEADS, DIM, device=device)
    out = _triton_attention(q, k, v, layer, batch, 0.3, 100, None)
    assert out.shape == q.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["kv32", "kv8"])
@pytest.mark.parametrize("prefill_first", [False, True], ids=["decode_first", "prefill_first"])
def test_a_mixed_steps_decode_rows_read_their_groups_prefix_once(device, kv_dtype,
                                                                 prefill_first):
    """In a mixed batch (prompt chunks beside decode rows) the decode rows' groups cover
    `one_row_part`'s rows: the cascade serves them and the batch equals the plain attention."""
    contexts, groups, prefix_pages = [200, 130, 300, 150], [0, 1, 0, 1], [3, 2]
    pool, decode, shared, layer = grouped_batch(device, kv_dtype, contexts, groups,
                                                prefix_pages)
    tables = [t[:-(-c // PAGE_SIZE)] for t, c in zip(decode.page_table.tolist(), contexts)]
    # A prompt chunk of 40 tokens after 100 cached ones, on pages of group 0's prefix and
    # two pages of the decode rows' (their contents are random KV either way).
    prompt = ([[3] * 40], [100], [shared[0][:2] + tables[3][-1:]], [True])
    ids, starts = [[1]] * 4, [c - 1 for c in contexts]
    parts = [prompt, (ids, starts, tables, [True] * 4)]
    if not prefill_first:
        parts.reverse()
    batch = ForwardBatch.build(*[a + b for a, b in zip(*parts)], pool, torch.device(device))
    table = torch.zeros(len(prefix_pages), max(prefix_pages), dtype=torch.int32)
    for g, pages in enumerate(shared):
        table[g, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    batch.prefix_groups = PrefixGroups(torch.tensor(groups, dtype=torch.int32, device=device),
                                       table.to(device),
                                       torch.tensor(prefix_pages, dtype=torch.int32,
                                                    device=device))
    assert batch.one_row_part is not None and not batch.decode_only
    total = pool.num_pages
    flat = pool.gather(layer, torch.arange(total, device=device)).view(-1, 2, KV_HEADS, DIM)
    k, v = flat[batch.slot_mapping].unbind(1)
    q = torch.randn(batch.slot_mapping.shape[0], KV_HEADS * GROUP, DIM, device=device)
    out, cascade_rows = attend_watching_the_cascade(q, k, v, layer, batch, None)
    assert cascade_rows == [4]
    kv, scales = pool.layer(layer)
    ref = reference.paged_attention(q, kv, scales, batch.cu_seqlens_q, batch.context_lens,
                                    batch.page_table, 0.3, None, None,
                                    math_dtype=torch.float64)
    assert_rel_close(out, ref, 1e-4 if kv_dtype == torch.float32 else 2e-2, "mixed grouped")
