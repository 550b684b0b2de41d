"""`batchgen simulate`: the real Scheduler driven by a cost model instead of a model.

Each data-parallel replica runs its own Scheduler over its share of the requests (split as a job's
replicas split it: io/prefix_shards.py),
through the same step contract as the engine: `schedule()` gives a plan, the simulator "runs"
it by advancing a clock by `CostModel.step` (see cost_model.py), and hands the results back with
`update_from_output` (one token per sampled chunk; a sequence whose output reached its length
finishes). Token values matter to the scheduler only through the prefix cache's keys, so a
`SyntheticTokens` stands in for each token list: its shared prefix, then tokens of its own.

Speed: between decisions the decode set is fixed, so a decode-only plan asks the scheduler for as
many steps back to back as no sequence finishes before the last (the engine's decode bursts),
and they are costed and applied in one go instead of calling `schedule()` once per token;
`tests/test_simulate.py` checks the result is identical to stepping.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE, SamplingParams
from batchgen.io.prefix_shards import assign_replicas
from batchgen.sched.decode_groups import saved_page_reads
from batchgen.sched.scheduler import Scheduler
from batchgen.sched.sequence import Sequence
from batchgen.sched.step import ScheduleOutput, SeqChunk, SeqResult, StepOutput
from batchgen.simulate.config import (
    SimulationConfig, build_cost_model, load_workload, pool_pages, prefix_choices)
from batchgen.simulate.cost_model import CostModel, StepTime


@dataclass
class Timeline:
    """Gauges sampled at evenly spaced simulated times (summed over replicas)."""

    time_s: list[float] = field(default_factory=list)
    device_pages_used: list[float] = field(default_factory=list)
    host_pages_used: list[float] = field(default_factory=list)
    decode_batch: list[float] = field(default_factory=list)
    output_tok_s: list[float] = field(default_factory=list)


class SyntheticTokens:
    """Stands in for a sequence's token list: position p holds `prefix + p` below
    `shared_len` (equal in requests of one prefix), `own + p` after it (unique)."""

    def __init__(self, count: int, prefix: int, shared_len: int, own: int):
        self.count = count
        self.prefix, self.shared_len, self.own = prefix, shared_len, own

    def __len__(self) -> int:
        return self.count

    def extend(self, tokens) -> None:
        self.count += len(tokens)

    def __getitem__(self, where: slice) -> list[int]:
        start, stop, _ = where.indices(self.count)
        return [(self.prefix if p < self.shared_len else self.own) + p
                for p in range(start, stop)]


class _Replica:
    """One Scheduler over its requests, advanced by the cost model."""

    def __init__(self, sim: SimulationConfig, cfg: SchedulerConfig, cost: CostModel,
                 pages: tuple[int, int], lengths: tuple[np.ndarray, ...]):
        """`lengths`: prompt lengths, output lengths, max_tokens, prefix and request number
        of each request."""
        self.sched = Scheduler(cfg, *pages)
        self.cost = cost
        self.fast_forward = sim.fast_forward
        self.targets = lengths[1].tolist()
        params: dict[int, SamplingParams] = {}
        rows = zip(lengths[0].tolist(), lengths[2].tolist(), lengths[3].tolist(), lengths[4])
        for i, (prompt, budget, prefix, key) in enumerate(rows):
            sampling = params.setdefault(budget, SamplingParams(max_tokens=budget))
            # A prompt shorter than the shared prefix is all prefix, but what it generates is
            # its own: a longer shared_len would make every such request's answer the same
            # tokens, whose pages the prefix cache would then share between requests.
            tokens = SyntheticTokens(prompt, (prefix + 1) << 40,
                                     min(sim.shared_prefix_len, prompt),
                                     (sim.num_prefixes + 1 + key) << 40)
            self.sched.add(Sequence(i, str(i), 0, tokens, prompt, sampling, 0))  # type: ignore
        self.clock = 0.0
        self.time = StepTime()
        self.output_tokens = 0
        self.steps = 0
        self.peak_admitted = 0
        self.batch_seconds = 0.0
        self.device_page_seconds = 0.0
        self.host_page_seconds = 0.0
        self.trace = {name: array("d") for name in ("t", "device", "host", "batch", "tokens")}

    def run(self) -> _Replica:
        idle = 0
        while self.sched.has_work:
            idle = 0 if self._step() else idle + 1
            if idle > 3:  # a stalled scheduler would otherwise loop forever at a frozen clock
                raise RuntimeError(f"the scheduler made no progress: {self.sched.counters}")
        return self

    def _left(self, chunks: list[SeqChunk]) -> int:
        """Decode steps until the first of these rows reaches its output length."""
        return min(self.targets[c.seq.seq_id] - c.seq.num_decoded for c in chunks)

    def _step(self) -> bool:
        """One plan, its cost, and its results; False when nothing happened."""
        plan = self.sched.schedule(self._left if self.fast_forward else None)
        admitted = len(self.sched.running) + len(self.sched.swapped)
        self.peak_admitted = max(self.peak_admitted, admitted)
        self._cost_single(plan)  # the first step, with the plan's page copies
        if plan.steps > 1:  # the rest of a decode run, costed at once
            batch, more = len(plan.chunks), plan.steps - 1
            context = sum(c.end for c in plan.chunks) + batch - self._shared_reads(plan)
            self.output_tokens += batch * more
            self._advance(self.cost.decode_run(batch, context, more), batch, more)
        results = [SeqResult(c, (0,) * plan.steps, None,
                             c.seq.num_decoded + plan.steps >= self.targets[c.seq.seq_id])
                   for c in plan.chunks if c.sample]
        self.sched.update_from_output(plan, StepOutput(results))
        return bool(plan.chunks or plan.swap_in or plan.swap_out)

    def _cost_single(self, plan: ScheduleOutput) -> None:
        tokens = decode = 0
        pairs = kv_read = 0.0
        for c in plan.chunks:
            tokens += c.end - c.start
            pairs += (c.end * (c.end + 1) - c.start * (c.start + 1)) / 2  # token i sees i + 1
            kv_read += c.end
            decode += c.sample and c.end - c.start == 1
        if plan.decode_only:
            kv_read -= self._shared_reads(plan)
        cost = self.cost.step(tokens, pairs, kv_read, sum(len(p.src) for p in plan.swap_out),
                              sum(len(p.src) for p in plan.swap_in))
        self.output_tokens += sum(c.sample for c in plan.chunks)
        self._advance(cost, decode, 1)

    def _shared_reads(self, plan: ScheduleOutput) -> int:
        """KV tokens a decode step of `plan` does not read again: its groups' shared prefixes
        are read once per group (models with GQA caches; an MLA latent keeps its own kernel)."""
        if not plan.shares or not self.cost.shape.kv_shards_over_tp:
            return 0
        return saved_page_reads(plan.chunks, plan.shares) * PAGE_SIZE

    def _advance(self, cost: StepTime, decode_batch: int, steps: int) -> None:
        self.time.add(cost)
        self.clock += cost.total
        self.steps += steps
        self.batch_seconds += decode_batch * cost.total
        self.device_page_seconds += self.sched.device.num_used * cost.total
        self.host_page_seconds += self.sched.host.num_used * cost.total
        for name, value in (("t", self.clock), ("device", self.sched.device.num_used),
                            ("host", self.sched.host.num_used), ("batch", decode_batch),
                            ("tokens", self.output_tokens)):
            self.trace[name].append(value)


@dataclass
class SimulationResult:
    requests: int
    replicas: int
    prompt_tokens: int
    output_tokens: int
    total_time_s: float
    """Simulated time until the slowest replica finished."""
    output_tok_s: float
    total_tok_s: float
    """(prompt + output tokens) per second."""
    evictions: int
    recomputed_tokens: int
    """Tokens re-prefilled after evictions."""
    cached_prompt_tokens: int
    """Prompt tokens whose KV the prefix cache held (not computed) at first admission."""
    loads: int
    unloads: int
    chunk_growths: int
    transfer_gb: float
    """Host<->device traffic per GPU, both directions."""
    transfer_s: float
    """PCIe busy time of the slowest replica."""
    exposed_transfer_s: float
    """Part of transfer_s the forward did not hide."""
    comm_s: float
    compute_util: float
    """FLOPs done / (time * gpu_tflops), over all GPUs."""
    hbm_util: float
    device_pages: int
    host_pages: int
    device_util: float
    """Time-averaged share of device pages in use."""
    host_util: float
    peak_device_pages: int
    peak_host_pages: int
    peak_admitted: int
    """Most sequences admitted at once (running + swapped) in one replica."""
    mean_decode_batch: float
    steps: int
    decisions: int
    final_chunk_tokens: int
    wall_s: float
    """Real seconds the simulation took."""
    timeline: Timeline
    layout: str = ""
    """TP x DP over nodes, e.g. "TP 16 x DP 1 on 2 nodes (each TP group spans 2 nodes)"."""

    def summary(self) -> str:
        lines = [
            (f"{self.requests} requests on {self.replicas} replica(s) ({self.layout}): "
             f"{self.output_tok_s:,.0f} "
             f"output tok/s ({self.total_tok_s:,.0f} total), {self.total_time_s:,.1f} s simulated"),
            (f"prefix cache: {self.cached_prompt_tokens:,} of {self.prompt_tokens:,} prompt tokens "
             f"reused ({self.cached_prompt_tokens / max(1, self.prompt_tokens):.0%})"),
            (f"evictions {self.evictions}, recomputed tokens {self.recomputed_tokens:,}, loads "
             f"{self.loads}, unloads {self.unloads}, chunk growths {self.chunk_growths}"),
            (f"transfers {self.transfer_gb:,.1f} GB/GPU, {self.transfer_s:,.1f} s busy, "
             f"{self.exposed_transfer_s:,.1f} s exposed; all-reduce {self.comm_s:,.1f} s"),
            (f"utilisation: compute {self.compute_util:.0%}, HBM {self.hbm_util:.0%}, device pages "
             f"{self.device_util:.0%} (peak {self.peak_device_pages}/{self.device_pages}), "
             f"host pages {self.host_util:.0%} (peak {self.peak_host_pages}/{self.host_pages})"),
            (f"mean decode batch {self.mean_decode_batch:.1f}, peak admitted {self.peak_admitted}, "
             f"final chunk {self.final_chunk_tokens} tokens, {self.steps:,} steps, "
             f"{self.decisions:,} decisions, simulated in {self.wall_s:.1f} s"),
        ]
        return "\n".join(lines)


def run_simulation(sim: SimulationConfig, sched_cfg: SchedulerConfig) -> SimulationResult:
    """Simulate the workload of `sim` under the scheduler flags `sched_cfg`."""
    sim.validate()
    sched_cfg.validate()
    started = time.perf_counter()
    cost = build_cost_model(sim)
    pages = pool_pages(sim, cost)
    prompts, outputs, budgets = load_workload(sim)
    prefixes, numbers = prefix_choices(sim, len(prompts)), np.arange(len(prompts))
    dp = sim.world_size // sim.tensor_parallel
    owner = replica_of(sim, prefixes, dp)
    replicas = [_Replica(sim, sched_cfg, cost, pages,
                         tuple(a[owner == r] for a in (prompts, outputs, budgets, prefixes,
                                                       numbers))).run()
                for r in range(dp)]
    return _combine(sim, cost, pages, replicas, prompts, time.perf_counter() - started)


def replica_of(sim: SimulationConfig, prefixes: np.ndarray, dp: int) -> np.ndarray:
    """Each request's data-parallel replica, split as `batchgen run` splits a job: requests
    that share a prompt prefix together, in equal contiguous shares (io/prefix_shards.py)."""
    if sim.shared_prefix_len:
        keys = [int(p).to_bytes(4, "little") for p in prefixes]
    else:  # nothing shared: every request its own key
        keys = [i.to_bytes(4, "little") for i in range(len(prefixes))]
    return np.asarray(assign_replicas(keys, dp), dtype=np.int64)


def _combine(sim: SimulationConfig, cost: CostModel, pages: tuple[int, int],
             replicas: list[_Replica], prompts: np.ndarray, wall: float) -> SimulationResult:
    total = max(r.clock for r in replicas)
    span = max(total, 1e-12) * len(replicas)  # StepTime counts FLOPs and bytes per GPU
    out_tokens = sum(r.output_tokens for r in replicas)
    counters = [r.sched.counters for r in replicas]
    slowest = max(replicas, key=lambda r: r.clock)
    return SimulationResult(
        requests=len(prompts), replicas=len(replicas), prompt_tokens=int(prompts.sum()),
        output_tokens=out_tokens, total_time_s=total, output_tok_s=out_tokens / max(total, 1e-12),
        total_tok_s=(out_tokens + int(prompts.sum())) / max(total, 1e-12),
        evictions=sum(c.evictions for c in counters),
        recomputed_tokens=sum(c.reprefill_tokens for c in counters),
        cached_prompt_tokens=sum(c.cached_prompt_tokens for c in counters),
        loads=sum(c.loads for c in counters), unloads=sum(c.unloads for c in counters),
        chunk_growths=sum(c.chunk_growths for c in counters),
        transfer_gb=sum(r.time.transfer_bytes for r in replicas) / 1e9,
        transfer_s=slowest.time.transfer, exposed_transfer_s=slowest.time.exposed_transfer,
        comm_s=slowest.time.comm,
        compute_util=sum(r.time.flops for r in replicas) / (span * cost.hw.flops),
        hbm_util=sum(r.time.hbm_bytes for r in replicas) / (span * cost.hw.hbm_bytes_s),
        device_pages=pages[0], host_pages=pages[1],
        device_util=sum(r.device_page_seconds for r in replicas) / (span * pages[0]),
        host_util=sum(r.host_page_seconds for r in replicas) / (span * pages[1]),
        peak_device_pages=max(r.sched.device.peak_used for r in replicas),
        peak_host_pages=max(r.sched.host.peak_used for r in replicas),
        peak_admitted=max(r.peak_admitted for r in replicas),
        mean_decode_batch=sum(r.batch_seconds for r in replicas) / span,
        steps=sum(r.steps for r in replicas), decisions=sum(c.decisions for c in counters),
        final_chunk_tokens=replicas[0].sched.chunk.chunk_tokens, wall_s=wall,
        timeline=_timeline(replicas, total, sim.timeline_points), layout=_layout(sim, cost))


def _layout(sim: SimulationConfig, cost: CostModel) -> str:
    span = cost.hw.tp_nodes
    where = f"each TP group spans {span} nodes" if span > 1 else "TP inside a node"
    return (f"TP {sim.tensor_parallel} x DP {sim.world_size // sim.tensor_parallel} on "
            f"{sim.nnodes} node(s), {where}")


def _timeline(replicas: list[_Replica], total: float, points: int) -> Timeline:
    """Sample each replica's gauges at bin midpoints and its throughput per bin; sum replicas."""
    edges = np.linspace(0.0, total, points + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    sums = {name: np.zeros(points) for name in ("device", "host", "batch", "rate")}
    for rep in replicas:
        t = np.frombuffer(rep.trace["t"], dtype=np.float64)
        # The gauge during a step is the one recorded at its end: first event ending >= time.
        at = np.minimum(np.searchsorted(t, mids), len(t) - 1)
        alive = mids <= (t[-1] if len(t) else 0.0)
        for name in ("device", "host", "batch"):
            values = np.frombuffer(rep.trace[name], dtype=np.float64)
            sums[name] += np.where(alive, values[at], 0.0) if len(t) else 0.0
        tokens = np.frombuffer(rep.trace["tokens"], dtype=np.float64)
        cumulative = np.interp(edges, np.r_[0.0, t], np.r_[0.0, tokens])
        sums["rate"] += np.diff(cumulative) / np.maximum(np.diff(edges), 1e-12)
    return Timeline(mids.tolist(), sums["device"].tolist(), sums["host"].tolist(),
                    sums["batch"].tolist(), sums["rate"].tolist())


def plot_timeline(result: SimulationResult, png_path: str) -> None:
    """Write a PNG of host/device pages used, decode batch size and throughput over time."""
    import matplotlib
    matplotlib.use("Agg")  # no display: simulate runs on headless machines
    import matplotlib.pyplot as plt

    tl = result.timeline
    hours = np.array(tl.time_s) / 3600
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    panels = [(tl.host_pages_used, f"host pages used (of {result.host_pages:,})"),
              (tl.device_pages_used, f"device pages used (of {result.device_pages:,})"),
              (tl.decode_batch, "decode batch"), (tl.output_tok_s, "output tok/s")]
    for ax, (values, label) in zip(axes, panels):
        ax.plot(hours, values, linewidth=0.8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time (h)")
    fig.suptitle(f"{result.requests:,} requests: {result.output_tok_s:,.0f} output tok/s, "
                 f"{result.evictions} evictions, {result.unloads} unloads", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
