"""`batchgen simulate`: the real Scheduler driven by a cost model instead of a model.

Each data-parallel replica runs its own Scheduler over its share of the requests (round robin),
exactly as the engine drives it (after a step: `num_computed = chunk.end`, a sampled chunk adds a
token, a sequence whose output reached its length finishes). Instead of running a forward, a step
advances a clock by `CostModel.step` (see cost_model.py). Token values never matter to the
scheduler, which only takes len(token_ids), so a `range` stands in for each token list.

Speed: between decisions the decode set is fixed (docs/architecture.md, "Decision points"),
so a run of pure decode steps with no decision due and no sequence finishing is applied in one
go (`fast_forward`) instead of calling `schedule()` once per token. That needs the scheduler's
private `_steps_left` and `_decision_due()`; `tests/test_simulate.py` checks the result is
identical to stepping.
"""

from __future__ import annotations

import json
import math
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from batchgen.config import SchedulerConfig, canonical_kv_dtype
from batchgen.core import SamplingParams
from batchgen.sched.cost_model import PRESETS, CostModel, StepTime, build_cost_model, pool_pages
from batchgen.sched.scheduler import Scheduler
from batchgen.sched.sequence import Sequence


@dataclass(frozen=True)
class SimulationConfig:
    model: str = "llama3-8b"
    """Model shape preset: llama3-8b, deepseek-r1 or smollm2-135m."""
    active_params: float | None = None
    """Override: parameters each token multiplies through (FLOPs = 2 * this per token)."""
    total_params: float | None = None
    """Override: all parameters (weight bytes = this * bytes per parameter)."""
    weight_bytes_per_param: float | None = None
    """Override: 2 for bf16 weights, 1 for fp8."""
    kv_bytes_per_token: float | None = None
    """Override: bytes of one token's KV over all layers (one copy); default from the preset
    and --kv-dtype."""
    kv_dtype: str = "bfloat16"
    """KV storage dtype: bfloat16, float16 or fp8_e4m3fn (aliases as in `batchgen run`)."""
    world_size: int = 1
    """GPUs in all; data-parallel replicas = world_size / tensor_parallel, each with its own
    scheduler and a round-robin share of the requests."""
    tensor_parallel: int = 1
    """GPUs per replica (weights and compute split over them; 2 all-reduces per layer)."""
    nnodes: int = 1
    """Nodes the world_size GPUs sit on (world_size / nnodes each). A TP group fits in one node
    or spans whole nodes; spanning ones all-reduce over the network too."""
    interconnect_gbps: float = 300.0
    """All-reduce bus bandwidth between TP ranks inside a node, GB/s (NCCL on H200 NVLink:
    ~300)."""
    allreduce_latency_us: float = 45.0
    """Fixed cost of one all-reduce inside a node (NCCL, 1 MiB on H200: 44 us)."""
    network_gbps: float = 40.0
    """All-reduce bandwidth per GPU between nodes, GB/s (one 400 Gb/s NIC per GPU, achieved)."""
    network_latency_us: float = 60.0
    """Extra fixed cost of an all-reduce that crosses nodes, us."""
    gpu_memory_gb: float = 150.0
    """Memory of one GPU in GB (an H200 reports 139.8 GiB = 150 GB)."""
    gpu_memory_frac: float = 0.9
    """As --gpu-memory-frac: device KV per GPU = memory * (frac - 0.05) - weights / TP."""
    device_kv_gb: float | None = None
    """Device KV pool per GPU in GB, overriding the formula above."""
    host_kv_gb: float = 200.0
    """Host KV pool of one replica in GB (one copy of each sequence's KV)."""
    pcie_gbps: float = 55.0
    """Host<->device bandwidth of each GPU, per direction, GB/s (pinned H200: 55)."""
    gpu_tflops: float = 600.0
    """Achieved dense FLOP/s of one GPU, in TFLOP/s (H200 matmul measured: 790 bf16, 1318 fp8)."""
    hbm_gbps: float = 3600.0
    """Achieved HBM read bandwidth of one GPU, GB/s (H200 copy: ~4300)."""
    transfer_overlap: float = 0.5
    """Share of a step's forward that host<->device copies can hide under (0: serial)."""
    step_overhead_ms: float = 0.5
    """Fixed host-side cost of one step (scheduling, launches), ms."""
    num_requests: int = 1000
    """Requests to generate (ignored with requests_file)."""
    prompt_len: str = "fixed:512"
    """Prompt length distribution: fixed:N, uniform:min=A,max=B, lognormal:mean=M,sigma=S,max=X."""
    output_len: str = "lognormal:mean=2048,sigma=1.0,max=16384"
    """Output length distribution (same forms); a sequence emits EOS after this many tokens."""
    max_tokens: int | None = None
    """max_tokens of every request (the scheduler's budget); default: the output maximum."""
    requests_file: str | None = None
    """JSONL of requests with "prompt_tokens" and "output_tokens" (and optional "max_tokens")."""
    seed: int = 0
    """Seed of the length sampling."""
    timeline_points: int = 400
    """Samples in the result's timeline."""
    fast_forward: bool = True
    """Apply runs of decode steps between decisions at once (same result, much faster)."""

    def validate(self) -> SimulationConfig:
        tp, nodes = max(1, self.tensor_parallel), max(1, self.nnodes)  # checked first
        checks = [
            (self.model in PRESETS, f"model must be one of {', '.join(PRESETS)}"),
            (self.world_size >= 1 and self.tensor_parallel >= 1, "world size and TP must be >= 1"),
            (self.world_size % tp == 0, "world_size must be a multiple of TP"),
            (self.nnodes >= 1 and self.world_size % nodes == 0,
             "world_size must be a multiple of nnodes"),
            (_tp_fits(tp, max(1, self.world_size // nodes)),
             "a TP group must fit in one node or span whole nodes"),
            (0.0 <= self.transfer_overlap <= 1.0, "transfer_overlap must be in [0, 1]"),
            (min(self.pcie_gbps, self.gpu_tflops, self.hbm_gbps, self.interconnect_gbps,
                 self.network_gbps, self.host_kv_gb, self.gpu_memory_gb) > 0,
             "sizes and rates must be > 0"),
            (0.0 < self.gpu_memory_frac <= 1.0, "gpu_memory_frac must be in (0, 1]"),
            (self.requests_file is not None or self.num_requests >= 1, "num_requests must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        canonical_kv_dtype(self.kv_dtype)
        LengthDist.parse(self.prompt_len)
        LengthDist.parse(self.output_len)
        return self


def _tp_fits(tp: int, per_node: int) -> bool:
    return per_node >= 1 and (per_node % tp == 0 if tp <= per_node else tp % per_node == 0)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed, uniform [low, high], or lognormal clipped to high."""

    kind: str
    mean: float = 0.0
    sigma: float = 0.0
    low: int = 1
    high: int = 1

    @staticmethod
    def parse(text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        if kind == "fixed" and rest.isdigit() and int(rest) >= 1:
            return LengthDist("fixed", int(rest), 0.0, int(rest), int(rest))
        try:
            args = {k.strip(): float(v) for k, v in (p.split("=") for p in rest.split(","))}
            if kind == "uniform":
                dist = LengthDist(kind, low=int(args["min"]), high=int(args["max"]))
            elif kind == "lognormal":
                dist = LengthDist(kind, args["mean"], args["sigma"], int(args.get("min", 1)),
                                  int(args["max"]))
            else:
                raise KeyError(kind)
        except (KeyError, ValueError):
            raise ValueError(f"bad length distribution {text!r}: use fixed:N, uniform:min=A,max=B "
                             "or lognormal:mean=M,sigma=S,max=X") from None
        if not 1 <= dist.low <= dist.high:
            raise ValueError(f"bad length distribution {text!r}: need 1 <= min <= max")
        return dist

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(count, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=count)
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so the unclipped mean is `mean`
        values = np.rint(rng.lognormal(mu, self.sigma, size=count)).astype(np.int64)
        return np.clip(values, self.low, self.high)


def load_workload(sim: SimulationConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths, max_tokens) per request."""
    if sim.requests_file is not None:
        prompts, outputs, budgets = _read_requests_file(sim.requests_file, sim.max_tokens)
    else:
        rng = np.random.default_rng(sim.seed)
        prompts = LengthDist.parse(sim.prompt_len).sample(sim.num_requests, rng)
        out_dist = LengthDist.parse(sim.output_len)
        outputs = out_dist.sample(sim.num_requests, rng)
        budgets = np.full(sim.num_requests, sim.max_tokens or out_dist.high, dtype=np.int64)
    if prompts.min(initial=1) < 1 or outputs.min(initial=1) < 1:
        raise ValueError("every request needs prompt_tokens >= 1 and output_tokens >= 1")
    return prompts, np.minimum(outputs, budgets), budgets


def _read_requests_file(path: str, max_tokens: int | None):
    """(prompt lengths, output lengths, max_tokens) from --requests-file's JSONL lines
    `{"prompt_tokens", "output_tokens", "max_tokens"?}`; ValueError naming the line."""
    where = f"--requests-file {path}"
    rows = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append((int(row["prompt_tokens"]), int(row["output_tokens"]),
                                 None if row.get("max_tokens") is None
                                 else int(row["max_tokens"])))
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(
                        f"{where}: line {number} is not a JSON object with integer "
                        f"prompt_tokens and output_tokens (max_tokens optional): {err!r}") from None
    except OSError as err:
        raise ValueError(f"{where}: cannot read it: {err.strerror or err}") from None
    if not rows:
        raise ValueError(f"{where} holds no requests")
    prompts, outputs, budgets = (np.array(column, dtype=object) for column in zip(*rows))
    default = max_tokens or int(outputs.max())
    budgets = np.array([default if b is None else b for b in budgets], dtype=np.int64)
    return prompts.astype(np.int64), outputs.astype(np.int64), budgets


@dataclass
class Timeline:
    """Gauges sampled at evenly spaced simulated times (summed over replicas)."""

    time_s: list[float] = field(default_factory=list)
    device_pages_used: list[float] = field(default_factory=list)
    host_pages_used: list[float] = field(default_factory=list)
    decode_batch: list[float] = field(default_factory=list)
    output_tok_s: list[float] = field(default_factory=list)


class _Replica:
    """One Scheduler over its requests, advanced by the cost model."""

    def __init__(self, sim: SimulationConfig, cfg: SchedulerConfig, cost: CostModel,
                 pages: tuple[int, int], lengths: tuple[np.ndarray, np.ndarray, np.ndarray]):
        self.sched = Scheduler(cfg, *pages)
        self.cost = cost
        self.fast_forward = sim.fast_forward
        self.targets = lengths[1].tolist()
        params: dict[int, SamplingParams] = {}
        for i, (prompt, budget) in enumerate(zip(lengths[0].tolist(), lengths[2].tolist())):
            sampling = params.setdefault(budget, SamplingParams(max_tokens=budget))
            self.sched.add(Sequence(i, str(i), 0, range(prompt), prompt, sampling, 0))  # type: ignore[arg-type]
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
            if self.fast_forward and self._decode_run():
                continue
            idle = 0 if self._step() else idle + 1
            if idle > 3:  # a stalled scheduler would otherwise loop forever at a frozen clock
                raise RuntimeError(f"the scheduler made no progress: {self.sched.counters}")
        return self

    def _step(self) -> bool:
        """One `schedule()` and the engine's update rule; False when nothing happened."""
        out = self.sched.schedule()
        tokens = decode = 0
        pairs = kv_read = 0.0
        for c in out.chunks:
            tokens += c.end - c.start
            pairs += (c.end * (c.end + 1) - c.start * (c.start + 1)) / 2  # token i sees i + 1
            kv_read += c.end
            decode += c.sample and c.end - c.start == 1
        admitted = len(self.sched.running) + len(self.sched.swapped)
        self.peak_admitted = max(self.peak_admitted, admitted)
        cost = self.cost.step(tokens, pairs, kv_read, sum(len(p.src) for p in out.swap_out),
                              sum(len(p.src) for p in out.swap_in))
        self.output_tokens += sum(c.sample for c in out.chunks)
        self._advance(cost, decode, 1)
        for c in out.chunks:
            c.seq.num_computed = c.end
            if c.sample:
                self._sampled(c.seq)
        return bool(out.chunks or out.swap_in or out.swap_out)

    def _decode_run(self) -> bool:
        """Apply k > 1 pure decode steps at once when no decision falls inside them and no
        sequence finishes before the last (identical to k `schedule()` calls)."""
        sched = self.sched
        if not sched.running or sched._decision_due():
            return False
        steps, context, targets = sched._steps_left, 0, self.targets
        for seq in sched.running:
            tokens = len(seq.token_ids)
            if tokens - seq.num_computed != 1:
                return False  # a prefill is in progress
            steps = min(steps, targets[seq.seq_id] - tokens + seq.prompt_len)
            context += tokens
        if steps < 2:
            return False
        batch = len(sched.running)
        self.output_tokens += batch * steps
        self._advance(self.cost.decode_run(batch, context, steps), batch, steps)
        sched._steps_left -= steps
        done = []
        for seq in sched.running:
            seq.num_computed += steps
            seq.token_ids = range(len(seq.token_ids) + steps)  # type: ignore[assignment]
            if len(seq.token_ids) - seq.prompt_len >= targets[seq.seq_id]:
                done.append(seq)
        for seq in done:  # in running order, as the engine's postprocess would
            sched.finish(seq)
        return True

    def _sampled(self, seq: Sequence) -> None:
        """The engine's postprocess: one more token; finish at the sequence's output length."""
        seq.token_ids = range(len(seq.token_ids) + 1)  # type: ignore[assignment]
        if seq.num_decoded >= self.targets[seq.seq_id]:
            self.sched.finish(seq)

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
    dp = sim.world_size // sim.tensor_parallel
    replicas = [_Replica(sim, sched_cfg, cost, pages,
                         (prompts[r::dp], outputs[r::dp], budgets[r::dp])).run()
                for r in range(dp)]
    return _combine(sim, cost, pages, replicas, prompts, time.perf_counter() - started)


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
