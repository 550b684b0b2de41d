"""Start-up that scales with the job: pools sized from what the job can use, CPU pools that
cost memory only as they fill, and the start-up phases reported (the host pool's pinning as
it fills: test_host_pin.py)."""

import json
import time

import pytest
import torch

from batchgen.config import MemoryConfig
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.engine.memory import CPU_DEVICE_POOL_BYTES, job_demand_tokens, plan_pools
from batchgen.phases import StartupClock, format_phases, process_start_time
from batchgen.engine import host_pool
from batchgen.engine.host_pool import HostSegment, lazy_zeros

from job_utils import batchgen, chat_rows, write_jsonl

LAYOUT = KVLayout(4, (2, 2, 16), torch.float32, torch.float32)
CPU = torch.device("cpu")


def test_default_pools_follow_the_jobs_demand():
    demand = job_demand_tokens(requests=3, in_flight_cap=10240, tokens_per_request=1000)
    assert demand == 3000
    sizes = plan_pools(MemoryConfig(), LAYOUT, 0, CPU, demand_tokens=demand)
    pages = -(-3000 // 64)
    assert sizes.host_pages == pages and sizes.device_pages == pages
    # Without a demand the old defaults hold: the CPU "device" pool is 2 GiB.
    unbounded = plan_pools(MemoryConfig(), LAYOUT, 0, CPU)
    assert unbounded.device_pages == LAYOUT.pages_for_bytes(CPU_DEVICE_POOL_BYTES)


def test_the_pool_log_line_gives_tiny_pools_in_readable_units(caplog):
    """A tiny job's pools are a few hundred kB: the log says so, not '0.00 GB'."""
    with caplog.at_level("INFO", logger="batchgen.memory"):
        plan_pools(MemoryConfig(), LAYOUT, 0, CPU, demand_tokens=200)
    line = next(r.getMessage() for r in caplog.records if "KV pools" in r.getMessage())
    # 4 pages of 4 layers x 2 x 2 heads x 16 x 64 tokens x 4 bytes = 65.5 kB each
    assert line == ("KV pools: device 4 pages (262.1 kB), host 4 pages (262.1 kB), "
                    "65.5 kB per page")


def test_in_flight_requests_are_capped_by_the_intake():
    assert job_demand_tokens(requests=1_000_000, in_flight_cap=256, tokens_per_request=10) == 2560
    assert job_demand_tokens(requests=0, in_flight_cap=256, tokens_per_request=10) == 10


def test_explicit_sizes_are_kept_exactly_whatever_the_demand():
    cfg = MemoryConfig(host_kv_cache_size=0.01, gpu_kv_cache_size=0.02)
    sizes = plan_pools(cfg, LAYOUT, 0, CPU, demand_tokens=64)
    assert sizes.host_pages == LAYOUT.pages_for_bytes(0.01e9)
    assert sizes.device_pages == LAYOUT.pages_for_bytes(0.02e9)


def test_demand_never_exceeds_the_machines_cap(monkeypatch):
    monkeypatch.setattr("batchgen.engine.memory.auto_host_pool_bytes", lambda model: 10 * 2**20)
    sizes = plan_pools(MemoryConfig(), LAYOUT, 0, CPU, demand_tokens=10**9)
    assert sizes.host_pages == LAYOUT.pages_for_bytes(10 * 2**20)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_lazy_pool_costs_memory_only_for_pages_used():
    before = _rss()
    raw = lazy_zeros(1 << 30)  # 1 GiB of address space
    assert _rss() - before < 64 << 20
    shape = (1024, 4, 64, 2, 2, 16)
    pool = KVPool(KVLayout(4, (2, 2, 16), torch.float32, torch.float32), 1024, CPU,
                  data=raw[: 1024 * 4 * 64 * 64 * 4].view(torch.float32).view(shape))
    assert float(pool.data[7].abs().sum()) == 0.0  # reads as zeros, like torch.zeros
    pool.store(0, torch.tensor([5]), torch.ones(1, 2, 2, 16))
    assert float(pool.data[0, 0, 5].sum()) == 64.0
    assert _rss() - before < 64 << 20


def test_prefault_keeps_contents():
    segment = HostSegment(3 * host_pool.PREFAULT_SLICE // 2)
    try:
        segment.tensor[::4096] = 7
        segment.prefault(4096, segment.num_bytes, workers=2)  # runs past the end: clipped
        assert int(segment.tensor[::4096].min()) == 7 and int(segment.tensor[1::4096].max()) == 0
    finally:
        segment.close()


def test_clock_phases_in_order_from_process_start():
    origin = process_start_time()
    assert time.time() - 7 * 86400 < origin <= time.time()
    clock = StartupClock(origin=100.0)
    clock.mark("weights", at=103.0)
    clock.mark("process", at=101.5)
    clock.mark("graphs", at=103.25)
    clock.mark("process", at=200.0)  # the first end is kept
    assert list(clock.durations().items()) == [("process", 1.5), ("weights", 1.5),
                                               ("graphs", 0.25)]
    assert format_phases({"host_pool": 1.25}) == "host pool 1.2 s"


@pytest.mark.slow
def test_run_reports_its_startup_phases(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3, max_tokens=4))
    proc = batchgen("run", "--input", inp, "--storage-path", tmp_path / "s", "--model",
                    tiny_chat_model, check=True)
    line = next(line for line in proc.stderr.splitlines() if "start-up:" in line)
    names = [part.strip().rsplit(" ", 2)[0] for part in line.split("start-up:")[1]
             .split(";")[0].split(",")]
    assert names[:4] == ["launch", "process", "config", "weights"], line
    assert "whole run" in line
    batch = next(p for p in (tmp_path / "s" / "batches").glob("*.json") if p.name.count(".") == 1)
    phases = json.loads(batch.read_text())["timings"]["startup"]
    assert {"launch", "process", "weights", "host_pool", "first_token"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
