"""`batchgen bench`: a fixed synthetic workload on a random-init model of a real shape, through
batchgen and (with --peer hf) HF transformers `generate` on the same weights, in one process.

Prints output and total tokens/s for each, their ratio, and the fraction of the roofline
(decode reads every device weight once per step plus each sequence's KV; prefill costs
2 * active params FLOPs per token, k of E routed experts for MoE shapes), with the HBM
bandwidth measured on the spot. EOS is ignored. Shapes, random weights and HF's twin model
live in batchgen/bench_models.py.

Output lengths: fixed, or lognormal with sigma 1 whose *uncapped* mean is --output-len, draws
above --max-output-len cut to it (mean 2048, max 16384 gives ~2,015 on average; the same
distribution as `batchgen simulate`'s lognormal:mean=2048,sigma=1.0,max=16384). With
--max-tokens-mode exact every request's max_tokens is its drawn length, so the scheduler
knows every length; with cap every max_tokens is --max-output-len and the drawn length ends
the request as an EOS would (LengthStopEngine), which the scheduler cannot foresee: its host
reservations then come from the chunk and its adaptive EMA, as in a real long-tail job.

--compare-host-tier runs the same workload twice at the same device KV pool, host tier on
(the configured host pool) then off, and reports both and their ratio. The scheduler has no
switch that removes the host tier: every admitted sequence reserves host pages, which back
the sequences unloaded from the device. "Off" is therefore a host pool exactly as large as the
device pool, which is what a GPU-only engine has: the KV of all live sequences must fit in
the device's capacity, so admissions stop where the device is full, and when a growing
sequence runs out of host pages the scheduler evicts (drops its KV and re-prefills it later,
i.e. recomputes) instead of parking it. Unloads can still happen when a sequence's device
reservation (context + --initial-gpu-page-buffer pages) exceeds its host one, but the host
never holds more than the device could; the table prints both runs' loads, unloads,
evictions and recomputed tokens. The device pool is pinned to the "on" run's page count.
Both runs are greedy on the same weights, so on CPU in float32 their tokens must agree (a
sha256 over every request's tokens is compared); on CUDA the two runs batch differently and
bf16 rounds differently.
"On" runs first, so any warm-up cost (kernel JIT) is charged to it, not to the claim.

Triton compiles each kernel variant on its first launch in a process (seconds on a fresh
machine, a disk-cache read later). The untimed warm-up meets most variants; the report counts
those first launched inside the timed run, so a short benchmark polluted by JIT says so.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, replace

import torch

from batchgen.bench_config import BenchConfig, Workload
from batchgen.bench_models import (
    SHAPES,
    hf_config_for,
    hf_twin,
    random_model,
    stand_in_model,
    weight_stats,
)
from batchgen.bench_tp import bench_tensor_parallel
from batchgen.config import EngineConfig
from batchgen.core import FinishReason, Request
from batchgen.engine.engine import Engine
from batchgen.engine.heap import frozen_heap
from batchgen.engine.precompile import CompileWorkers, triton_cache_hook
from batchgen.engine.runner import precompile_stand_in
from batchgen.parallel import TensorParallel, pick_device, require_device
from batchgen.phases import StartupClock

log = logging.getLogger("batchgen.bench")

__all__ = ["SHAPES", "BenchConfig", "LengthStopEngine", "Workload", "bench", "hf_config_for",
           "host_tier_off", "random_model"]

PEAK_BF16_FLOPS = {"cuda": 790e12, "cpu": 1e11}
"""Dense bf16 FLOP/s used for the prefill term (H200 measured; CPU a rough placeholder)."""


class LengthStopEngine(Engine):
    """An engine whose requests stop after a length only the bench knows, as a model's EOS
    would (a random model's own EOS cannot be placed): the scheduler sees only max_tokens."""

    def __init__(self, *args, stop_after: dict[str, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_after = stop_after

    def _finish_reason(self, seq, token):
        if seq.num_decoded + 1 >= self.stop_after[seq.request_id]:  # `token` not appended yet
            return FinishReason.STOP, None
        return super()._finish_reason(seq, token)


def measure_hbm_bandwidth(device: torch.device) -> float:
    """Read+write bytes/s of a large device-to-device copy."""
    if device.type != "cuda":
        return 20e9
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def roofline_seconds(stats: dict, layout, work: Workload, outputs: list[int], batch: int,
                     bandwidth: float, device: torch.device) -> float:
    """Lower bound on the job's time: prefill FLOPs at peak + decode bytes at HBM bandwidth."""
    prefill_tokens = work.input_len * work.requests
    prefill = 2 * stats["active_params"] * prefill_tokens / PEAK_BF16_FLOPS[device.type]
    steps = sum(outputs) / min(batch, work.requests)
    kv_read = sum(o * (work.input_len + o / 2) for o in outputs) * layout.bytes_per_token
    return prefill + (steps * stats["device_bytes"] + kv_read) / bandwidth


def run_ours(model, engine_cfg: EngineConfig, work: Workload,
             tp: TensorParallel = TensorParallel(), compile_workers=None) -> dict:
    prompts, outputs = work.prompts(model.config.vocab_size), work.lengths()
    ids = [f"b{i}" for i in range(work.requests)]
    # Every choice of every request holds its whole context at once, at worst.
    demand = work.n * sum(work.input_len + out for out in outputs)
    if work.max_tokens_mode == "cap":
        engine = LengthStopEngine(model, engine_cfg, tp=tp, stop_after=dict(zip(ids, outputs)),
                                  demand_tokens=demand, compile_workers=compile_workers)
    else:
        engine = Engine(model, engine_cfg, tp=tp, demand_tokens=demand,
                        compile_workers=compile_workers)
    startup = dict(engine.runner.startup)
    with triton_variants_first_used() as warm_variants:
        warmup_s = warm_up(engine, model, work, engine_cfg.scheduler.max_prefill_tokens)
    with frozen_heap():  # as a job's worker: no collection re-scans the startup objects
        elapsed, produced, digests, variants = _timed_run(engine, model, ids, prompts, outputs,
                                                          work)
        stats = engine.stats()
        stats["host_pool_pin"] = engine.runner.host_pin_state()
        layout = engine.layout
        engine.close()
    stats["triton_variants_in_timed_run"] = len(variants) if variants is not None else None
    # One string: the report keeps scalars only.
    stats["triton_variants_first_launched"] = " | ".join(variants[:8]) if variants else ""
    if variants:  # what the warm-up launched of the same kernels: the specialisations differ
        kernels = {v.split("[")[0] for v in variants}
        stats["triton_variants_of_warm_up"] = " | ".join(
            v for v in warm_variants or () if v.split("[")[0] in kernels)
    stager = getattr(model, "expert_stager", None)
    if stager is not None:  # offloaded experts copied in during the timed run (and warm-up)
        stats["expert_copies"] = {"fetches": stager.fetches, "experts": stager.copied_experts,
                                  "bytes": stager.copied_bytes}
    # Said at once: a long comparison killed before its table still leaves this half's result.
    log.info("timed run: %d output tokens in %.1f s = %.0f output tok/s (%d steps)", produced,
             elapsed, produced / elapsed, stats.get("steps", 0))
    tokens_sha256 = hashlib.sha256(b"".join(digests[rid] for rid in ids)).hexdigest()
    return {"seconds": elapsed, "output_tokens": produced, "stats": stats, "warmup_s": warmup_s,
            "startup": startup,
            "layout": layout, "outputs": outputs, "tokens_sha256": tokens_sha256}


def _timed_run(engine: Engine, model, ids: list[str], prompts: list, outputs: list[int],
               work: Workload) -> tuple[float, int, dict[str, bytes], list[str] | None]:
    """Serve the workload: (seconds, output tokens, token digest per request, Triton variants
    first launched meanwhile)."""
    answers: dict[str, list[list[int]]] = {}
    sync(model)
    start = time.perf_counter()
    with triton_variants_first_used() as variants:
        for rid, prompt, out in zip(ids, prompts, outputs):
            engine.add_request(Request(rid, prompt, work.sampling(out)))
        while engine.has_unfinished():
            for done in engine.step():
                answers[done.request_id] = [c.token_ids for c in done.completions]
        sync(model)
    seconds = time.perf_counter() - start
    # Hashed once the clock stops: a wave of answers finishing together took ~25 ms of host
    # time to hash, which the device waited for.
    digests = {rid: hashlib.sha256(str(tokens).encode()).digest()
               for rid, tokens in answers.items()}
    produced = sum(len(t) for tokens in answers.values() for t in tokens)
    return seconds, produced, digests, variants


@contextmanager
def triton_variants_first_used():
    """Name the Triton kernel variants first launched in this process inside the block (each
    is compiled then, or read from Triton's disk cache): yields the list they are appended to
    (kernel name and launch options as Triton states them, then its specialization data:
    argument types, alignments and constexprs), or None where Triton has no runtime hooks
    (triton.knobs, 3.4+)."""
    seen: list[str] = []

    def counting(previous):
        def count(*args, **kwargs):
            spec = (kwargs.get("compile") or {}).get("specialization_data", "")
            seen.append(f"{kwargs.get('repr', '?')} {spec}".strip()[:8000])
            return previous(*args, **kwargs) if previous else False  # False: compile as usual
        return count

    with triton_cache_hook(counting) as hooked:
        yield seen if hooked else None


def warm_up(engine: Engine, model, work: Workload, prefill_tokens: int) -> float:
    """Run a little of the workload untimed, then reset the engine's counters: Triton compiles
    each kernel variant on first use (seconds per variant on a fresh machine), a one-time cost
    of a job that would otherwise land in a short benchmark. Two full prefill steps and a few
    decode bursts, shaped like the workload (its shared prefixes and n, so the shared-prefix
    kernels compile here too) but on other tokens, then, for a workload whose rows share
    prefixes, every shared-prefix CUDA graph; the prefix cache is emptied after it.
    Returns its seconds."""
    begin = time.perf_counter()
    count = min(work.requests, 2 * -(-prefill_tokens // work.input_len) + 1)
    prompts = replace(work, requests=count, seed=work.seed + 7).prompts(model.config.vocab_size)
    length = min(work.output_len, 24)
    for i, prompt in enumerate(prompts):
        if isinstance(engine, LengthStopEngine):
            engine.stop_after[f"warmup{i}"] = length
        engine.add_request(Request(f"warmup{i}", prompt, work.sampling(length)))
    while engine.has_unfinished():
        engine.step()
    graphs = engine.runner.graphs
    shares = (work.shared_prefix_len or work.n > 1) and engine.scheduler.prefix is not None
    if shares and graphs is not None and getattr(model, "shared_prefix_decode", False):
        graphs.capture_grouped()  # a job captures each when it first decodes such a batch
    sync(model)
    engine.scheduler.clear_prefix_cache()
    engine.reset_stats()
    return time.perf_counter() - begin


def host_tier_off(engine_cfg: EngineConfig, device_pages: int, layout) -> EngineConfig:
    """`engine_cfg` with both pools `device_pages` pages: no host room beyond what the device
    holds (see the module docstring). Half a page of slack keeps the GB -> pages floor exact."""
    size_gb = (device_pages + 0.5) * layout.bytes_per_page / 1e9
    memory = replace(engine_cfg.memory, gpu_kv_cache_size=size_gb, host_kv_cache_size=size_gb)
    return replace(engine_cfg, memory=memory).validate()


def run_hf_peer(model, hf_config, work: Workload, batch: int) -> dict:
    """HF `generate` on static batches of the same requests, on our weights (`hf_twin`)."""
    device = next(model.parameters()).device
    free_kv_memory(device)  # our engine's KV pools: give their memory back before HF's cache
    hf = hf_twin(model, hf_config)
    prompts, outputs = work.prompts(hf_config.vocab_size), work.lengths()
    sync(model)
    start = time.perf_counter()
    produced = 0
    for first in range(0, work.requests, batch):
        chunk = torch.tensor(prompts[first:first + batch], device=device)
        longest = max(outputs[first:first + batch])
        with torch.inference_mode():
            hf.generate(chunk, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                        pad_token_id=0, eos_token_id=None)
        produced += sum(outputs[first:first + batch])
    sync(model)
    del hf
    return {"seconds": time.perf_counter() - start, "output_tokens": produced}


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def free_kv_memory(device: torch.device) -> None:
    """Return a closed engine's pools to the device before the next one allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench(cfg: BenchConfig, work: Workload, tp: TensorParallel | None = None) -> dict:
    """The report of one benchmark. `tp`: this rank's group, inside a tensor-parallel run
    (bench_tp.py starts the ranks when cfg.tensor_parallel_size > 1 and none is given)."""
    from batchgen.models.loader import resolve_dtype

    work.validate()
    engine_cfg = cfg.engine_config()  # the flags checked before any rank starts
    require_device(cfg.device)
    if tp is None and cfg.tensor_parallel_size > 1:
        return bench_tensor_parallel(bench, cfg, work)
    tp = tp or TensorParallel()
    clock = StartupClock()
    clock.mark("process")
    device = pick_device(cfg.device)
    clock.mark("choose_device")  # the GPU count: the driver's start, where it was not up yet
    dtype = resolve_dtype(cfg.dtype, device)
    hf_config = cfg.hf_config()
    clock.mark("config")
    compile_workers = _precompile(hf_config, dtype, device, engine_cfg, tp, clock)
    model = random_model(hf_config, dtype, device, engine_cfg.model, tp=tp)
    stats = weight_stats(model)
    clock.mark("weights")
    ours = run_ours(model, engine_cfg, work, tp, compile_workers)
    timed_end = clock.since_origin()
    bandwidth = measure_hbm_bandwidth(device)
    bound = roofline_seconds(stats, ours["layout"], work, ours["outputs"], cfg.max_decode_batch,
                             bandwidth, device)
    rows = {"batchgen": _row(ours, work, bound)}
    report = {"config": asdict(cfg), "workload": asdict(work), "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "weights": stats,
              "hbm_bytes_per_s": bandwidth, "roofline_seconds": bound, "results": rows,
              "kv_bytes_per_page": ours["layout"].bytes_per_page,
              "tokens_sha256": ours["tokens_sha256"], "engine_stats": _scalars(ours["stats"]),
              "warmup_seconds": ours["warmup_s"],
              "startup": _startup(clock, ours, timed_end)}
    _compare(cfg, work, tp, model, engine_cfg, ours, report)
    if cfg.peer == "hf":
        peer = run_hf_peer(model, hf_config, work, cfg.peer_batch)
        rows["hf_generate"] = _row(peer, work)
        rows["ratio"] = rows["batchgen"]["output_tok_s"] / rows["hf_generate"]["output_tok_s"]
    return report


def _precompile(hf_config, dtype: torch.dtype, device: torch.device, engine_cfg: EngineConfig,
                tp: TensorParallel, clock: StartupClock) -> CompileWorkers | None:
    """On CUDA: Triton's compile processes, started before this process touches the GPU, and
    (one rank) the stand-in's pass that hands them the variants to build while the weights
    are drawn (engine/precompile.py). None on other devices."""
    if device.type != "cuda":
        return None
    workers = CompileWorkers(device=device)
    clock.mark("workers")
    torch.empty(1, device=device)  # creates CUDA's context: timed as its own phase
    clock.mark("device")
    if tp.size == 1:
        precompile_stand_in(lambda: stand_in_model(hf_config, dtype, device, engine_cfg.model),
                            engine_cfg, workers)
        clock.mark("precompile")
    return workers


def _compare(cfg: BenchConfig, work: Workload, tp: TensorParallel, model,
             engine_cfg: EngineConfig, ours: dict, report: dict) -> None:
    """The reruns --compare-host-tier and --compare-prefix-caching ask for, into `report`: each
    a row beside "batchgen" and a section with the ratio and whether the tokens agree."""
    rows, bound = report["results"], report["roofline_seconds"]
    device = next(model.parameters()).device
    if cfg.compare_host_tier:
        free_kv_memory(device)
        off = run_ours(model, host_tier_off(engine_cfg, ours["stats"]["device_pages"],
                                            ours["layout"]), work, tp)
        rows["host_tier_off"] = _row(off, work, bound)
        report["host_tier"] = {
            "ratio": rows["batchgen"]["output_tok_s"] / rows["host_tier_off"]["output_tok_s"],
            "same_tokens": ours["tokens_sha256"] == off["tokens_sha256"],
            "on": {"tokens_sha256": ours["tokens_sha256"], **_scalars(ours["stats"])},
            "off": {"tokens_sha256": off["tokens_sha256"], **_scalars(off["stats"])}}
    if cfg.compare_prefix_caching:
        from batchgen.bench_prefix import caching_off, comparison

        free_kv_memory(device)
        off = run_ours(model, caching_off(engine_cfg), work, tp)
        rows["prefix_caching_off"] = _row(off, work, bound)
        report["prefix_caching"] = comparison(ours, off, rows["batchgen"],
                                              rows["prefix_caching_off"])


def _startup(clock: StartupClock, ours: dict, timed_end: float) -> dict:
    """Seconds from the process start to the end of batchgen's timed run, by phase: process
    start and imports, weights, host pool, CUDA graphs, warm-up, timed run."""
    phases = clock.durations()
    phases.update({name: round(seconds, 3) for name, seconds in ours["startup"].items()})
    phases["warm_up"] = round(ours["warmup_s"], 3)
    phases["timed_run"] = round(ours["seconds"], 3)
    # What the engine's start did apart from the pools and graphs (e.g. pool planning).
    phases["engine_other"] = round(max(0.0, timed_end - sum(phases.values())), 3)
    return {"phases": phases, "whole_seconds": round(timed_end, 3),
            "whole_over_timed": round(timed_end / max(ours["seconds"], 1e-9), 3)}


def _row(run: dict, work: Workload, bound: float | None = None) -> dict:
    """A report row: tokens/s and seconds, and the fraction of the roofline `bound` (seconds)
    reached when given."""
    total_in = work.requests * work.input_len  # prompt tokens, cached ones included
    row = {"output_tok_s": run["output_tokens"] / run["seconds"],
           "total_tok_s": (run["output_tokens"] + total_in) / run["seconds"],
           "seconds": run["seconds"], "output_tokens": run["output_tokens"]}
    if bound is not None:
        row["roofline_fraction"] = bound / run["seconds"]
    return row


def _scalars(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not isinstance(v, list)}
