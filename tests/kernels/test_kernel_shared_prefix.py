"""shared_prefix_decode (cascade decode attention) against the plain paged decode over the
concatenated pages: the float64 reference and the paged decode kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from batchgen_kernels import paged_decode_attention, reference
from batchgen_kernels import shared_prefix_attention as SP
from batchgen_kernels._common import PAGE_SIZE
from kernel_testing import DEVICES, TOLERANCE, assert_rel_close, make_paged_kv, poisoned


def shared_batch(prefix_pages: list[int], row_group: list[int], suffix_lens: list[int],
                 kv_heads: int, head_dim: int, kv_dtype: torch.dtype, device: str):
    """A pool holding each group's prefix (whole pages) and each row's own tokens, with the
    metadata shared_prefix_decode takes: (kv, kv_scales, prefix_table [G, P] int32,
    prefix_num_pages [G], row_group [B], page_table [B, S], suffix_lens [B])."""
    groups = len(prefix_pages)
    kv, kv_scales, table = make_paged_kv([n * PAGE_SIZE for n in prefix_pages] + suffix_lens,
                                         kv_heads, head_dim, kv_dtype, device)
    prefix_table = table[:groups, :max(1, max(prefix_pages))].contiguous()
    own_table = table[groups:, :max(1, -(-max(suffix_lens) // PAGE_SIZE))].contiguous()

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)
    return (kv, kv_scales, prefix_table, ints(prefix_pages), ints(row_group), own_table,
            ints(suffix_lens))


def run_both(q, batch, scale, sinks=None, num_splits=None, num_prefix_splits=None):
    """(shared_prefix_decode's output, the float64 reference, the paged decode kernel's output
    over the concatenated pages)."""
    kv, kv_scales, prefix_table, prefix_num, row_group, own_table, suffix_lens = batch
    group_size = q.shape[1] // kv.shape[3]
    plan = SP.plan_shared_prefix(row_group, prefix_table, prefix_num, group_size)
    out = poisoned(q.shape, q.dtype, q.device)
    SP.shared_prefix_decode(q, kv, kv_scales, plan, own_table, suffix_lens, scale, sinks=sinks,
                            num_splits=num_splits, num_prefix_splits=num_prefix_splits,
                            out=out)
    ref = reference.shared_prefix_decode(q, kv, kv_scales, prefix_table, prefix_num, row_group,
                                         own_table, suffix_lens, scale, sinks=sinks,
                                         math_dtype=torch.float64)
    table, ctx = reference.concat_prefix_pages(prefix_table, prefix_num, row_group, own_table,
                                               suffix_lens)
    plain = paged_decode_attention(q, kv, kv_scales, table, ctx, scale, sinks=sinks,
                                   num_splits=1)
    return out, ref, plain


# (heads, kv_heads, head_dim): GQA ratios 1, 4, 3 (padded to 4), 8 (with head_dim 64 the fp8
# V loads run along keys).
GQA = [(2, 2, 32), (8, 2, 32), (6, 2, 24), (8, 1, 64)]
# (prefix pages per group, each row's group, each row's own keys): groups of 1 to 5 rows,
# prefixes of 0, 1 and several pages, rows in no group, a group with no rows, own parts of one
# key, exactly a page, and none (the row's keys are all shared).
LAYOUTS = [
    ([2, 0, 1, 3], [0, 0, 0, -1, 2, 3, 3, 0, 1, -1, 0], [1, 70, 64, 130, 5, 1, 99, 0, 40, 2, 3]),
    ([1, 4], [-1, 1, 1, 1, 1, 1], [9, 1, 65, 128, 2, 0]),
    ([3, 2, 1], [-1, -1, 1], [17, 64, 33]),
]


# Each GQA ratio meets one or two layouts (every layout twice): the full product is slow under
# the interpreter and adds no path the pairs miss.
CASES = [(*GQA[0], 0), (*GQA[1], 0), (*GQA[1], 1), (*GQA[2], 2), (*GQA[3], 1), (*GQA[3], 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,layout", CASES)
def test_shared_prefix_matches_plain_decode(device, fp8, heads, kv_heads, head_dim, layout):
    prefix_pages, row_group, suffix_lens = LAYOUTS[layout]
    dtype = torch.bfloat16
    batch = shared_batch(prefix_pages, row_group, suffix_lens, kv_heads, head_dim,
                         torch.float8_e4m3fn if fp8 else dtype, device)
    q = torch.randn(len(row_group), heads, head_dim, device=device).to(dtype)
    out, ref, plain = run_both(q, batch, head_dim ** -0.5)
    assert_rel_close(out, ref, TOLERANCE[dtype], "shared prefix vs reference")
    assert_rel_close(out, plain.float(), 2 * TOLERANCE[dtype], "shared prefix vs paged decode")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits,num_prefix_splits", [(1, 3), (2, 2), (3, 1)])
def test_splits_and_sinks(device, dtype, num_splits, num_prefix_splits):
    batch = shared_batch([5, 2], [0, 1, 0, -1, 1], [150, 1, 64, 200, 129], 2, 32, dtype, device)
    q = torch.randn(5, 4, 32, device=device).to(dtype)
    sinks = torch.randn(4, device=device) * 2
    out, ref, plain = run_both(q, batch, 0.2, sinks, num_splits, num_prefix_splits)
    assert_rel_close(out, ref, TOLERANCE[dtype], "split shared prefix with sinks")
    assert_rel_close(out, plain.float(), 2 * TOLERANCE[dtype], "vs paged decode")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "kv8"])
def test_groups_span_several_tiles(device, fp8, monkeypatch):
    """With 16 query vectors per tile and 4 heads per KV head a tile holds 4 rows: groups of
    11 and 5 rows take 3 and 2 tiles, interleaved in the batch with rows in no group."""
    monkeypatch.setattr(SP, "TILE_QUERIES", 16)
    assert SP.rows_per_tile(4) == 4
    row_group = [0, 1, -1, 0, 0, 1, 0, 0, -1, 1, 0, 0, 0, 1, 0, 1, 0, 0]
    suffix_lens = [int(n) for n in torch.randint(1, 90, (len(row_group),))]
    dtype = torch.bfloat16
    batch = shared_batch([2, 1], row_group, suffix_lens, 2, 32,
                         torch.float8_e4m3fn if fp8 else dtype, device)
    q = torch.randn(len(row_group), 8, 32, device=device).to(dtype)
    out, ref, plain = run_both(q, batch, 0.15, num_prefix_splits=2)
    assert_rel_close(out, ref, TOLERANCE[dtype], "groups over several tiles")
    assert_rel_close(out, plain.float(), 2 * TOLERANCE[dtype], "vs paged decode")


@pytest.mark.parametrize("groups,max_rows,dtype", [
    (1, 40, torch.int32), (3, 600, torch.int64), (7, 40, torch.int32), (70, 600, torch.int32)])
@pytest.mark.parametrize("device", DEVICES)
def test_plan_covers_each_row_once_in_its_group(device, groups, max_rows, dtype):
    """Every row lands in exactly one tile of its group; 600 rows and 70 groups take the plan
    kernel through several row blocks and tile blocks."""
    rows = int(torch.randint(0, max_rows, ()))
    row_group = torch.randint(-1, groups + 1, (rows,), dtype=dtype)  # `groups`: none
    prefix_num = torch.randint(0, 4, (groups,), dtype=torch.int32)
    prefix_table = torch.randint(0, 100, (groups, 3), dtype=torch.int32)
    plan = SP.plan_shared_prefix(row_group.to(device), prefix_table.to(device),
                                 prefix_num.to(device), group_size=8)
    plan = dataclasses.replace(plan, **{name: getattr(plan, name).cpu() for name in (
        "prefix_num_pages", "member_rows", "tile_group", "tile_start", "tile_end")})
    assert plan.rows_per_tile == 8
    assert plan.tile_group.shape[0] == -(-rows // 8) + groups + 1  # fixed by the shapes
    assert plan.prefix_num_pages.tolist() == prefix_num.clamp_max(3).tolist() + [0]
    seen = []
    for g, start, end in zip(plan.tile_group.tolist(), plan.tile_start.tolist(),
                             plan.tile_end.tolist()):
        assert 0 <= end - start <= 8
        for row in plan.member_rows[start:end].tolist():
            expected = int(row_group[row]) if 0 <= row_group[row] < groups else groups
            assert g == expected, f"row {row} of group {expected} in a tile of group {g}"
            seen.append(row)
    assert sorted(seen) == list(range(rows))


@pytest.mark.parametrize("device", DEVICES)
def test_metadata_rewritten_in_place_gives_the_new_answer(device):
    """The buffers of one step, refilled with another step's metadata (as a replayed CUDA graph
    sees them), give that step's answer: nothing is cached from the first call."""
    first = shared_batch([2, 1], [0, 0, 1, -1], [3, 70, 1, 20], 2, 32, torch.bfloat16, device)
    second = shared_batch([1, 2], [1, -1, 0, 1], [64, 5, 90, 1], 2, 32, torch.bfloat16,
                          device)
    kv, scales, prefix_table, prefix_num, row_group, own_table, suffix_lens = first
    q = torch.randn(4, 4, 32, device=device).to(torch.bfloat16)
    out = poisoned(q.shape, q.dtype, device)

    def step():
        plan = SP.plan_shared_prefix(row_group, prefix_table, prefix_num, 2)
        SP.shared_prefix_decode(q, kv, scales, plan, own_table, suffix_lens, 0.2, out=out)

    step()
    assert_rel_close(out, run_both(q, first, 0.2)[1], TOLERANCE[torch.bfloat16], "first")
    kv.copy_(second[0])
    for buffer, new in zip(first[2:], second[2:]):
        buffer.copy_(new)
    step()
    assert_rel_close(out, run_both(q, second, 0.2)[1], TOLERANCE[torch.bfloat16], "second")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph_with_new_metadata():
    device = "cuda"
    first = shared_batch([2, 1], [0, 0, 1, -1], [3, 70, 1, 20], 2, 64, torch.float8_e4m3fn,
                         device)
    second = shared_batch([1, 2], [1, -1, 0, 1], [64, 5, 90, 1], 2, 64, torch.float8_e4m3fn,
                          device)
    kv, scales, prefix_table, prefix_num, row_group, own_table, suffix_lens = first
    q = torch.randn(4, 8, 64, device=device).to(torch.bfloat16)
    out = poisoned(q.shape, q.dtype, device)

    def step():
        plan = SP.plan_shared_prefix(row_group, prefix_table, prefix_num, 4)
        SP.shared_prefix_decode(q, kv, scales, plan, own_table, suffix_lens, 0.125, out=out)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for batch in (first, second):
        kv.copy_(batch[0])
        scales.copy_(batch[1])
        for buffer, new in zip(first[2:], batch[2:]):
            buffer.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, run_both(q, batch, 0.125)[1], TOLERANCE[torch.bfloat16], "graph")


def _valid_call(device):
    batch = shared_batch([1], [0, -1], [5, 9], 2, 32, torch.bfloat16, device)
    kv, scales, prefix_table, prefix_num, row_group, own_table, suffix_lens = batch
    q = torch.randn(2, 4, 32, device=device).to(torch.bfloat16)
    plan = SP.plan_shared_prefix(row_group, prefix_table, prefix_num, 2)
    return dict(q=q, kv=kv, kv_scales=scales, plan=plan, page_table=own_table,
                suffix_lens=suffix_lens, sm_scale=0.1)


BAD_CALLS = {
    "q not 3-d": lambda a: {"q": a["q"][0]},
    "head dim": lambda a: {"q": a["q"][..., :16]},
    "heads over kv heads": lambda a: {"q": a["q"][:, :3]},
    "q int": lambda a: {"q": a["q"].to(torch.int32)},
    "q strided": lambda a: {"q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)},
    "fp8 without scales": lambda a: {"kv": a["kv"].to(torch.float8_e4m3fn)},
    "scales for bf16": lambda a: {"kv_scales": torch.ones(a["kv"].shape[:4])},
    "page_table int64": lambda a: {"page_table": a["page_table"].long()},
    "page_table rows": lambda a: {"page_table": a["page_table"][:1]},
    "suffix_lens rows": lambda a: {"suffix_lens": a["suffix_lens"][:1]},
    "suffix_lens float": lambda a: {"suffix_lens": a["suffix_lens"].float()},
    "plan rows": lambda a: {"q": a["q"][:1], "page_table": a["page_table"][:1],
                            "suffix_lens": a["suffix_lens"][:1]},
    "plan ratio": lambda a: {"plan": SP.plan_shared_prefix(
        a["plan"].member_rows, a["plan"].prefix_pages, a["plan"].prefix_num_pages[:-1], 16)},
    "plan type": lambda a: {"plan": {}},
    "out dtype": lambda a: {"out": torch.empty_like(a["q"], dtype=torch.float32)},
    "sinks shape": lambda a: {"sinks": torch.zeros(3)},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_launcher_rejects_bad_inputs(device, case):
    args = _valid_call(device)
    args.update(BAD_CALLS[case](args))
    with pytest.raises((ValueError, TypeError)):
        SP.shared_prefix_decode(**args)


def test_plan_rejects_bad_metadata():
    table = torch.zeros(2, 3, dtype=torch.int32)
    rows = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="same G"):
        SP.plan_shared_prefix(rows, table, torch.zeros(3, dtype=torch.int32), 1)
    with pytest.raises(TypeError, match="prefix_pages"):
        SP.plan_shared_prefix(rows, table.long(), torch.zeros(2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="row_group"):
        SP.plan_shared_prefix(rows[None], table, torch.zeros(2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="contiguous"):
        SP.plan_shared_prefix(rows, table.t().contiguous().t(), torch.zeros(2, dtype=torch.int32),
                              1)
    with pytest.raises(ValueError, match="group_size"):
        SP.plan_shared_prefix(rows, table, torch.zeros(2, dtype=torch.int32), 0)
