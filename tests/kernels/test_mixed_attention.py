"""The model's attention on a mixed step (prefill chunks and one-row sequences in one batch)
through the Triton kernels: one-row sequences go to the decode kernel, the rest to the prefill
kernel, and together they match the float64 reference whatever the rows' order."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import reference
from kernel_testing import DEVICES, assert_rel_close

import batchgen_kernels as K
from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.models.attention import _triton_attention

LAYERS, KV_HEADS, GROUP, DIM = 2, 2, 3, 32

# (cached prefix, query rows) per sequence. "decodes first" is the usual packing (admission
# order; one-row sequences are then a prefix of the rows, attended through views);
# "interleaved" also has a one-token prompt chunk after a prefix and takes the gather/scatter
# path.
ORDERS = {
    "decodes_first": [(0, 1), (64, 1), (129, 1), (0, 70), (64, 40)],
    "interleaved": [(0, 37), (199, 1), (70, 20), (5, 1), (64, 18)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["kv32", "kv8"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("window,with_sinks", [(None, False), (50, True)])
def test_mixed_step_attention_matches_reference(device, kv_dtype, order, window, with_sinks,
                                                monkeypatch):
    sequences = ORDERS[order]
    pages = [-(-(p + q) // PAGE_SIZE) for p, q in sequences]
    pool = KVPool(KVLayout(LAYERS, (2, KV_HEADS, DIM), kv_dtype, torch.float32), sum(pages) + 2,
                  device)
    ids = torch.randperm(pool.num_pages).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(ids[start:start + n])
        start += n
    layer, tokens = 1, sum(q for _, q in sequences)
    # The cached prefixes' KV, then this step's rows (stored by the attention call itself).
    prefix_slots = [t[i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE
                    for t, (p, _) in zip(tables, sequences) for i in range(p)]
    pool.store(layer, torch.tensor(prefix_slots, device=device),
               torch.randn(len(prefix_slots), 2, KV_HEADS, DIM, device=device))
    batch = ForwardBatch.build([[1] * q for _, q in sequences], [p for p, _ in sequences],
                               tables, [True] * len(sequences), pool, torch.device(device))
    q = torch.randn(tokens, KV_HEADS * GROUP, DIM, device=device)
    k, v = torch.randn(2, tokens, KV_HEADS, DIM, device=device)
    sinks = torch.randn(KV_HEADS * GROUP, device=device) if with_sinks else None
    decoded = []
    decode = K.paged_decode_attention
    monkeypatch.setattr(K, "paged_decode_attention",
                        lambda q, *a, **kw: decoded.append(len(q)) or decode(q, *a, **kw))

    out = _triton_attention(q, k, v, layer, batch, 0.2, window, sinks)

    assert decoded == [sum(1 for _, q_len in sequences if q_len == 1)]
    kv, scales = pool.layer(layer)
    ref = reference.paged_attention(q, kv, scales, batch.cu_seqlens_q, batch.context_lens,
                                    batch.page_table, 0.2, window, sinks,
                                    math_dtype=torch.float64)
    assert_rel_close(out, ref, 1e-4, "mixed step")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["kv32", "kv8"])
def test_mixed_step_with_rope_matches_rotating_first(device, kv_dtype):
    """Given the rotary embedding, the attention rotates q and k itself (one kernel with the
    store): the same output and pool as rotating first and attending the rotated rows."""
    from batchgen.models.layers import RotaryEmbedding

    sequences = ORDERS["interleaved"]
    pages = [-(-(p + q) // PAGE_SIZE) for p, q in sequences]
    tables, start = [], 0
    for n in pages:
        tables.append(list(range(start, start + n)))
        start += n
    layout = KVLayout(LAYERS, (2, KV_HEADS, DIM), kv_dtype, torch.float32)
    pools = [KVPool(layout, start + 1, device) for _ in range(2)]
    batches = [ForwardBatch.build([[1] * q for _, q in sequences], [p for p, _ in sequences],
                                  tables, [True] * len(sequences), pool, torch.device(device))
               for pool in pools]
    tokens = sum(q for _, q in sequences)
    q = torch.randn(tokens, KV_HEADS * GROUP, DIM, device=device)
    k, v = torch.randn(2, tokens, KV_HEADS, DIM, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    rope = RotaryEmbedding(inv_freq, 512).to(device)

    fused = _triton_attention(q, k, v, 1, batches[0], 0.2, None, None, rope=rope)
    q_rot, k_rot = K.apply_rope(q, k, batches[1].positions, rope.cos, rope.sin,
                                torch.empty_like(q), torch.empty_like(k))
    first = _triton_attention(q_rot, k_rot, v, 1, batches[1], 0.2, None, None)

    assert torch.equal(fused, first)
    assert torch.equal(pools[0].data, pools[1].data)
    if kv_dtype == torch.float8_e4m3fn:
        assert torch.equal(pools[0].scales, pools[1].scales)
