"""W2 in `batchgen simulate`: host tier on vs off at equal device memory, on the cost model of
one H200 (Llama-3-8B shape, bf16 KV, --gpu-memory-frac 0.3, 100 GB host pool), 512-token
prompts, lognormal outputs (mean 2048, sigma 1) cut at --max-output, max_tokens = that cut.
"Off" is a host pool of exactly the device pool's pages, as in `batchgen bench
--compare-host-tier`. Minutes for 1,024 requests on a laptop core.

    python benchmarks/w2_simulate.py --requests 160 --max-output 7680
    python benchmarks/w2_simulate.py --requests 1024 --no-adaptive-buffer --initial-buffer 4
"""

from __future__ import annotations

import argparse
import dataclasses

from batchgen.config import SchedulerConfig
from batchgen.simulate import SimulationConfig, run_simulation

KV_BYTES_PER_TOKEN = 131072
"""Llama-3-8B, bf16: 32 layers x 2 x 8 KV heads x 128 x 2 bytes."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=7680)
    parser.add_argument("--initial-buffer", type=int, default=32)
    parser.add_argument("--no-adaptive-buffer", action="store_true")
    parser.add_argument("--max-decode-batch", type=int, default=256)
    args = parser.parse_args()
    sim = SimulationConfig(model="llama3-8b", gpu_memory_gb=141, gpu_memory_frac=0.3,
                           host_kv_gb=100, num_requests=args.requests, prompt_len="fixed:512",
                           output_len=f"lognormal:mean=2048,sigma=1.0,max={args.max_output}",
                           max_tokens=args.max_output, seed=0)
    sched = SchedulerConfig(max_decode_batch=args.max_decode_batch,
                            initial_gpu_page_buffer=args.initial_buffer,
                            adaptive_gpu_page_buffer=not args.no_adaptive_buffer)
    on = run_simulation(sim, sched)
    device_gb = (on.device_pages + 0.5) * 64 * KV_BYTES_PER_TOKEN / 1e9
    off = run_simulation(dataclasses.replace(sim, host_kv_gb=device_gb), sched)
    assert off.host_pages == on.device_pages, (off.host_pages, on.device_pages)
    for name, r in (("on", on), ("off", off)):
        print(f"{name:4} {r.output_tok_s:8,.0f} out tok/s  device pages {r.device_pages:,}  "
              f"host pages {r.host_pages:,}  loads {r.loads:,}  evictions {r.evictions:,}  "
              f"device use {r.device_util:.0%}")
    print(f"host tier on / off: {on.output_tok_s / off.output_tok_s:.2f}x")


if __name__ == "__main__":
    main()
