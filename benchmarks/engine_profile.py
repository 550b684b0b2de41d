"""Where a real engine's decode time goes: run `batchgen bench`'s workload and profile a window
of engine steps (decode bursts, after the prompts) with torch.profiler, device activity only,
so the host runs as it does unprofiled.

    python benchmarks/engine_profile.py --shape llama3-8b --fp8-weights --fp8-scales tensor \\
        --kv-dtype fp8_e4m3fn --max-decode-batch 512 --requests 512 --output-len 200

Prints the window's wall time per decode step against the time the device was busy (the gap
is the device waiting for the host), the host's scheduling and post-processing inside it, and
the kernels by device time per step. On CUDA (CPU with --tiny profiles host time instead).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.bench import BenchConfig, Workload, bench
from batchgen.engine.engine import Engine


class StepWindow:
    """Wraps Engine.step: profiles `steps` calls once `after_bursts` bursts have run."""

    def __init__(self, after_bursts: int, steps: int, rows: int):
        self.after_bursts, self.steps, self.rows = after_bursts, steps, rows
        self.profiler = None
        self.calls = 0
        self.done = False

    def wrap(self, step):
        def profiled_step(engine: Engine):
            if not self.done and self.profiler is None and engine.times.bursts >= self.after_bursts:
                self._start(engine)
            out = step(engine)
            if self.profiler is not None and not self.done:
                self.calls += 1
                if self.calls == self.steps:
                    self._stop(engine)
            return out
        return profiled_step

    def _start(self, engine: Engine) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        self.profiler = profile(activities=[ProfilerActivity.CUDA if cuda
                                            else ProfilerActivity.CPU])
        self.profiler.__enter__()
        self.begin = time.perf_counter()
        times = engine.times
        self.before = (times.decode_steps, times.schedule_s, times.postprocess_s)

    def _stop(self, engine: Engine) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.begin
        self.profiler.__exit__(None, None, None)
        self.done = True
        times = engine.times
        steps = max(1, times.decode_steps - self.before[0])
        host = (times.schedule_s - self.before[1]) + (times.postprocess_s - self.before[2])
        events = self.profiler.key_averages()
        own = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        busy = sum(getattr(e, own) for e in events) / 1e3
        print(f"window: {steps} decode steps in {self.steps} engine steps; wall "
              f"{wall * 1e3 / steps:.2f} ms/step, {'device' if 'device' in own else 'host ops'} "
              f"busy {busy / steps:.2f} ms/step, host schedule + post-process "
              f"{host * 1e3 / steps:.2f} ms/step")
        for e in sorted(events, key=lambda e: -getattr(e, own))[:self.rows]:
            print(f"  {getattr(e, own) / 1e3 / steps:8.3f} ms/step  "
                  f"{e.count / steps:6.1f} calls/step  {e.key[:90]}")
        if torch.cuda.is_available():
            print_gaps(self.profiler.events(), steps)


def print_gaps(events, steps: int, largest: int = 8) -> None:
    """Where the device sat idle inside the window: the gaps between consecutive kernels (and
    copies) by size class, per step, and the largest few with the kernels around them. Many
    small gaps point at kernel boundaries (launch and tail), a few large ones at the host."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    classes = ((0, 2), (2, 10), (10, 100), (100, float("inf")))
    print("device idle between kernels (us per step by gap size):  " + "  ".join(
        f"{lo}-{hi if hi != float('inf') else ''}us: "
        f"{sum(g for g, *_ in gaps if lo <= g < hi) / steps:.0f} "
        f"({sum(1 for g, *_ in gaps if lo <= g < hi) / steps:.0f})" for lo, hi in classes))
    for gap, before, after in sorted(gaps, reverse=True)[:largest]:
        print(f"  {gap:9.1f} us after {before[:50]!r} before {after[:50]!r}")


def add_workload_args(parser: argparse.ArgumentParser, max_decode_batch: int, requests: int,
                      output_len: int) -> None:
    """`batchgen bench`'s model and workload flags these profiling scripts share."""
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--fp8-weights", action="store_true")
    parser.add_argument("--fp8-scales", default="block")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--max-decode-batch", type=int, default=max_decode_batch)
    parser.add_argument("--cuda-graph-num-buckets", type=int, default=12)
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="Leading prompt tokens drawn from --num-prefixes shared prefixes.")
    parser.add_argument("--num-prefixes", type=int, default=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser, max_decode_batch=384, requests=384, output_len=200)
    parser.add_argument("--decode-burst-steps", type=int, default=8)
    parser.add_argument("--after-bursts", type=int, default=6,
                        help="Bursts to run (after the warm-up) before the window opens.")
    parser.add_argument("--window", type=int, default=6, help="Engine steps profiled.")
    parser.add_argument("--kernels", type=int, default=20, help="Kernel rows printed.")
    parser.add_argument("--tiny", action="store_true", help="Toy widths (a CPU smoke run).")
    args = parser.parse_args()

    window = StepWindow(args.after_bursts, args.window, args.kernels)
    Engine.step = window.wrap(Engine.step)
    cfg = BenchConfig(shape=args.shape, kv_dtype=args.kv_dtype,
                      max_decode_batch=args.max_decode_batch, host_kv_cache_size=100,
                      cuda_graph_num_buckets=args.cuda_graph_num_buckets,
                      decode_burst_steps=args.decode_burst_steps, fp8_weights=args.fp8_weights,
                      fp8_scales=args.fp8_scales, tiny=args.tiny,
                      gpu_kv_cache_size=None if torch.cuda.is_available() else 0.05)
    report = bench(cfg, Workload(requests=args.requests, input_len=args.input_len,
                                 output_len=args.output_len,
                                 shared_prefix_len=args.shared_prefix_len,
                                 num_prefixes=args.num_prefixes))
    if not window.done:
        print("the window never closed: raise --requests/--output-len or lower --after-bursts")
    print(f"whole run: {report['results']['batchgen']['output_tok_s']:,.0f} output tok/s")


if __name__ == "__main__":
    main()
