"""Can a decode step overlap the attention of one half-batch (HBM-bound) with the GEMMs of the
other half (compute-bound)? Times, per 32 Llama-3-8B layers in CUDA graphs:

- serial:         GEMMs(B) then attention(B), layer after layer (what batchgen runs);
- serial_halves:  the same on two half-batches in turn (the cost of splitting the batch);
- overlapped:     per layer, GEMMs(half a) on one stream while attention(half b) runs on
                  another, then the halves swap; with either stream at high priority, and
                  optionally with cuBLASLt told to leave SMs to the attention
                  (`torch._C._set_sm_carveout_experimental`).

    python benchmarks/overlap_probe.py                       # bf16 b384 and FP8 b512, ctx 1500
    python benchmarks/overlap_probe.py --carveouts 0 24 48   # also confine the GEMMs
    python benchmarks/overlap_probe.py --green 48 64 80      # SM-partitioned green contexts

With `--green N ...` the attention runs on a CUDA green context of N SMs and the GEMMs on one
holding the rest (rounded down to the partition granularity), timed eagerly (CUDA events):
the two kernels can then only share the HBM, never an SM.

Random weights and KV; the attention is batchgen's paged decode kernel, the GEMMs are cuBLAS
(`_scaled_mm` rowwise for FP8). Not a test: it needs a CUDA device and a minute.
"""

from __future__ import annotations

import argparse

import batchgen_kernels as K
import torch
from kernels_bench import paged_pool
from triton.testing import do_bench

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
LAYER_GEMMS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
"""(N, K) of q|k|v, o, gate|up and down in one Llama-3-8B layer."""
DISTINCT_LAYERS = 4
"""Layers with their own weights and KV, cycled to 32: each is far larger than L2."""
REPEATS = 32 // DISTINCT_LAYERS


class Layers:
    """Weights, activations and paged KV of DISTINCT_LAYERS layers."""

    def __init__(self, batch: int, context: int, fp8: bool):
        self.fp8 = fp8
        self.weights = [[self._weight(n, k) for n, k in LAYER_GEMMS]
                        for _ in range(DISTINCT_LAYERS)]
        kv_dtype = F8 if fp8 else BF16
        self.pools = [paged_pool(batch, context, kv_dtype) for _ in range(DISTINCT_LAYERS)]
        self.q = torch.randn(batch, 32, 128, device="cuda", dtype=BF16)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        dtype = F8 if fp8 else BF16
        self.inputs = {(m, k): torch.randn(m, k, device="cuda").to(dtype)
                       for m in (batch, batch // 2) for _, k in LAYER_GEMMS}
        self.row_scales = {m: torch.rand(m, 1, device="cuda") * 0.01 for m in (batch, batch // 2)}

    def _weight(self, n: int, k: int):
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        if not self.fp8:
            return w
        return (w / 1e-3).clamp(-448, 448).to(F8).t(), torch.rand(1, n, device="cuda") * 1e-2

    def gemms(self, layer: int, rows: int) -> None:
        for w in self.weights[layer]:
            if self.fp8:
                wt, scale = w
                torch._scaled_mm(self.inputs[(rows, wt.shape[0])], wt,
                                 scale_a=self.row_scales[rows], scale_b=scale,
                                 out_dtype=BF16, use_fast_accum=True)
            else:
                self.inputs[(rows, w.shape[1])] @ w.t()

    def attention(self, layer: int, rows: slice) -> None:
        kv, scales, table = self.pools[layer]
        K.paged_decode_attention(self.q[rows], kv, scales, table[rows], self.lens[rows],
                                 128 ** -0.5)


def schedules(layers: Layers, batch: int) -> dict:
    half = batch // 2
    halves = (slice(0, half), slice(half, batch))

    def serial():
        for _ in range(REPEATS):
            for i in range(DISTINCT_LAYERS):
                layers.gemms(i, batch)
                layers.attention(i, slice(0, batch))

    def serial_halves():
        for _ in range(REPEATS):
            for i in range(DISTINCT_LAYERS):
                for rows in halves:
                    layers.gemms(i, half)
                    layers.attention(i, rows)

    def overlapped(gemm_stream, attention_stream):
        def run():
            main = torch.cuda.current_stream()
            for _ in range(REPEATS):
                for i in range(DISTINCT_LAYERS):
                    for rows in halves:
                        gemm_stream.wait_stream(main)
                        attention_stream.wait_stream(main)
                        with torch.cuda.stream(gemm_stream):
                            layers.gemms(i, half)
                        with torch.cuda.stream(attention_stream):
                            layers.attention(i, rows)
                        main.wait_stream(gemm_stream)
                        main.wait_stream(attention_stream)
        return run

    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    return {"serial": serial, "serial_halves": serial_halves,
            "overlapped, GEMMs high priority": overlapped(high, low),
            "overlapped, attention high priority": overlapped(low, high)}


def graph_ms(fn) -> float:
    """Milliseconds of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay)


def probe(batch: int, context: int, fp8: bool, carveouts: list[int]) -> None:
    layers = Layers(batch, context, fp8)
    tag = f"{'FP8 + fp8 KV' if fp8 else 'bf16'} b{batch} ctx {context}"
    half = batch // 2
    for carveout in carveouts:
        torch._C._set_sm_carveout_experimental(carveout or None)
        parts = {"GEMMs(B/2)": lambda: [layers.gemms(i, half) for i in range(DISTINCT_LAYERS)],
                 "attention(B/2)": lambda: [layers.attention(i, slice(0, half))
                                            for i in range(DISTINCT_LAYERS)]}
        for name, fn in parts.items():
            per_layer = do_bench(fn) / DISTINCT_LAYERS
            print(f"{tag:24} carveout {carveout:3}  {name:36} {per_layer * 1e3:8.1f} us/layer")
        for name, fn in schedules(layers, batch).items():
            if carveout and name.startswith("serial"):
                continue
            print(f"{tag:24} carveout {carveout:3}  {name:36} {graph_ms(fn):8.2f} ms/32 layers",
                  flush=True)
    torch._C._set_sm_carveout_experimental(None)


def event_ms(fn, repeats: int = 5) -> float:
    """Median milliseconds of fn launched eagerly (the host stays ahead of the device)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def green_stream(num_sms: int) -> tuple:
    """(context, stream): the stream's kernels run on the green context's num_sms SMs only."""
    from torch.cuda.green_contexts import GreenContext
    context = GreenContext.create(num_sms=num_sms, device_id=0)
    if hasattr(context, "Stream"):
        return context, context.Stream()
    context.set_context()
    stream = torch.cuda.current_stream()
    context.pop_context()
    return context, stream


def green_probe(batch: int, context: int, fp8: bool, splits: list[int]) -> None:
    layers = Layers(batch, context, fp8)
    tag = f"{'FP8 + fp8 KV' if fp8 else 'bf16'} b{batch} ctx {context}"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    half = batch // 2
    halves = (slice(0, half), slice(half, batch))
    full = schedules(layers, batch)
    for name in ("serial", "serial_halves"):
        print(f"{tag:24} eager {name:44} {event_ms(full[name]):8.2f} ms/32 layers", flush=True)
    for attention_sms in splits:
        keep = []
        try:
            ctx_a, attention_stream = green_stream(attention_sms)
            ctx_g, gemm_stream = green_stream(sms - attention_sms)
            keep += [ctx_a, ctx_g]
        except Exception as error:  # noqa: BLE001 - a probe reports what the driver says
            print(f"{tag:24} green {attention_sms}: not available: {error!r}")
            return
        label = f"green attn {attention_sms} / GEMM {sms - attention_sms} SMs"

        def alone(stream, fn):
            def run():
                main = torch.cuda.current_stream()
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    for _ in range(REPEATS):
                        for i in range(DISTINCT_LAYERS):
                            fn(i)
                main.wait_stream(stream)
            return run

        def overlapped():
            main = torch.cuda.current_stream()
            for _ in range(REPEATS):
                for i in range(DISTINCT_LAYERS):
                    for rows in halves:
                        gemm_stream.wait_stream(main)
                        attention_stream.wait_stream(main)
                        with torch.cuda.stream(gemm_stream):
                            layers.gemms(i, half)
                        with torch.cuda.stream(attention_stream):
                            layers.attention(i, rows)
                        main.wait_stream(gemm_stream)
                        main.wait_stream(attention_stream)

        def pipelined():
            # Each stream runs its own chain; one event per layer keeps half b's attention
            # after half a's GEMMs of the same layer (what a two-micro-batch decoder needs).
            main = torch.cuda.current_stream()
            gemm_stream.wait_stream(main)
            attention_stream.wait_stream(main)
            for _ in range(REPEATS):
                for i in range(DISTINCT_LAYERS):
                    for rows in halves:
                        with torch.cuda.stream(gemm_stream):
                            layers.gemms(i, half)
                            done = torch.cuda.Event()
                            done.record(gemm_stream)
                        with torch.cuda.stream(attention_stream):
                            attention_stream.wait_event(done)
                            layers.attention(i, rows)
            main.wait_stream(gemm_stream)
            main.wait_stream(attention_stream)

        parts = {"attention(B/2) alone": alone(attention_stream,
                                               lambda i: layers.attention(i, halves[0])),
                 "GEMMs(B/2) alone": alone(gemm_stream, lambda i: layers.gemms(i, half)),
                 "overlapped halves": overlapped, "pipelined halves": pipelined}
        for name, fn in parts.items():
            ms = event_ms(fn)
            scale = 2 if "alone" in name else 1
            print(f"{tag:24} {label:32} {name:24} {ms * scale:8.2f} ms/32 layers"
                  f"{' (x2 halves)' if scale == 2 else ''}", flush=True)
        try:
            print(f"{tag:24} {label:32} {'pipelined, CUDA graph':24} {graph_ms(pipelined):8.2f}"
                  " ms/32 layers", flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"{tag:24} {label:32} CUDA graph capture failed: {error!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--carveouts", type=int, nargs="+", default=[0],
                        help="SMs cuBLASLt leaves free (0: none)")
    parser.add_argument("--green", type=int, nargs="+", default=[],
                        help="SMs of the attention's green context (the GEMMs get the rest)")
    args = parser.parse_args()
    if args.green:
        green_probe(384, args.context, False, args.green)
        green_probe(512, args.context, True, args.green)
        return
    if any(args.carveouts):  # the carveout reaches cuBLASLt only
        torch.backends.cuda.preferred_blas_library("cublaslt")
    probe(384, args.context, False, args.carveouts)
    probe(512, args.context, True, args.carveouts)


if __name__ == "__main__":
    main()
