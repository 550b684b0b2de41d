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

With `--green N ...` the attention runs on a CUDA green context of N SMs (rounded up to the
driver's partition granularity) and the GEMMs on one holding all the other SMs, timed eagerly
(CUDA events) and as a CUDA graph: the two kernels can then share the HBM, never an SM.

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

    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    return {"serial": serial, "serial_halves": serial_halves,
            "overlapped, GEMMs high priority": overlapped(layers, batch, high, low),
            "overlapped, attention high priority": overlapped(layers, batch, low, high)}


def overlapped(layers: Layers, batch: int, gemm_stream, attention_stream):
    """Per layer and half: the GEMMs of one half on gemm_stream while the attention of the
    other runs on attention_stream; both join the main stream before the next half."""
    half = batch // 2
    halves = (slice(0, half), slice(half, batch))

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


def disjoint_green_streams(first_sms: int) -> tuple[tuple[int, int], list]:
    """Two streams on green contexts that share no SM: one of at least `first_sms` SMs (the
    driver rounds up to its partition granularity) and one of all the SMs left. torch's
    `GreenContext.create(num_sms=n)` splits the whole device on each call (two contexts made
    that way may share SMs); the driver's split also
    returns the remainder, which is the second context here. Returns ((SMs of each),
    [the two torch streams, then the handles to keep alive])."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    resource = lambda: ctypes.create_string_buffer(256)  # noqa: E731 - CUdevResource (144-152 B)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    torch.cuda.init()
    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()), "cuDeviceGet")
    whole, first, rest = resource(), resource(), resource()
    check(cuda.cuDeviceGetDevResource(device, whole, 1), "cuDeviceGetDevResource")  # 1: SMs
    groups = ctypes.c_uint(1)
    check(cuda.cuDevSmResourceSplitByCount(first, ctypes.byref(groups), whole, rest, 0,
                                           first_sms), "cuDevSmResourceSplitByCount")
    streams, keep, counts = [], [], []
    for part in (first, rest):
        counts.append(ctypes.c_uint.from_buffer(part, 96).value)  # CUdevSmResource.smCount
        desc, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), part, 1), "GenerateDesc")
        check(cuda.cuGreenCtxCreate(ctypes.byref(context), desc, device, 1), "cuGreenCtxCreate")
        check(cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), context, 1, 0),
              "cuGreenCtxStreamCreate")  # flags 1: non-blocking, as the driver requires
        streams.append(torch.cuda.ExternalStream(stream.value))
        keep += [part, context]
    return tuple(counts), streams + keep


def green_probe(batch: int, context: int, fp8: bool, splits: list[int]) -> None:
    layers = Layers(batch, context, fp8)
    tag = f"{'FP8 + fp8 KV' if fp8 else 'bf16'} b{batch} ctx {context}"
    half = batch // 2
    halves = (slice(0, half), slice(half, batch))
    full = schedules(layers, batch)
    for name in ("serial", "serial_halves"):
        print(f"{tag:24} eager {name:44} {event_ms(full[name]):8.2f} ms/32 layers", flush=True)
    for attention_sms in splits:
        try:
            (attention_sms, gemm_sms), handles = disjoint_green_streams(attention_sms)
        except Exception as error:  # noqa: BLE001 - a probe reports what the driver says
            print(f"{tag:24} green contexts not available: {error!r}")
            return
        attention_stream, gemm_stream = handles[:2]
        label = f"green attn {attention_sms} / GEMM {gemm_sms} SMs"

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

        def pipelined():
            # Each half's attention waits for its own GEMMs only; the GEMM stream never waits
            # for an attention, so this is an optimistic bound for two micro-batches.
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
                 "overlapped halves": overlapped(layers, batch, gemm_stream, attention_stream),
                 "pipelined halves": pipelined}
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
