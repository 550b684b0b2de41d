"""Time the paged MLA decode kernel on a CUDA device: against the PyTorch path it replaces
(gather the pages into a padded cache, then SDPA with one shared KV head), and over a small
sweep of launch configurations, each checked against the float64 reference first.

Usage: python benchmarks/mla_decode_bench.py [--sweep]
DeepSeek-V3 shapes: 128 heads, latent 512 + rope 64, bfloat16 (and an fp8 cache). GB/s is the
latent cache bytes read (each sequence's keys once) over the kernel time: the fraction of HBM
bandwidth reached. Not a test: it needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools

import batchgen_kernels as K
import torch
import torch.nn.functional as F
from batchgen_kernels import reference
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

PAGE, HEADS, LATENT, ROPE = 64, 128, 512, 64
BF16 = torch.bfloat16
CASES = [(64, 640), (256, 640), (8, 4096), (1, 16384)]
"""(batch, context): the bench workloads' decode (512 in + 128 out), and long contexts with
too few sequences to fill the GPU without split-K."""


def latent_pool(batch: int, ctx: int, fp8: bool):
    pages = -(-ctx // PAGE)
    data = torch.randn(batch * pages, 2, PAGE, 1, LATENT + ROPE, device="cuda")
    scales = None
    if fp8:
        data = (data * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = (torch.rand(data.shape[:-1], device="cuda") * 0.02)[:, 1]
    else:
        data = data.to(BF16)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
    return data[:, 1], scales, table


def torch_path(q_lat, q_pe, kv, scales, table, ctx_lens, scale):
    """What mla.py runs without the kernel: a padded gather, then masked SDPA."""
    cache = kv[table.long()].flatten(1, 2)[:, :, 0].to(q_lat.dtype)  # [B, P*64, C+R]
    if scales is not None:
        cache = cache * scales[table.long()].flatten(1, 2).to(q_lat.dtype)
    q = torch.cat([q_lat, q_pe], dim=-1)[:, :, None]  # [B, H, 1, C+R]
    k = cache[:, None]  # [B, 1, K, C+R]
    mask = torch.arange(cache.shape[1], device="cuda")[None, :] < ctx_lens[:, None].long()
    out = F.scaled_dot_product_attention(q, k, k[..., :LATENT], attn_mask=mask[:, None, None],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0]


def run_case(batch: int, ctx: int, fp8: bool, sweep: bool) -> None:
    kv, scales, table = latent_pool(batch, ctx, fp8)
    q_lat = torch.randn(batch, HEADS, LATENT, device="cuda", dtype=BF16)
    q_pe = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=BF16)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = 192 ** -0.5
    ref = reference.mla_decode_attention(q_lat, q_pe, kv, scales, table, ctx_lens, scale)
    cache_bytes = batch * ctx * (LATENT + ROPE) * kv.element_size()
    name = f"B={batch:<4} ctx={ctx:<6} {'fp8' if fp8 else 'bf16'}"
    t_torch = do_bench(lambda: torch_path(q_lat, q_pe, kv, scales, table, ctx_lens, scale))
    configs = [dict()]
    if sweep:
        configs += [dict(block_h=h, block_n=n, num_warps=w, num_stages=s) for h, n, w, s in
                    itertools.product((16, 32), (32, 64), (4, 8), (1, 2))]
    rows = []
    for cfg in configs:
        try:
            out = K.mla_decode_attention(q_lat, q_pe, kv, scales, table, ctx_lens, scale, **cfg)
        except (OutOfResources, RuntimeError) as err:  # too much shared memory, say
            rows.append((cfg, None, f"{type(err).__name__}"))
            continue
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if err > 3e-2:
            rows.append((cfg, None, f"WRONG (rel err {err:.2g})"))
            continue
        rows.append((cfg, do_bench(lambda cfg=cfg: K.mla_decode_attention(
            q_lat, q_pe, kv, scales, table, ctx_lens, scale, **cfg)), ""))
    default = rows[0][1]
    print(f"{name}  torch {t_torch * 1e3:8.1f} us  kernel {default * 1e3:8.1f} us  "
          f"x{t_torch / default:5.1f}  {cache_bytes / default / 1e6:7.0f} GB/s")
    if sweep:
        timed = sorted((r for r in rows[1:] if r[1] is not None), key=lambda r: r[1])
        for cfg, ms, _ in timed[:3]:
            print(f"    {cfg}: {ms * 1e3:8.1f} us  {cache_bytes / ms / 1e6:7.0f} GB/s")
        for cfg, _, note in rows[1:]:
            if note:
                print(f"    {cfg}: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also try 16 launch configurations")
    args = parser.parse_args()
    for fp8 in (False, True):
        for batch, ctx in CASES:
            run_case(batch, ctx, fp8, args.sweep)


if __name__ == "__main__":
    main()
