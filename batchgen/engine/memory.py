"""How many KV pages each tier gets."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.config import MemoryConfig
from batchgen.core import human_bytes
from batchgen.engine.kv_cache import KVLayout
from batchgen.engine.host_pool import auto_host_pool_bytes

log = logging.getLogger("batchgen.memory")
CPU_DEVICE_POOL_BYTES = 2 * 2**30
"""Default "device" pool when running on CPU (no --gpu-kv-cache-size)."""
ACTIVATION_RESERVE = 0.05
"""Share of device memory kept free for activations and graphs."""


def detect_gpu_arch(hint: str, device: torch.device) -> str:
    """--gpu-arch: the hint if given, else from the device's compute capability."""
    if hint != "auto":
        return hint
    if device.type != "cuda":
        return "cpu"
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "hopper", 8: "ampere"}.get(major, f"sm{major}x")


class PoolTooSmall(ValueError):
    pass


@dataclass(frozen=True)
class PoolSizes:
    device_pages: int
    host_pages: int


def plan_pools(cfg: MemoryConfig, layout: KVLayout, model_bytes: int,
               device: torch.device, host_share: float = 1.0,
               demand_tokens: int | None = None) -> PoolSizes:
    """Pages of each tier. --host-kv-cache-size (and the auto size) is per node: a worker
    gets `host_share` of it (1 / workers on the node).

    `demand_tokens`: the most KV tokens this worker's job can hold at once (requests it may
    keep in flight x tokens each may reach). Pools left to their default are no larger than
    that: a small job pins (and, on CPU, commits) only what it can use. Explicit sizes are
    kept exactly."""
    demand = None if demand_tokens is None else max(1, demand_tokens) * layout.bytes_per_token
    if cfg.gpu_kv_cache_size is not None:
        device_bytes = cfg.gpu_kv_cache_size * 1e9
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        device_bytes = total * (cfg.gpu_memory_frac - ACTIVATION_RESERVE) - model_bytes
    else:
        device_bytes = _capped(CPU_DEVICE_POOL_BYTES, demand, layout)
    if cfg.host_kv_cache_size is not None:
        host_bytes = cfg.host_kv_cache_size * 1e9 * host_share
    else:
        host_bytes = _capped(auto_host_pool_bytes(model_bytes) * host_share, demand, layout)
    sizes = PoolSizes(layout.pages_for_bytes(device_bytes), layout.pages_for_bytes(host_bytes))
    page_mb = layout.bytes_per_page / 1e6
    device_flags = "--gpu-kv-cache-size or --gpu-memory-frac"
    for name, pages, flag in (("device", sizes.device_pages, device_flags),
                              ("host", sizes.host_pages, "--host-kv-cache-size")):
        if pages < 1:
            raise PoolTooSmall(f"the {name} KV pool holds no page: one 64-token page of this model "
                               f"needs {page_mb:.2f} MB; raise {flag}")
    log.info("KV pools: device %d pages (%s), host %d pages (%s), %s per page",
             sizes.device_pages, human_bytes(sizes.device_pages * layout.bytes_per_page),
             sizes.host_pages, human_bytes(sizes.host_pages * layout.bytes_per_page),
             human_bytes(layout.bytes_per_page))
    return sizes


def _capped(default_bytes: float, demand_bytes: float | None, layout: KVLayout) -> float:
    """A default pool size no larger than the job's demand (rounded up to a whole page)."""
    if demand_bytes is None:
        return default_bytes
    return min(default_bytes, -(-demand_bytes // layout.bytes_per_page) * layout.bytes_per_page)


def job_demand_tokens(requests: int, in_flight_cap: int, tokens_per_request: int) -> int:
    """KV tokens a worker can hold at once: the requests it may keep in flight (its share of
    the job, at most `in_flight_cap`) times the context each may reach."""
    return max(1, min(requests, in_flight_cap)) * max(1, tokens_per_request)
