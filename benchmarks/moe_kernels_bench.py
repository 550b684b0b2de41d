"""Time the MoE kernels at DeepSeek-V3 expert shapes on a CUDA device (H200 intended).

Usage: python benchmarks/moe_kernels_bench.py [--only bf16,fp8,route] [--tokens 64,256,1024]
       python benchmarks/moe_kernels_bench.py --sweep --tokens 64,8192   (fp8 launch settings)

Shapes: hidden 7168, moe_intermediate 2048, 256 routed experts, 8 per token (8 groups, 4
kept), routing drawn from random logits, so T tokens give M = 8T expert rows. Rows:
- bf16 gate_up / down: torch._grouped_mm (+ SiLU-and-mul for gate_up) vs the Triton
  grouped_gemm (SiLU fused). Decides expert_bank.GROUPED_GEMM_BACKEND.
- fp8 gate_up / down: Triton activation quantization + grouped_gemm_fp8 vs dequantizing the
  whole bank to bf16 then torch._grouped_mm (what FP8 experts cost without the kernel); the
  "bf16 ms" column repeats the bf16 torch time, i.e. with weights pre-dequantized at load.
- route: deepseek_route vs the torch ops of TopkRouter (after the router matmul).
Columns: median ms (triton.testing.do_bench), speed-up, the Triton side's TFLOP/s and weight
GB/s (bytes of the touched experts' weights over its time), and the relative L2 difference of
the two outputs (a sanity check: ~3e-3 for bf16, a few % for fp8 activation rounding).
Needs ~70 GB of GPU memory and a few minutes. Not a test.
"""

from __future__ import annotations

import argparse

import batchgen_kernels as K
import torch
import torch.nn.functional as F
from batchgen_kernels import reference
from triton.testing import do_bench

HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP = 7168, 2048, 256, 8, 8, 4
BLOCK = (128, 128)
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def random_bank(n: int, k: int) -> torch.Tensor:
    """bf16 [E, n, k] with std 0.02, filled one expert at a time (no float32 temporary)."""
    w = torch.empty(EXPERTS, n, k, dtype=BF16, device="cuda")
    for e in range(EXPERTS):
        w[e].normal_(0, 0.02)
    return w


def quantize_bank(w: torch.Tensor):
    """e4m3 copy [E, n, k] and its 128x128 block scales, one expert at a time."""
    from batchgen.models.fp8 import quantize_blocks

    q = torch.empty(w.shape, dtype=FP8, device="cuda")
    s = torch.empty(EXPERTS, w.shape[1] // BLOCK[0], w.shape[2] // BLOCK[1], device="cuda")
    for e in range(EXPERTS):
        q[e], s[e] = quantize_blocks(w[e], BLOCK)
    return q, s


def dequantize_bank(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    e, n, k = q.shape
    tiles = q.view(e, n // BLOCK[0], BLOCK[0], k // BLOCK[1], BLOCK[1]).to(BF16)
    return (tiles * s.to(BF16)[:, :, None, :, None]).view(e, n, k)


def routed_rows(tokens: int):
    """(h [8T, H] rows sorted by expert, offsets [E] int32, touched experts) from random
    routing, as RoutedExperts.dispatch builds them."""
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    bias = torch.randn(EXPERTS, device="cuda") * 0.1
    _, ids = reference.deepseek_route(logits, bias, N_GROUP, TOPK_GROUP, TOP_K, True, 2.5)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
    return x[order // TOP_K], counts.cumsum(0).to(torch.int32), int((counts > 0).sum())


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_pair(name, shape, ours, theirs, flops, weight_bytes, extra=None):
    out_ours, out_theirs = ours(), theirs()
    t_ours, t_theirs = do_bench(ours), do_bench(theirs)
    return (name, shape, t_ours, t_theirs, extra, flops / t_ours / 1e9,
            weight_bytes / t_ours / 1e6, rel_diff(out_ours, out_theirs))


def bench_bf16(banks, tokens: int) -> list:
    gate_up, down = banks["gate_up"], banks["down"]
    h, offs, touched = routed_rows(tokens)
    m = h.shape[0]
    act = torch_swiglu(torch._grouped_mm(h, gate_up.transpose(1, 2), offs=offs))
    shape = f"T={tokens} M={m} E={touched}"
    return [
        bench_pair("bf16 gate_up+silu", shape,
                   lambda: K.grouped_gemm(h, gate_up, offs, silu_mul=True),
                   lambda: torch_swiglu(torch._grouped_mm(h, gate_up.transpose(1, 2), offs=offs)),
                   2 * m * 2 * INTER * HIDDEN, touched * gate_up[0].nbytes),
        bench_pair("bf16 down", shape, lambda: K.grouped_gemm(act, down, offs),
                   lambda: torch._grouped_mm(act, down.transpose(1, 2), offs=offs),
                   2 * m * HIDDEN * INTER, touched * down[0].nbytes),
    ]


def bench_fp8(banks, tokens: int) -> list:
    h, offs, touched = routed_rows(tokens)
    m = h.shape[0]
    rows = []
    for proj, silu, flops in (("gate_up", True, 2 * m * 2 * INTER * HIDDEN),
                              ("down", False, 2 * m * HIDDEN * INTER)):
        q, s = banks[proj + "_fp8"]
        x = h if silu else torch.randn(m, INTER, device="cuda", dtype=BF16)
        finish = torch_swiglu if silu else (lambda y: y)

        def ours(x=x, q=q, s=s, silu=silu):
            return K.grouped_gemm_fp8(*K.quantize_fp8_groups(x, BLOCK[1]), q, s, offs, BLOCK,
                                      silu_mul=silu)

        def theirs(x=x, q=q, s=s, finish=finish):
            w = dequantize_bank(q, s)
            return finish(torch._grouped_mm(x, w.transpose(1, 2), offs=offs))

        def pre_dequantized(x=x, proj=proj, finish=finish):
            return finish(torch._grouped_mm(x, banks[proj].transpose(1, 2), offs=offs))
        rows.append(bench_pair(f"fp8 {proj}{'+silu' if silu else ''}",
                               f"T={tokens} M={m} E={touched}", ours, theirs, flops,
                               touched * q[0].nbytes, extra=do_bench(pre_dequantized)))
    return rows


def sweep_fp8(banks, tokens: int, keep: int = 4) -> list:
    """Every candidate launch setting of grouped_gemm_fp8 for both projections at T tokens;
    the `keep` fastest per projection, the default setting's row always among them. Small
    row tiles for decode-sized T, large ones for prefill-sized T."""
    h, offs, touched = routed_rows(tokens)
    m = h.shape[0]
    small = m < K.moe_gemm.LARGE_TILE_ROWS_PER_GROUP * touched
    grid = [(bm, bn, w, s) for bm in ((16, 32) if small else (64, 128)) for bn in (64, 128)
            for w in ((4,) if small else (4, 8)) for s in ((3, 4, 5) if small else (3, 4))]
    rows = []
    for proj, silu, flops in (("gate_up", True, 2 * m * 2 * INTER * HIDDEN),
                              ("down", False, 2 * m * HIDDEN * INTER)):
        q, s = banks[proj + "_fp8"]
        x = h if silu else torch.randn(m, INTER, device="cuda", dtype=BF16)
        xq, xs = K.quantize_fp8_groups(x, BLOCK[1])
        default = K.moe_gemm.fp8_tiles(m, offs.shape[0], silu)
        timed = []
        for tiles in [default] + [K.moe_gemm.FP8Tiles(*c) for c in grid]:
            if silu and tiles.block_m == 128 and tiles.block_n == 128 and tiles.num_warps == 4:
                continue  # two 128x128 float32 accumulators on 128 threads: spills
            args = (xq, xs, q, s, offs, BLOCK)
            ms = do_bench(lambda a=args, t=tiles, f=silu: K.grouped_gemm_fp8(*a, silu_mul=f,
                                                                             tiles=t))
            timed.append((ms, tiles, tiles is default))
        timed.sort(key=lambda r: r[0])
        kept = timed[:keep] + [r for r in timed[keep:] if r[2]]
        for ms, tiles, is_default in kept:
            label = f"{proj} {'*' if is_default else ''}{tuple(tiles)}"
            rows.append((label, f"T={tokens} M={m} E={touched}", ms, ms, None,
                         flops / ms / 1e9, touched * q[0].nbytes / ms / 1e6, 0.0))
    return rows


def bench_route(tokens: int) -> list:
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    bias = torch.randn(EXPERTS, device="cuda") * 0.1
    args = (logits, bias, N_GROUP, TOPK_GROUP, TOP_K, True, 2.5)
    ours = do_bench(lambda: K.deepseek_route(*args))
    theirs = do_bench(lambda: reference.deepseek_route(*args))
    ids, ids_ref = K.deepseek_route(*args)[1], reference.deepseek_route(*args)[1]
    same = (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1).float().mean().item()
    return [("route", f"T={tokens}", ours, theirs, None, 0.0, 0.0, 1.0 - same)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="bf16,fp8,route", help="comma-separated cases")
    parser.add_argument("--tokens", default="64,256,1024", help="comma-separated token counts")
    parser.add_argument("--sweep", action="store_true",
                        help="time every candidate fp8 launch setting (tiles); * = the default")
    args = parser.parse_args()
    if args.sweep:
        args.only = "sweep"
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels_bench needs a CUDA device")
    cases, token_counts = args.only.split(","), [int(t) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"H={HIDDEN} I={INTER} E={EXPERTS} k={TOP_K}")
    torch.manual_seed(0)
    banks = {}
    if "bf16" in cases or "fp8" in cases or "sweep" in cases:
        banks["gate_up"], banks["down"] = random_bank(2 * INTER, HIDDEN), random_bank(HIDDEN, INTER)
    if "fp8" in cases or "sweep" in cases:
        banks["gate_up_fp8"], banks["down_fp8"] = (quantize_bank(banks["gate_up"]),
                                                   quantize_bank(banks["down"]))
    print(f"{'case':20} {'shape':24} {'triton ms':>9} {'torch ms':>9} {'speedup':>7} "
          f"{'bf16 ms':>8} {'TFLOP/s':>7} {'GB/s':>6} {'rel diff':>8}")
    print("(fp8: torch ms = dequantize bank + bf16 grouped_mm; bf16 ms = weights pre-dequantized;"
          " route: rel diff = share of rows whose expert set differs)")
    for tokens in token_counts:
        rows = []
        if "bf16" in cases:
            rows += bench_bf16(banks, tokens)
        if "fp8" in cases:
            rows += bench_fp8(banks, tokens)
        if "route" in cases:
            rows += bench_route(tokens)
        if "sweep" in cases:
            rows += sweep_fp8(banks, tokens)
        for name, shape, ours, theirs, extra, tflops, gbs, diff in rows:
            extra = f"{extra:8.3f}" if extra is not None else f"{'-':>8}"
            print(f"{name:20} {shape:24} {ours:9.3f} {theirs:9.3f} {theirs / ours:6.2f}x "
                  f"{extra} {tflops:7.0f} {gbs:6.0f} {diff:8.1e}")


if __name__ == "__main__":
    main()
