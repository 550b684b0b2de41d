"""Where a whole `batchgen bench` run's wall time goes, step by step: every engine step is timed
and classed by what its plan held, so the run splits into decode-only steps (by batch size),
steps with prefill (by prefill tokens), and time between steps.

    python benchmarks/step_timeline.py --shape llama3-8b --requests 1024 --input-len 2200 \\
        --shared-prefix-len 2000 --num-prefixes 4 --output-len 500 --max-decode-batch 512

Prints one row per class: steps, decode tokens, prefill tokens, seconds and ms per step, then
the run cut into --slices equal spans of wall time with what each held. Wall times are the
host's: a queued decode burst is charged to the step() that collects it. --device-idle (CUDA)
also profiles the device over the timed run: its busy and idle time and the largest idle
gaps with the kernels around them, each gap charged to the class of the step it began in.
--tiny: a CPU smoke run.
"""

from __future__ import annotations

import argparse
import bisect
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import batchgen.bench as bench_module
from batchgen.bench import BenchConfig, Workload, bench
from batchgen.engine.engine import Engine
from batchgen.sched.scheduler import Scheduler
from engine_profile import add_workload_args, print_gaps


class Timeline:
    """Wraps Scheduler.schedule / continue_plan (what a step holds) and Engine.step (how long
    it took); `steps` collects (start, seconds, decode rows, decode steps, prefill tokens)."""

    def __init__(self, device_idle: bool = False):
        self.steps: list[tuple[float, float, int, int, int]] = []
        self._plans: list = []
        self.origin = None
        self.device_idle = device_idle and torch.cuda.is_available()
        self.profiler = None

    def wrap_timed_run(self, fn):
        """Forget the warm-up's steps when the timed run starts; profile the device through
        the timed run with --device-idle (kernels only: the host runs as unprofiled)."""
        def fresh(*args, **kwargs):
            self.steps, self._plans, self.origin = [], [], None
            if not self.device_idle:
                return fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            with self.profiler:
                # The first kernel of the trace, launched at a known host time: it maps the
                # device's clock onto the host's (to within a launch's latency).
                self.marker_host = time.perf_counter()
                torch.ones(1, device="cuda").add_(1)
                out = fn(*args, **kwargs)
                torch.cuda.synchronize()
            return out
        return fresh

    def wrap_plans(self, fn):
        def noted(scheduler, *args, **kwargs):
            out = fn(scheduler, *args, **kwargs)
            if out is not None:
                self._plans.append(out)
            return out
        return noted

    def wrap_step(self, step):
        def timed(engine: Engine):
            start = time.perf_counter()
            self.origin = self.origin or start
            before = engine.times.decode_steps
            out = step(engine)
            seconds = time.perf_counter() - start
            decode = engine.times.decode_steps - before
            rows = prefill = 0
            if self._plans:  # the plan this step ran (a continuation queued is the next one's)
                chunks = self._plans.pop(0).chunks
                rows = sum(1 for c in chunks if c.sample and c.end - c.start == 1)
                prefill = sum(c.end - c.start for c in chunks
                              if not (c.sample and c.end - c.start == 1))
            self.steps.append((start - self.origin, seconds, rows, decode, prefill))
            return out
        return timed


def size_class(value: int, edges: tuple[int, ...]) -> str:
    for edge in edges:
        if value <= edge:
            return f"<= {edge:5d}"
    return f">  {edges[-1]:5d}"


def step_class(rows: int, prefill: int) -> str:
    if prefill:
        mixed = f" + {size_class(rows, ROW_EDGES)} decode rows" if rows else ""
        return f"prefill {size_class(prefill, TOKEN_EDGES)} tok{mixed}"
    return f"decode {size_class(rows, ROW_EDGES)} rows" if rows else "no forward"


ROW_EDGES = (1, 16, 64, 128, 256, 384, 512, 768, 1024)
TOKEN_EDGES = (512, 2048, 4096, 8192, 16384)


def device_idle_report(timeline: Timeline, largest: int = 8) -> None:
    """The device's busy and idle time over the timed run, and each idle gap charged to the
    class of the step whose host time it ended in: the host launched the next kernel then."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name)
                   for e in timeline.profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if len(spans) < 2:
        print("no kernels recorded")
        return
    marker = spans[0][0]
    starts = [timeline.origin + s[0] for s in timeline.steps]
    classes = [step_class(rows, prefill) for _, _, rows, _, prefill in timeline.steps]
    charged = defaultdict(lambda: [0, 0.0])
    busy, end = 0.0, None
    for start, stop, _ in spans[1:]:
        if end is not None and start > end:
            host = timeline.marker_host + (start - marker) / 1e6
            i = bisect.bisect_right(starts, host) - 1
            inside = i >= 0 and host <= starts[i] + timeline.steps[i][1]
            row = charged[classes[i] if inside else "between steps"]
            row[0] += 1
            row[1] += (start - end) / 1e6
        busy += max(0.0, stop - max(start, end or start)) / 1e6
        end = stop if end is None else max(end, stop)
    wall = (end - spans[1][0]) / 1e6
    print(f"\ndevice over the timed run: {wall:.2f} s, busy {busy:.2f} s, idle {wall - busy:.2f} s")
    print(f"{'idle gaps ending in':44} {'gaps':>7} {'s':>7}")
    for key, (count, seconds) in sorted(charged.items(), key=lambda kv: -kv[1][1]):
        print(f"{key:44} {count:7d} {seconds:7.2f}")
    print_gaps(timeline.profiler.events(), 1, largest)


def report(timeline: Timeline, slices: int) -> None:
    steps = timeline.steps
    if not steps:
        print("no steps ran")
        return
    end = steps[-1][0] + steps[-1][1]
    table = defaultdict(lambda: [0, 0, 0, 0, 0.0])
    for _, seconds, rows, decode, prefill in steps:
        row = table[step_class(rows, prefill)]
        row[0] += 1
        row[1] += max(decode, 1)
        row[2] += rows * max(decode, 1)
        row[3] += prefill
        row[4] += seconds
    busy = sum(s[1] for s in steps)
    print(f"{len(steps)} engine steps over {end:.2f} s; between steps {end - busy:.2f} s")
    print(f"{'class':44} {'calls':>6} {'fwds':>6} {'decode tok':>11} {'prefill tok':>12} "
          f"{'s':>7} {'ms/fwd':>7}")
    for key in sorted(table):
        calls, forwards, tokens, prefill, seconds = table[key]
        print(f"{key:44} {calls:6d} {forwards:6d} {tokens:11d} {prefill:12d} {seconds:7.2f} "
              f"{seconds * 1e3 / max(forwards, 1):7.2f}")
    width = end / slices
    print(f"\nthe run in {slices} spans of {width:.2f} s: decode tok/s, prefill tok/s, calls")
    for i in range(slices):
        lo, hi = i * width, (i + 1) * width
        inside = [s for s in steps if lo <= s[0] < hi]
        dec = sum(s[2] * max(s[3], 1) for s in inside)
        pre = sum(s[4] for s in inside)
        print(f"  {lo:7.2f}-{hi:7.2f} s  {dec / width:10,.0f}  {pre / width:10,.0f}  "
              f"{len(inside):5d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser, max_decode_batch=512, requests=1024, output_len=500)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--host-kv-cache-size", type=float, default=None)
    parser.add_argument("--slices", type=int, default=12)
    parser.add_argument("--device-idle", action="store_true",
                        help="Profile the device over the timed run (CUDA): idle gaps by step.")
    parser.add_argument("--tiny", action="store_true", help="Toy widths (a CPU smoke run).")
    args = parser.parse_args()

    timeline = Timeline(args.device_idle)
    Engine.step = timeline.wrap_step(Engine.step)
    bench_module._timed_run = timeline.wrap_timed_run(bench_module._timed_run)
    Scheduler.schedule = timeline.wrap_plans(Scheduler.schedule)
    Scheduler.continue_plan = timeline.wrap_plans(Scheduler.continue_plan)
    cfg = BenchConfig(shape=args.shape, kv_dtype=args.kv_dtype,
                      max_decode_batch=args.max_decode_batch,
                      host_kv_cache_size=args.host_kv_cache_size,
                      cuda_graph_num_buckets=args.cuda_graph_num_buckets,
                      fp8_weights=args.fp8_weights, fp8_scales=args.fp8_scales, tiny=args.tiny,
                      enable_prefix_caching=not args.no_prefix_caching,
                      gpu_kv_cache_size=None if torch.cuda.is_available() else 0.05)
    result = bench(cfg, Workload(requests=args.requests, input_len=args.input_len,
                                 output_len=args.output_len,
                                 shared_prefix_len=args.shared_prefix_len,
                                 num_prefixes=args.num_prefixes, n=args.n))
    row = result["results"]["batchgen"]
    print(f"whole run: {row['output_tok_s']:,.0f} output tok/s in {row['seconds']:.2f} s")
    report(timeline, args.slices)
    if timeline.profiler is not None:
        device_idle_report(timeline)


if __name__ == "__main__":
    main()
