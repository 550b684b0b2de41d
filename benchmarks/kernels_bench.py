"""Time each batchgen_kernels kernel against its PyTorch equivalent on a CUDA device.

Usage: python benchmarks/kernels_bench.py [--only decode,prefill,...]
Prints one row per case: median times (triton.testing.do_bench), the speed-up, and GB/s: the
bytes each kernel must read plus write divided by its time (for decode: the HBM bandwidth
reached; for page copies: bytes copied, i.e. the link bandwidth for host transfers).
Shapes are Llama-3-8B-like: 32 query heads, 8 KV heads, head_dim 128, bfloat16.
Not a test: it needs a GPU and minutes.
"""

from __future__ import annotations

import argparse
import itertools

import batchgen_kernels as K
import torch
import torch.nn.functional as F
from batchgen_kernels import reference
from triton.testing import do_bench

from batchgen.engine.kv_cache import KVLayout

PAGE = 64
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BF16 = torch.bfloat16


def paged_pool(batch: int, ctx: int, kv_dtype: torch.dtype, num_layers: int = 2,
               scale_layout: str = "pool"):
    """A pool whose layer-1 view holds `ctx` tokens for each of `batch` sequences. fp8 scales
    as the engine stores them ("pool": a page's slots innermost) or token-major ("token":
    one strided 4-byte load per slot, for comparison)."""
    pages = -(-ctx // PAGE)
    data = torch.randn(batch * pages, num_layers, PAGE, 2, KV_HEADS, HEAD_DIM, device="cuda")
    data = data.to(kv_dtype)
    scales = None
    if kv_dtype == torch.float8_e4m3fn:
        layout = KVLayout(num_layers, (2, KV_HEADS, HEAD_DIM), kv_dtype, BF16)
        storage = torch.rand(layout.scale_pages_shape(batch * pages), device="cuda") * 0.01
        scales = storage.movedim(-1, 2)
        if scale_layout == "token":
            scales = scales.contiguous()
        scales = scales[:, 1]
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
    return data[:, 1], scales, table


def torch_paged_attention(q, kv, scales, table, ctx_lens, q_len):
    """Gather pages into a dense padded cache, then SDPA (what the engine does without kernels)."""
    dense = kv[table.long()].flatten(1, 2)  # [B, P*64, 2, KVH, D]
    if scales is not None:
        dense = dense.to(BF16) * scales[table.long()].flatten(1, 2).unsqueeze(-1).to(BF16)
    k, v = dense[:, :, 0].transpose(1, 2), dense[:, :, 1].transpose(1, 2)
    qb = q.view(table.shape[0], q_len, HEADS, HEAD_DIM).transpose(1, 2)
    keys = torch.arange(k.shape[2], device="cuda")
    q_pos = ctx_lens[:, None] - q_len + torch.arange(q_len, device="cuda")[None]
    mask = keys[None, None, :] <= q_pos[:, :, None]  # [B, q_len, K]
    return F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], enable_gqa=True)


def bench_decode(batch: int, ctx: int, kv_dtype=BF16, num_splits=None, scale_layout="pool",
                 with_torch: bool = True):
    kv, scales, table = paged_pool(batch, ctx, kv_dtype, scale_layout=scale_layout)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ours = do_bench(lambda: K.paged_decode_attention(q, kv, scales, table, ctx_lens, scale,
                                                     num_splits=num_splits))
    theirs = (do_bench(lambda: torch_paged_attention(q, kv, scales, table, ctx_lens, 1))
              if with_torch else float("nan"))
    moved = batch * ctx * 2 * KV_HEADS * HEAD_DIM * kv.element_size() + 2 * q.nbytes
    if scales is not None:
        moved += batch * ctx * 2 * KV_HEADS * 4
    name = f"decode {kv_dtype}".replace("torch.", "") + f" splits={num_splits or 'auto'}"
    if scales is not None:
        name += f" scales={scale_layout}"
    return name, f"B={batch} ctx={ctx}", ours, theirs, moved


def sweep_decode() -> list:
    """The decode kernel per launch setting (warps x stages), for fp8 and bf16 KV at B=256
    ctx 1k and B=512 ctx 1.5k: picks decode_attention's FP8_LAUNCH / FP8_FULL_LAUNCH and
    BF16_LAUNCH. The "torch ms" column holds the current setting's time (speed-up > 1: better
    than it). Walking two or four pages per loop iteration is slower throughout
    (docs/performance.md, "Measured and not adopted")."""
    from batchgen_kernels import decode_attention as DA

    names = ("FP8_LAUNCH", "FP8_FULL_LAUNCH", "BF16_LAUNCH")
    saved, rows = {name: getattr(DA, name) for name in names}, []
    try:
        for kv_dtype, patched in ((torch.float8_e4m3fn, names[:2]), (BF16, names[2:])):
            for batch, ctx in ((256, 1024), (512, 1500)):
                for name in names:
                    setattr(DA, name, saved[name])
                base = bench_decode(batch, ctx, kv_dtype, with_torch=False)[2]
                for warps in (1, 2, 4, 8):
                    for stages in (1, 2, 3, 4):
                        for name in patched:
                            setattr(DA, name, {"num_warps": warps, "num_stages": stages})
                        _, shape, ours, _, moved = bench_decode(batch, ctx, kv_dtype,
                                                                with_torch=False)
                        rows.append((f"{patched[0][:4]} w={warps} s={stages}", shape, ours,
                                     base, moved))
    finally:
        for name in names:
            setattr(DA, name, saved[name])
    return rows


def bench_mixed(decodes: int, ctx: int, prompts: int, prompt_len: int):
    """A mixed step's attention: `decodes` one-row sequences at context `ctx` packed before
    `prompts` whole prompts. Ours: one-row sequences through the decode kernel (skip_one_row);
    "torch" column: the prefill kernel over every row, for comparison."""
    kv, scales, table = paged_pool(decodes + prompts, max(ctx, prompt_len), BF16)
    q_lens = [1] * decodes + [prompt_len] * prompts
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    ctx_lens = torch.tensor([ctx] * decodes + [prompt_len] * prompts, dtype=torch.int32,
                            device="cuda")
    scale = HEAD_DIM ** -0.5

    def split():
        out = K.paged_prefill_attention(q, kv, scales, cu, ctx_lens, table, scale, prompt_len,
                                        skip_one_row=True)
        out[:decodes] = K.paged_decode_attention(q[:decodes], kv, scales, table[:decodes],
                                                 ctx_lens[:decodes], scale)
    ours = do_bench(split)
    theirs = do_bench(lambda: K.paged_prefill_attention(q, kv, scales, cu, ctx_lens, table,
                                                        scale, prompt_len))
    return "mixed step (vs prefill kernel)", f"{decodes}x{ctx} + {prompts}x{prompt_len}", ours, \
        theirs, None


def bench_prefill(batch: int, q_len: int, kv_dtype=BF16):
    kv, scales, table = paged_pool(batch, q_len, kv_dtype)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    ctx_lens = torch.full((batch,), q_len, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ours = do_bench(lambda: K.paged_prefill_attention(q, kv, scales, cu, ctx_lens, table, scale,
                                                      q_len))
    dense_k = torch.randn(batch, KV_HEADS, q_len, HEAD_DIM, device="cuda", dtype=BF16)
    qb = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    theirs = do_bench(lambda: F.scaled_dot_product_attention(qb, dense_k, dense_k,
                                                             is_causal=True, enable_gqa=True))
    flops = 2 * 2 * batch * HEADS * HEAD_DIM * q_len * q_len / 2
    print(f"  prefill {kv_dtype}: {flops / ours / 1e9:.0f} TFLOP/s (torch SDPA flash on dense "
          f"bf16 KV: {flops / theirs / 1e9:.0f})")
    name = f"prefill {kv_dtype} (vs dense SDPA)".replace("torch.", "")
    return name, f"B={batch} q={q_len}", ours, theirs, None


def sweep_prefill() -> list:
    """The prefill kernel per launch setting (rows per program x warps x stages) for bf16 and
    fp8 KV at 8 prompts of 1000 tokens (a W1 prefill step): picks prefill_attention.LAUNCH
    (three stages were measured too, never better).
    The "torch ms" column holds the current setting's time (speed-up > 1: better than it)."""
    from batchgen_kernels import prefill_attention as PA

    saved, rows = dict(PA.LAUNCH), []  # a setting is replaced whole, never mutated
    try:
        for kv_dtype, key in ((BF16, "float"), (torch.float8_e4m3fn, "fp8")):
            base = bench_prefill(8, 1000, kv_dtype)[2]
            for block_m in (32, 64, 128):
                for warps in (2, 4, 8):
                    for stages in (1, 2):
                        PA.LAUNCH[key] = {"block_m": block_m, "num_warps": warps,
                                          "num_stages": stages,
                                          "group_heads": saved[key]["group_heads"]}
                        ours = bench_prefill(8, 1000, kv_dtype)[2]
                        rows.append((f"prefill {key} m={block_m} w={warps} s={stages}",
                                     "B=8 q=1000", ours, base, None))
    finally:
        PA.LAUNCH.update(saved)
    return rows


def bench_prefill_after_prefix(batch: int, q_len: int, ctx: int, kv_dtype=BF16):
    """`batch` sequences each prefilling their last `q_len` tokens of `ctx` (the rest cached
    earlier, as after a prefix-cache hit): W3's prefill steps are 38 x 216 of 2,216. The
    "torch ms" column is dense SDPA (flash) of those queries over contiguous K/V."""
    kv, scales, table = paged_pool(batch, ctx, kv_dtype)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ours = do_bench(lambda: K.paged_prefill_attention(q, kv, scales, cu, ctx_lens, table, scale,
                                                      q_len))
    dense_k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=BF16)
    qb = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    mask = (torch.arange(ctx, device="cuda")[None, :]
            <= torch.arange(ctx - q_len, ctx, device="cuda")[:, None])
    theirs = do_bench(lambda: F.scaled_dot_product_attention(qb, dense_k, dense_k,
                                                             attn_mask=mask, enable_gqa=True))
    flops = 2 * 2 * batch * HEADS * HEAD_DIM * q_len * (ctx - q_len / 2)
    print(f"  prefill after a prefix {kv_dtype}: {flops / ours / 1e9:.0f} TFLOP/s")
    name = f"prefill+prefix {kv_dtype} (vs SDPA)".replace("torch.", "")
    return name, f"B={batch} q={q_len} ctx={ctx}", ours, theirs, None


def sweep_prefill_after_prefix() -> list:
    """The prefill kernel per launch setting (rows per program x warps x stages x GQA heads
    per program) at W3's prefill step: 38 sequences of 216 new tokens after 2,000 cached.
    The "torch ms" column holds the current setting's time."""
    from batchgen_kernels import prefill_attention as PA

    saved, rows = dict(PA.LAUNCH), []
    try:
        for kv_dtype, key in ((BF16, "float"), (torch.float8_e4m3fn, "fp8")):
            base = bench_prefill_after_prefix(38, 216, 2216, kv_dtype)[2]
            for block_m, warps, stages, grouped in itertools.product(
                    (64, 128), (4, 8), (2, 3), (False, True)):
                if block_m == 64 and warps == 8:
                    continue
                PA.LAUNCH[key] = {"block_m": block_m, "num_warps": warps,
                                  "num_stages": stages, "group_heads": grouped}
                ours = bench_prefill_after_prefix(38, 216, 2216, kv_dtype)[2]
                rows.append((f"{key} m={block_m} w={warps} s={stages} g={int(grouped)}",
                             "B=38 q=216 ctx=2216", ours, base, None))
    finally:
        PA.LAUNCH.update(saved)
    return rows


def sweep_decode_waves() -> list:
    """The decode kernel at equal context lengths (a W1 decode step: sequences admitted
    together have contexts within a page of each other) by split count: with one split the
    grid's last wave of programs runs the SMs part-empty. The "torch ms" column holds the
    default split's time."""
    rows = []
    for kv_dtype, batch in ((torch.float8_e4m3fn, 512), (torch.float8_e4m3fn, 256), (BF16, 384)):
        for ctx in (1100, 1500, 1900):
            base = bench_decode(batch, ctx, kv_dtype, with_torch=False)[2]
            for splits in (1, 2, 3, 4):
                name, shape, ours, _, moved = bench_decode(batch, ctx, kv_dtype, splits,
                                                           with_torch=False)
                rows.append((name, shape, ours, base, moved))
    return rows


def decode_slots(tokens: int) -> torch.Tensor:
    """A decode step's slots: one token in each of `tokens` pages, at random offsets (tokens
    sharing a page would contend for its sectors, which a decode step never does)."""
    return (torch.randperm(tokens, device="cuda") * PAGE
            + torch.randint(0, PAGE, (tokens,), device="cuda"))


def bench_store(tokens: int, kv_dtype=BF16, prompt_order: bool = False):
    """Slots as a decode step's (`decode_slots`) or, with `prompt_order`, consecutive (a
    prefill's tokens fill whole pages in order)."""
    kv, scales, _ = paged_pool(tokens // PAGE if prompt_order else tokens, PAGE, kv_dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    slots = decode_slots(tokens) if not prompt_order else torch.arange(tokens, device="cuda")
    ours = do_bench(lambda: K.store_kv(k, v, kv, scales, slots))
    theirs = do_bench(lambda: torch_store(k, v, kv, scales, slots))
    moved = 2 * k.nbytes + 2 * k.numel() * kv.element_size() + slots.nbytes
    order = "in order" if prompt_order else "a page each"
    return (f"store_kv {kv_dtype}".replace("torch.", ""), f"T={tokens} slots {order}", ours,
            theirs, moved)


def bench_rope_store(tokens: int, kv_dtype=BF16, prompt_order: bool = False):
    """The fused RoPE + store against the two kernels it replaces (apply_rope into new q/k
    tensors, then store_kv), on views of one QKV projection as in the model."""
    kv, scales, _ = paged_pool(tokens // PAGE if prompt_order else tokens, PAGE, kv_dtype)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    cos, sin = torch.rand(4096, HEAD_DIM, device="cuda"), torch.rand(4096, HEAD_DIM, device="cuda")
    slots = decode_slots(tokens) if not prompt_order else torch.arange(tokens, device="cuda")

    def unfused():
        q_rot, k_rot = K.apply_rope(q, k, pos, cos, sin, torch.empty_like(q), torch.empty_like(k))
        K.store_kv(k_rot, v, kv, scales, slots)
        return q_rot
    moved = 2 * q.nbytes + 2 * k.nbytes + 2 * k.numel() * kv.element_size()
    order = "in order" if prompt_order else "a page each"
    name = f"rope_store_kv {kv_dtype}".replace("torch.", "")
    ours = do_bench(lambda: K.rope_store_kv(q, k, v, pos, cos, sin, kv, scales, slots))
    return f"{name} (vs 2 kernels)", f"T={tokens} slots {order}", ours, do_bench(unfused), moved


def torch_store(k, v, kv, scales, slots):
    page, offset = slots // PAGE, slots % PAGE
    if scales is None:
        kv[page, offset] = torch.stack([k, v], dim=1)
    else:
        values, scale = reference.quantize_fp8(torch.stack([k, v], dim=1))
        kv[page, offset] = values
        scales[page, offset] = scale


def bench_rmsnorm(tokens: int, hidden: int):
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=BF16)

    def unfused():
        h = x + r
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16), h
    ours = do_bench(lambda: K.fused_add_rmsnorm(x, r, w, 1e-6))
    return "fused_add_rmsnorm", f"T={tokens} N={hidden}", ours, do_bench(unfused), 4 * x.nbytes


def bench_rope(tokens: int):
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    q, k = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS]
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    cos, sin = torch.rand(4096, HEAD_DIM, device="cuda"), torch.rand(4096, HEAD_DIM, device="cuda")

    def unfused():
        return reference.rope(q, k, pos, cos, sin)
    ours = do_bench(lambda: K.apply_rope(q, k, pos, cos, sin))
    moved = 2 * (q.numel() + k.numel()) * 2
    return "apply_rope (in place)", f"T={tokens}", ours, do_bench(unfused), moved


def bench_silu(tokens: int, inter: int):
    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16)
    ours = do_bench(lambda: K.silu_and_mul(x))
    theirs = do_bench(lambda: F.silu(x[:, :inter]) * x[:, inter:])
    return "silu_and_mul", f"T={tokens} I={inter}", ours, theirs, x.nbytes * 3 // 2


def bench_fp8_rows(tokens: int, hidden: int, inter: int):
    """The fused per-row e4m3 quantizers against the unfused kernel + `quantize_fp8_rows`."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    w = torch.rand(hidden, device="cuda", dtype=BF16)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16)
    norm = do_bench(lambda: K.rmsnorm_fp8(x, w, 1e-6))
    norm_then = do_bench(lambda: K.quantize_fp8_rows(K.rmsnorm(x, w, 1e-6)))
    silu = do_bench(lambda: K.silu_and_mul_fp8(gate_up))
    silu_then = do_bench(lambda: K.quantize_fp8_rows(K.silu_and_mul(gate_up)))
    return [("rmsnorm_fp8 (vs rmsnorm + quantize)", f"T={tokens} N={hidden}", norm, norm_then,
             x.nbytes * 3 // 2),
            ("silu_and_mul_fp8 (vs silu + quantize)", f"T={tokens} I={inter}", silu, silu_then,
             gate_up.nbytes * 5 // 4)]


CASES = {
    "decode": lambda: [bench_decode(256, 1024), bench_decode(256, 1024, torch.float8_e4m3fn),
                       bench_decode(256, 1024, torch.float8_e4m3fn, scale_layout="token"),
                       bench_decode(8, 16384, num_splits=1), bench_decode(8, 16384)],
    "prefill": lambda: [bench_prefill(4, 2048), bench_prefill(8, 1000),
                        bench_prefill(8, 1000, torch.float8_e4m3fn),
                        bench_prefill_after_prefix(38, 216, 2216)],
    "store": lambda: [bench_store(t, dtype, ordered) for dtype in (BF16, torch.float8_e4m3fn)
                      for t, ordered in ((512, False), (8192, True))],
    "rmsnorm": lambda: [bench_rmsnorm(8192, 4096)],
    "rope": lambda: [bench_rope(8192)],
    "rope_store": lambda: [bench_rope_store(t, dtype, ordered)
                           for dtype in (BF16, torch.float8_e4m3fn)
                           for t, ordered in ((512, False), (8192, True))],
    "silu": lambda: [bench_silu(8192, 14336)],
    "fp8_rows": lambda: [*bench_fp8_rows(512, 4096, 14336), *bench_fp8_rows(8192, 4096, 14336)],
    "mixed": lambda: [bench_mixed(256, 1024, 8, 1000), bench_mixed(64, 1024, 8, 1000)],
    "decode_sweep": sweep_decode,
    "decode_waves": sweep_decode_waves,
    "prefill_sweep": sweep_prefill,
    "prefix_prefill_sweep": sweep_prefill_after_prefix,
}
SWEEPS = ("decode_sweep", "decode_waves", "prefill_sweep", "prefix_prefill_sweep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(c for c in CASES if c not in SWEEPS),
                        help="comma-separated cases (default: all but the sweeps "
                             f"{', '.join(SWEEPS)})")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'kernel':34} {'shape':26} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} "
          f"{'GB/s':>7}")
    for case in args.only.split(","):
        for name, shape, ours, theirs, moved in CASES[case]():
            rate = f"{moved / ours / 1e6:7.0f}" if moved else f"{'-':>7}"  # compute-bound
            print(f"{name:34} {shape:26} {ours:10.4f} {theirs:10.4f} {theirs / ours:7.2f}x {rate}")


if __name__ == "__main__":
    main()
