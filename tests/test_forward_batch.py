"""ForwardBatch.build packs prefill chunks and decode tokens: every per-token value against a
per-token loop over the same sequences."""

import torch
from hypothesis import given, settings, strategies as st

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch


@st.composite
def packed_sequences(draw):
    """(token ids, start, page table, samples) per sequence; tables hold exactly the pages
    the sequence's context needs, plus maybe spare ones."""
    count = draw(st.integers(1, 12))
    seqs = []
    for _ in range(count):
        start = draw(st.integers(0, 300))
        q_len = draw(st.integers(1, 200))
        pages = -(-(start + q_len) // PAGE_SIZE) + draw(st.integers(0, 2))
        table = draw(st.lists(st.integers(0, 10_000), min_size=pages, max_size=pages))
        ids = draw(st.lists(st.integers(0, 50_000), min_size=q_len, max_size=q_len))
        seqs.append((ids, start, table, draw(st.booleans())))
    return seqs


@settings(max_examples=200, deadline=None)
@given(packed_sequences())
def test_build_matches_a_per_token_loop(seqs):
    ids, starts, tables, samples = map(list, zip(*seqs))
    batch = ForwardBatch.build(ids, starts, tables, samples, None, torch.device("cpu"))
    rows = [(b, start + i) for b, (toks, start, _, _) in enumerate(seqs) for i in range(len(toks))]
    assert batch.input_ids.tolist() == [t for toks in ids for t in toks]
    assert batch.positions.tolist() == [p for _, p in rows]
    assert batch.slot_mapping.tolist() == [tables[b][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                                           for b, p in rows]
    ends = torch.tensor([len(t) for t in ids]).cumsum(0).tolist()
    assert batch.cu_seqlens_q.tolist() == [0] + ends
    assert batch.logits_indices.tolist() == [e - 1 for e, s in zip(ends, samples) if s]
    ctx = [s + len(t) for s, t in zip(starts, ids)]
    assert batch.context_lens.tolist() == ctx == batch.ctx_lens
    width = max(-(-c // PAGE_SIZE) for c in ctx)
    assert batch.page_table.shape == (len(seqs), width)
    for b, c in enumerate(ctx):
        used = -(-c // PAGE_SIZE)
        assert batch.page_table[b].tolist() == tables[b][:used] + [0] * (width - used)
    assert batch.cu_seqlens_q.dtype == batch.context_lens.dtype == batch.page_table.dtype \
        == torch.int32
    assert batch.positions.dtype == batch.slot_mapping.dtype == batch.input_ids.dtype \
        == torch.int64
