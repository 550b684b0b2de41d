"""Time shared-prefix (cascade) decode attention against the plain paged decode kernel.

Usage: python benchmarks/shared_prefix_bench.py [--batch 256] [--prefix-len 2000]
       [--own-len 200] [--groups 1,4] [--kv bf16,fp8] [--prefix-splits auto,1,2,4]
       [--tiles 64:4:2,128:8:2]
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16 q). Each row's
context is a prompt of prefix-len tokens, the first prefix-len // 64 pages of it shared by its
group (rows are dealt to groups in turn), then own-len tokens of its own. One table row per
case, median times (triton.testing.do_bench of a CUDA graph's replay, as the engine runs decode)
of one layer's decode attention:
  plain private  the paged decode kernel, every row holding a private copy of the prompt
                 (no prefix caching);
  plain shared   the paged decode kernel over page tables that point at the shared pages
                 (prefix caching without the cascade kernel: repeated reads hit L2 at best);
  cascade        shared_prefix_decode with the step's plan built beforehand (built once per
                 step and used by every layer);
  plan           plan_shared_prefix alone.
Before timing, the cascade output is checked against the plain kernel (max relative error).
Not a test: it needs a GPU. Runs from a plain checkout: it imports the kernels from the
kernels/ folder beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import pathlib
import sys

import torch
from triton.testing import do_bench

PAGE = 64
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def import_kernels():
    """This checkout's kernels/ folder as `batchgen_kernels` (whatever copy is installed): the
    bench measures the code beside it, and runs from a plain checkout."""
    folder = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "batchgen_kernels"
    spec = importlib.util.spec_from_file_location(
        "batchgen_kernels", folder / "__init__.py", submodule_search_locations=[str(folder)])
    kernels = importlib.util.module_from_spec(spec)
    sys.modules["batchgen_kernels"] = kernels
    spec.loader.exec_module(kernels)
    return kernels


def pool(num_pages: int, kv_dtype: torch.dtype):
    """A layer view [pages, 64, 2, KVH, D] (and fp8 scales [pages, 64, 2, KVH] strided as the
    engine stores them: a page's slots innermost)."""
    data = torch.randn(num_pages, 1, PAGE, 2, KV_HEADS, HEAD_DIM, device="cuda").to(kv_dtype)
    if kv_dtype != FP8:
        return data[:, 0], None
    storage = torch.rand(num_pages, 1, 2, KV_HEADS, PAGE, device="cuda") * 0.01
    return data[:, 0], storage.movedim(-1, 2)[:, 0]


def timed(fn) -> float:
    """Median milliseconds of `fn` replayed from a CUDA graph (as the engine runs decode
    steps): the GPU's time, free of Python launch overhead."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay)


def case(K, batch: int, prefix_len: int, own_len: int, groups: int, kv_dtype: torch.dtype,
         prefix_splits: int | None):
    prefix_pages = prefix_len // PAGE
    own = prefix_len - prefix_pages * PAGE + own_len
    own_pages = -(-own // PAGE)
    ctx = prefix_pages * PAGE + own
    # Private copies: batch * (prefix + own) pages; shared: groups * prefix + batch * own.
    total_pages = batch * (prefix_pages + own_pages)
    kv, scales = pool(total_pages, kv_dtype)
    ids = torch.randperm(total_pages, device="cuda", dtype=torch.int32)
    private = ids.view(batch, prefix_pages + own_pages)
    own_table = private[:, prefix_pages:].contiguous()
    prefix_table = private[:groups, :prefix_pages].contiguous()  # group g: row g's prompt pages
    row_group = (torch.arange(batch, device="cuda") % groups).to(torch.int32)
    shared = torch.cat([prefix_table[row_group.long()], own_table], dim=1)
    prefix_num = torch.full((groups,), prefix_pages, dtype=torch.int32, device="cuda")
    suffix_lens = torch.full((batch,), own, dtype=torch.int32, device="cuda")
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    scale = HEAD_DIM ** -0.5

    def plan():
        return K.plan_shared_prefix(row_group, prefix_table, prefix_num, HEADS // KV_HEADS)

    step_plan = plan()
    def cascade_step():
        return K.shared_prefix_decode(q, kv, scales, step_plan, own_table, suffix_lens, scale,
                                      num_prefix_splits=prefix_splits)

    cascade = cascade_step()
    plain = K.paged_decode_attention(q, kv, scales, shared, ctx_lens, scale)
    error = ((cascade.float() - plain.float()).abs().max() / plain.float().abs().max()).item()
    times = {
        "plain private": timed(lambda: K.paged_decode_attention(q, kv, scales, private,
                                                                ctx_lens, scale)),
        "plain shared": timed(lambda: K.paged_decode_attention(q, kv, scales, shared,
                                                               ctx_lens, scale)),
        "cascade": timed(cascade_step),
        "plan": timed(plan),
    }
    return times, error, ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--own-len", type=int, default=200)
    parser.add_argument("--groups", default="1,4", help="comma-separated group counts")
    parser.add_argument("--kv", default="bf16,fp8", help="KV dtypes: bf16, fp8")
    parser.add_argument("--prefix-splits", default="auto",
                        help="comma-separated num_prefix_splits values (auto: the launcher's)")
    parser.add_argument("--tiles", default="",
                        help="comma-separated QUERIES:WARPS:STAGES of the prefix kernel's tiles "
                             "to compare (default: the kernel's own TILE_QUERIES/PREFIX_LAUNCH)")
    args = parser.parse_args()
    K = import_kernels()
    if args.tiles:
        for tile in args.tiles.split(","):
            queries, warps, stages = map(int, tile.split(":"))
            kernel = sys.modules["batchgen_kernels.shared_prefix_attention"]
            kernel.TILE_QUERIES = queries
            kernel.PREFIX_LAUNCH = {"num_warps": warps, "num_stages": stages}
            print(f"prefix tiles of {queries} query vectors, {warps} warps, {stages} stages:")
            table(K, args)
        return
    table(K, args)


def table(K, args) -> None:
    print(f"B={args.batch} prefix={args.prefix_len} (whole pages shared) own={args.own_len} "
          f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM}; times in microseconds")
    print(f"{'kv':>4} {'groups':>6} {'splits':>6} {'plain private':>13} {'plain shared':>12} "
          f"{'cascade':>8} {'plan':>6} {'vs private':>10} {'vs shared':>9} {'max rel err':>11}")
    for kv_name in args.kv.split(","):
        kv_dtype = {"bf16": BF16, "fp8": FP8}[kv_name]
        for groups, splits in itertools.product(
                [int(g) for g in args.groups.split(",")], args.prefix_splits.split(",")):
            t, error, _ = case(K, args.batch, args.prefix_len, args.own_len, groups, kv_dtype,
                               None if splits == "auto" else int(splits))
            us = {name: ms * 1000 for name, ms in t.items()}
            print(f"{kv_name:>4} {groups:>6} {splits:>6} {us['plain private']:>13.1f} "
                  f"{us['plain shared']:>12.1f} {us['cascade']:>8.1f} {us['plan']:>6.1f} "
                  f"{us['plain private'] / us['cascade']:>9.2f}x "
                  f"{us['plain shared'] / us['cascade']:>8.2f}x {error:>11.2e}")


if __name__ == "__main__":
    main()
