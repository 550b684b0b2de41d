"""Where one step's time goes: a prefill forward and a decode step of a named shape, timed
against the bytes/FLOPs bound, with the top kernels of each from torch.profiler.

    python benchmarks/step_profile.py --shape llama3-8b --batch 384 --context 1500
    python benchmarks/step_profile.py --shape llama3-8b --fp8-weights --kv-dtype fp8_e4m3fn
    python benchmarks/step_profile.py --shape llama3-8b --fp8-weights --fp8-scales tensor

On CUDA (CPU with --tiny as a smoke run); random weights, no engine or scheduler: the model, the
KV pool and the graphs.
"""

from __future__ import annotations

import argparse

import torch

from batchgen.bench import measure_hbm_bandwidth
from batchgen.bench_models import FP8_SCALES, hf_config_for, random_model, weight_stats
from batchgen.config import ModelConfig
from batchgen.core import PAGE_SIZE
from batchgen.engine.kv_cache import KV_DTYPES
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.graphs import DecodeGraphs
from batchgen.engine.kv_cache import KVLayout, KVPool

PEAK_BF16_FLOPS = 790e12
"""Dense bf16 matmul rate measured on an H200 (docs/architecture.md, "Measured transfer costs")."""


def timed(fn, repeat: int) -> float:
    """Mean milliseconds of fn() over `repeat` runs, after one warm-up."""
    fn()
    if not torch.cuda.is_available():
        import time

        begin = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - begin) * 1e3 / repeat
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def top_kernels(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                     row_limit=rows, max_name_column_width=60)


def batch_of(pool: KVPool, lengths: list[int], computed: list[int], first_page: int,
             vocab: int) -> ForwardBatch:
    """Sequence b computes tokens computed[b]..lengths[b] on its own run of pages."""
    tables, page = [], first_page
    for n in lengths:
        count = -(-n // PAGE_SIZE)
        tables.append(list(range(page, page + count)))
        page += count
    # Random ids: identical tokens would route every row of an MoE to the same few experts.
    gen = torch.Generator().manual_seed(first_page)
    ids = [torch.randint(10, vocab - 10, (n - c,), generator=gen).tolist()
           for n, c in zip(lengths, computed)]
    return ForwardBatch.build(
        token_ids=ids, starts=computed,
        page_tables=tables, sample_mask=[True] * len(lengths), kv_pool=pool,
        device=pool.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--fp8-weights", action="store_true")
    parser.add_argument("--fp8-scales", default="block", choices=FP8_SCALES)
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", *KV_DTYPES])
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--kernels", type=int, default=10, help="Profiler rows (0: none).")
    parser.add_argument("--tiny", action="store_true", help="Toy widths (a CPU smoke run).")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fp8 = args.fp8_scales if args.fp8_weights else False
    model = random_model(hf_config_for(args.shape, args.tiny, fp8), dtype, device,
                         ModelConfig(kv_dtype=args.kv_dtype))
    kv_dtype = dtype if args.kv_dtype == "auto" else KV_DTYPES[args.kv_dtype]
    layout = KVLayout(model.config.num_hidden_layers, tuple(model.kv_token_shape), kv_dtype, dtype)
    prompts = max(1, args.prefill_tokens // args.prompt_len)
    decode_pages = args.batch * -(-args.context // PAGE_SIZE)
    prefill_pages = prompts * -(-args.prompt_len // PAGE_SIZE)
    pool = KVPool(layout, decode_pages + prefill_pages, device)
    bandwidth = measure_hbm_bandwidth(device)
    stats = weight_stats(model)

    vocab = model.config.vocab_size
    decode = batch_of(pool, [args.context] * args.batch, [args.context - 1] * args.batch, 0, vocab)
    prefill = batch_of(pool, [args.prompt_len] * prompts, [0] * prompts, decode_pages, vocab)
    # Both at once, decode rows first as the scheduler usually packs them (same pages again).
    mixed = batch_of(pool, [args.context] * args.batch + [args.prompt_len] * prompts,
                     [args.context - 1] * args.batch + [0] * prompts, 0, vocab)
    graph_ms = float("nan")
    with torch.inference_mode():
        eager_ms = timed(lambda: model(decode), 5)
        if device.type == "cuda":
            graphs = DecodeGraphs(model, pool, args.batch, 1, args.context + PAGE_SIZE)
            graphs.capture()
            graph_ms = timed(lambda: graphs.run(decode), 20)
        prefill_ms = timed(lambda: model(prefill), 3)
        mixed_ms = timed(lambda: model(mixed), 3)
    kv_bytes = args.batch * args.context * layout.bytes_per_token
    decode_bound = (stats["device_bytes"] + kv_bytes) / bandwidth * 1e3
    tokens = prompts * args.prompt_len
    prefill_bound = 2 * stats["active_params"] * tokens / PEAK_BF16_FLOPS * 1e3
    print(f"shape {args.shape}  weights {f'fp8 ({args.fp8_scales})' if fp8 else 'bf16'} "
          f"({stats['device_bytes'] / 1e9:.1f} GB)  kv {str(kv_dtype).removeprefix('torch.')}  "
          f"HBM {bandwidth / 1e12:.2f} TB/s")
    print(f"{'step':<34}{'ms':>9}{'bound ms':>10}{'of bound':>10}")
    print(f"{f'decode b{args.batch} ctx {args.context}, graph':<34}{graph_ms:>9.2f}"
          f"{decode_bound:>10.2f}{decode_bound / graph_ms:>10.0%}")
    print(f"{f'decode b{args.batch} ctx {args.context}, eager':<34}{eager_ms:>9.2f}"
          f"{decode_bound:>10.2f}{decode_bound / eager_ms:>10.0%}")
    print(f"{f'prefill {prompts} x {args.prompt_len}':<34}{prefill_ms:>9.2f}"
          f"{prefill_bound:>10.2f}{prefill_bound / prefill_ms:>10.0%}"
          f"   ({tokens / prefill_ms * 1e3:,.0f} tok/s)")
    mixed_bound = decode_bound + prefill_bound
    print(f"{'mixed: both in one forward':<34}{mixed_ms:>9.2f}"
          f"{mixed_bound:>10.2f}{mixed_bound / mixed_ms:>10.0%}")
    if args.kernels:
        with torch.inference_mode():
            print("-- decode (eager) kernels\n" + top_kernels(lambda: model(decode), args.kernels))
            print("-- prefill kernels\n" + top_kernels(lambda: model(prefill), args.kernels))


if __name__ == "__main__":
    main()
