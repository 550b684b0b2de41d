"""paged_prefill_attention against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from batchgen_kernels import paged_prefill_attention, reference
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, make_paged_kv, poisoned

# (cached prefix, query length) per sequence: a fresh prompt within one query block, a chunk
# after a prefix that ends mid-page, a decode token, a chunk that starts on a page boundary,
# and a prompt over three query blocks (its later blocks see whole pages unmasked first).
SEQUENCES = [(0, 37), (70, 20), (5, 1), (64, 18), (0, 150)]

# (heads, kv_heads, head_dim, window, sinks)
CASES = [
    (2, 2, 32, None, False),
    (4, 1, 32, 24, True),
    (6, 2, 24, None, True),
    (4, 2, 32, 50, False),
    (2, 1, 64, None, False),  # head_dim % 64 == 0: the fp8 V fast path
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,sinks", CASES)
def test_prefill_matches_reference(device, dtype, fp8, heads, kv_heads, head_dim, window, sinks):
    q_lens = [q for _, q in SEQUENCES]
    ctx_lens = [p + q for p, q in SEQUENCES]
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    kv, kv_scales, table = make_paged_kv(ctx_lens, kv_heads, head_dim, kv_dtype, device)
    q = torch.randn(sum(q_lens), heads, head_dim, device=device).to(dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    sink = torch.randn(heads, device=device) * 2 if sinks else None
    scale = head_dim ** -0.5

    out = poisoned(q.shape, dtype, device)
    paged_prefill_attention(q, kv, kv_scales, cu, context_lens, table, scale, max(q_lens),
                            window=window, sinks=sink, block_m=32, out=out)

    ref = reference.paged_attention(q, kv, kv_scales, cu, context_lens, table, scale, window,
                                    sink, math_dtype=torch.float64)
    assert_rel_close(out, ref, TOLERANCE[dtype], "prefill")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,sinks", CASES)
def test_prefill_row_blocks_split_groups(device, block_m, fp8, heads, kv_heads, head_dim,
                                        window, sinks):
    """A program's rows are (token, head of the group) pairs: block sizes that cut a token's
    group of heads in two (16 rows over groups of 3) or hold many tokens give the same result."""
    q_lens = [q for _, q in SEQUENCES]
    ctx_lens = [p + q for p, q in SEQUENCES]
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kv, kv_scales, table = make_paged_kv(ctx_lens, kv_heads, head_dim, kv_dtype, device)
    q = torch.randn(sum(q_lens), heads, head_dim, device=device).to(torch.bfloat16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    sink = torch.randn(heads, device=device) * 2 if sinks else None

    out = poisoned(q.shape, torch.bfloat16, device)
    paged_prefill_attention(q, kv, kv_scales, cu, context_lens, table, 0.3, max(q_lens),
                            window=window, sinks=sink, block_m=block_m, out=out)

    ref = reference.paged_attention(q, kv, kv_scales, cu, context_lens, table, 0.3, window,
                                    sink, math_dtype=torch.float64)
    assert_rel_close(out, ref, TOLERANCE[torch.bfloat16], "prefill")


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_rejects_bad_block(device):
    kv, _, table = make_paged_kv([5], 2, 32, torch.float16, device)
    q = torch.randn(5, 2, 32, device=device, dtype=torch.float16)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError):
        paged_prefill_attention(q, kv, None, cu, cu[1:], table, 1.0, 5, block_m=24)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
def test_prefill_skips_one_row_sequences_when_asked(device, fp8):
    """skip_one_row: the rows of one-row sequences stay as they were (the caller attends them
    with the decode kernel); every other row is attended as usual."""
    q_lens = [q for _, q in SEQUENCES]
    ctx_lens = [p + q for p, q in SEQUENCES]
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    kv, kv_scales, table = make_paged_kv(ctx_lens, 1, 32, kv_dtype, device)
    q = torch.randn(sum(q_lens), 2, 32, device=device)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)

    out = poisoned(q.shape, torch.float32, device)
    paged_prefill_attention(q, kv, kv_scales, cu, context_lens, table, 0.2, max(q_lens),
                            block_m=32, out=out, skip_one_row=True)

    ref = reference.paged_attention(q, kv, kv_scales, cu, context_lens, table, 0.2,
                                    math_dtype=torch.float64)
    one_row = torch.zeros(len(q), dtype=torch.bool)
    for b, q_len in enumerate(q_lens):
        if q_len == 1:
            one_row[cu[b].item()] = True
    assert one_row.any() and out[one_row.to(device)].isnan().all()
    keep = (~one_row).to(device)
    assert_rel_close(out[keep], ref.to(device)[keep], TOLERANCE[torch.float32], "prefill")
