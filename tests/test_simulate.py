"""`batchgen simulate`: the real Scheduler under a cost model (no model, no GPU)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from batchgen.config import SchedulerConfig
from batchgen.simulate.cost_model import PRESETS, CostModel, Hardware
from batchgen.sched.scheduler import RequestTooLarge
from batchgen.simulate import (
    LengthDist,
    SimulationConfig,
    SimulationResult,
    load_workload,
    plot_timeline,
    run_simulation,
)

SMALL = SimulationConfig(model="smollm2-135m", num_requests=60, prompt_len="uniform:min=10,max=300",
                         output_len="lognormal:mean=200,sigma=1.0,max=1500", device_kv_gb=0.05,
                         host_kv_gb=0.3, seed=3)
TIGHT = SchedulerConfig(initial_gpu_page_buffer=2, extension_gpu_page_buffer=2,
                        decision_frequency_pages=1, host_kv_chunk_size=256, adaptive_chunk_min=128)


def comparable(result: SimulationResult) -> dict:
    fields = dataclasses.asdict(result)
    del fields["wall_s"]
    return fields


def test_small_simulation_reports_every_field():
    result = run_simulation(SMALL, SchedulerConfig())
    _, outputs, _ = load_workload(SMALL)
    assert result.requests == 60 and result.output_tokens == int(outputs.sum())
    assert result.total_time_s > 0 and result.output_tok_s > 0
    assert result.output_tok_s == pytest.approx(result.output_tokens / result.total_time_s)
    assert 0 < result.device_util <= 1 and 0 < result.host_util <= 1
    assert 0 < result.peak_device_pages <= result.device_pages
    unset = SchedulerConfig().with_decode_batch(None)  # the simulator's default: eager's batch
    assert 0 < result.mean_decode_batch <= unset.max_decode_batch
    assert len(result.timeline.time_s) == SMALL.timeline_points
    assert max(result.timeline.decode_batch) >= 1 and max(result.timeline.output_tok_s) > 0
    assert "output tok/s" in result.summary()


def test_same_config_same_result():
    assert comparable(run_simulation(SMALL, TIGHT)) == comparable(run_simulation(SMALL, TIGHT))


@pytest.mark.parametrize("sched", [SchedulerConfig(), TIGHT,
                                   dataclasses.replace(TIGHT, adaptive_chunk=False,
                                                       max_decode_batch=7)])
def test_fast_forward_matches_step_by_step(sched):
    fast = run_simulation(SMALL, sched)
    slow = run_simulation(dataclasses.replace(SMALL, fast_forward=False), sched)
    for name in ("output_tokens", "evictions", "recomputed_tokens", "loads", "unloads",
                 "chunk_growths", "steps", "decisions", "peak_device_pages", "peak_host_pages",
                 "peak_admitted", "final_chunk_tokens"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert fast.total_time_s == pytest.approx(slow.total_time_s, rel=1e-3)


def test_tight_pools_exercise_unloads_and_evictions():
    result = run_simulation(dataclasses.replace(SMALL, host_kv_gb=0.06), TIGHT)
    assert result.unloads > 0 and result.loads > 0
    assert result.evictions > 0 and result.recomputed_tokens > 0 and result.chunk_growths > 0
    assert result.transfer_gb > 0 and result.transfer_s > 0


def test_more_host_kv_admits_no_fewer_sequences():
    peaks = [run_simulation(dataclasses.replace(SMALL, host_kv_gb=gb), TIGHT).peak_admitted
             for gb in (0.045, 0.08, 0.16, 0.5)]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_data_parallel_replicas_split_the_requests():
    one = run_simulation(SMALL, SchedulerConfig())
    two = run_simulation(dataclasses.replace(SMALL, world_size=2), SchedulerConfig())
    assert two.replicas == 2 and two.output_tokens == one.output_tokens
    assert two.total_time_s < one.total_time_s


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(run_simulation(SMALL, TIGHT), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_requests_file_lengths(tmp_path):
    path = tmp_path / "requests.jsonl"
    rows = [{"prompt_tokens": 10 + i, "output_tokens": 5 + i} for i in range(20)]
    rows[3]["max_tokens"] = 6  # output is cut at max_tokens
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sim = dataclasses.replace(SMALL, requests_file=str(path))
    prompts, outputs, budgets = load_workload(sim)
    assert prompts.tolist() == [10 + i for i in range(20)]
    assert outputs[3] == 6 and budgets[3] == 6 and budgets[0] == 24
    assert run_simulation(sim, SchedulerConfig()).output_tokens == int(outputs.sum())


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("fixed:512").sample(3, rng).tolist() == [512] * 3
    uniform = LengthDist.parse("uniform:min=5,max=9").sample(1000, rng)
    assert uniform.min() == 5 and uniform.max() == 9
    lognormal = LengthDist.parse("lognormal:mean=2048,sigma=1.0,max=16384").sample(200_000, rng)
    assert lognormal.max() == 16384 and lognormal.min() >= 1
    assert 1800 < lognormal.mean() < 2048  # the clip at max takes a little off the mean
    for bad in ("fixed:0", "normal:mean=3", "uniform:min=9,max=5", "lognormal:mean=5"):
        with pytest.raises(ValueError, match="length distribution"):
            LengthDist.parse(bad)


def test_bad_configs_are_refused():
    for change in ({"model": "gpt-5"}, {"world_size": 6, "tensor_parallel": 4},
                   {"transfer_overlap": 1.5}, {"kv_dtype": "fp9"}):
        with pytest.raises(ValueError):
            run_simulation(dataclasses.replace(SMALL, **change), SchedulerConfig())
    with pytest.raises(ValueError, match="no device KV"):  # 671 GB of weights on one GPU
        run_simulation(dataclasses.replace(SMALL, model="deepseek-r1", device_kv_gb=None),
                       SchedulerConfig())
    with pytest.raises(RequestTooLarge):
        run_simulation(dataclasses.replace(SMALL, device_kv_gb=0.01, max_tokens=4000),
                       SchedulerConfig())


def test_decode_cost_matches_the_llama_roofline():
    """Llama-3-8B bf16 at 4.3 TB/s, batch 256 at 1k context -> ~21.8k tok/s (docs/simulate.md)."""
    hw = Hardware(1, 790e12, 4.3e12, 55e9, 300e9, 0.0, 0.5, 0.0)
    shape = PRESETS["llama3-8b"]
    cost = CostModel(shape, hw, shape.kv_values_per_token_layer * shape.num_layers * 2)
    step = cost.step(256, 256 * 1024, 256 * 1024)
    assert 256 / step.total == pytest.approx(21.8e3, rel=0.03) and not step.compute_bound
    prefill = cost.step(8192, 8192 * 4096 / 2, 8192)  # 8 prompts of 1k: compute bound
    assert prefill.compute_bound and 8192 / prefill.total == pytest.approx(48e3, rel=0.1)


def test_moe_weights_touched_grow_with_batch():
    ds = PRESETS["deepseek-r1"]
    one, many = ds.weight_bytes_touched(1), ds.weight_bytes_touched(4096)
    assert one == pytest.approx(37e9, rel=0.02)  # fp8: one byte per active parameter
    assert many == pytest.approx(ds.weight_bytes, rel=0.01)


def test_transfers_hide_partly_under_the_forward():
    shape = PRESETS["llama3-8b"]
    kv = shape.kv_values_per_token_layer * shape.num_layers * 2
    serial = CostModel(shape, Hardware(1, 790e12, 4.3e12, 55e9, 300e9, 0.0, 0.0, 0.0), kv)
    hidden = CostModel(shape, Hardware(1, 790e12, 4.3e12, 55e9, 300e9, 0.0, 1.0, 0.0), kv)
    a, b = serial.step(64, 64 * 500, 64 * 500, 10, 10), hidden.step(64, 64 * 500, 64 * 500, 10, 10)
    assert a.transfer == b.transfer > 0 and a.exposed_transfer == a.transfer
    assert b.exposed_transfer == max(0.0, b.transfer - b.forward)


def test_allreduce_crossing_nodes_costs_the_network():
    """TP 8 in a node: NVLink only. TP 16 over 2 nodes: NVLink inside each node plus each GPU's
    1/8 share over its NIC, and both latencies."""
    from batchgen.simulate.cost_model import allreduce_cost

    hidden_bytes = 7168 * 2
    inside = Hardware(8, 1e15, 4e12, 55e9, 300e9, 45e-6, 0.5, 0.0, 8, 40e9, 60e-6)
    per_token, fixed = allreduce_cost(inside, hidden_bytes)
    assert inside.tp_nodes == 1 and fixed == 45e-6
    assert per_token == pytest.approx(2 * 7 / 8 * hidden_bytes / 300e9)
    spans = dataclasses.replace(inside, tensor_parallel=16)
    per_token16, fixed16 = allreduce_cost(spans, hidden_bytes)
    assert spans.tp_nodes == 2 and fixed16 == pytest.approx(105e-6)
    assert per_token16 == pytest.approx(per_token + 2 * 1 / 2 * hidden_bytes / 8 / 40e9)
    across = dataclasses.replace(spans, tensor_parallel=2, gpus_per_node=1)  # one GPU per node
    per_token2, fixed2 = allreduce_cost(across, hidden_bytes)
    assert per_token2 == pytest.approx(hidden_bytes / 40e9) and fixed2 == 60e-6
    assert allreduce_cost(dataclasses.replace(inside, tensor_parallel=1), hidden_bytes) == (0, 0)


def test_tp_across_nodes_is_slower_than_inside_one():
    """Same 16 GPUs as 2 nodes of 8, TP 16: a slower network only costs all-reduce time."""
    sim = dataclasses.replace(SMALL, world_size=16, tensor_parallel=16, nnodes=2,
                              interconnect_gbps=300, network_gbps=40)
    fast = run_simulation(dataclasses.replace(sim, network_gbps=400, network_latency_us=0.0),
                          SchedulerConfig())
    slow = run_simulation(sim, SchedulerConfig())
    assert slow.comm_s > fast.comm_s > 0 and slow.total_time_s > fast.total_time_s
    assert slow.output_tokens == fast.output_tokens and slow.steps == fast.steps
    assert "TP 16 x DP 1 on 2 node(s), each TP group spans 2 nodes" in slow.summary()


def test_data_parallel_over_nodes_needs_no_network():
    """TP 8 x DP 2 on 2 nodes: each replica inside a node; the network speed changes nothing."""
    sim = dataclasses.replace(SMALL, world_size=16, tensor_parallel=8, nnodes=2)
    a = run_simulation(sim, SchedulerConfig())
    b = run_simulation(dataclasses.replace(sim, network_gbps=1.0, network_latency_us=1e4),
                       SchedulerConfig())
    assert a.replicas == 2 and comparable(a) == comparable(b)
    assert "TP 8 x DP 2 on 2 node(s), TP inside a node" in a.summary()


def test_layouts_that_split_a_tp_group_unevenly_are_refused():
    for refused in ({"world_size": 12, "tensor_parallel": 3, "nnodes": 3},   # 3 of 4 per node
                    {"world_size": 24, "tensor_parallel": 12, "nnodes": 3},  # 12 over nodes of 8
                    {"world_size": 16, "tensor_parallel": 16, "nnodes": 3}):  # 16 on 3 nodes
        with pytest.raises(ValueError):
            dataclasses.replace(SMALL, **refused).validate()
    for accepted in ({"world_size": 12, "tensor_parallel": 4, "nnodes": 3},
                     {"world_size": 32, "tensor_parallel": 16, "nnodes": 4}):
        dataclasses.replace(SMALL, **accepted).validate()


@pytest.mark.parametrize("args, needle", [
    (["--tensor-parallel", "0"], "--tensor-parallel-size must be >= 1"),
    (["--world-size", "4", "--tensor-parallel-size", "3"],
     "--world-size (4) must be a multiple of --tensor-parallel-size (3)"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--output-len", "uniform:min=5"], "(--prompt-len / --output-len)"),
    (["--requests-file", "{tmp}/missing.jsonl"], "cannot read it"),
    (["--requests-file", "{tmp}"], "cannot read it"),
    (["--requests-file", "{tmp}/wrong_keys.jsonl"], "line 2 is not a JSON object"),
    (["--requests-file", "{tmp}/empty.jsonl"], "holds no requests"),
    (["--num-requests", "4", "--png", "{tmp}/nodir/t.png"], "existing folder"),
    (["--host-kv-cache-size", "nan"], "--host-kv-cache-size must be a finite number"),
    (["--gpu-tflops", "nan"], "--gpu-tflops must be a finite number"),
    (["--step-overhead-ms", "-1"], "--step-overhead-ms must be >= 0"),
    (["--network-latency-us", "-1"], "--network-latency-us and"),
    (["--total-params", "0"], "--total-params must be > 0"),
    (["--gpu-kv-cache-size", "0"], "--gpu-kv-cache-size must be > 0"),
    (["--timeline-points", "-1"], "--timeline-points must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--output-len", "lognormal:mean=0,sigma=1,max=9"], "need mean > 0 and sigma >= 0"),
])
def test_user_mistakes_are_one_line_errors_not_tracebacks(tmp_path, args, needle):
    from typer.testing import CliRunner

    from batchgen.cli import app

    (tmp_path / "wrong_keys.jsonl").write_text(
        '{"prompt_tokens": 4, "output_tokens": 2}\n{"prompt": "hi"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    args = [a.format(tmp=tmp_path) for a in args]
    result = CliRunner().invoke(app, ["simulate", "--model", "smollm2-135m", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_shared_prefixes_are_read_once_per_group_in_decode(monkeypatch):
    """Requests sharing long prefixes decode faster than the same job costed as if every row
    read its whole context (the shared-prefix kernel reads a group's prefix once)."""
    import batchgen.simulate.driver as driver

    sim = SimulationConfig(model="llama3-8b", num_requests=64, prompt_len="fixed:2200",
                           output_len="fixed:200", shared_prefix_len=2000,
                           num_prefixes=2, device_kv_gb=40, host_kv_gb=80, seed=1)
    grouped = run_simulation(sim, SchedulerConfig())
    monkeypatch.setattr(driver, "saved_page_reads", lambda chunks, shares: 0)
    plain = run_simulation(sim, SchedulerConfig())
    assert grouped.output_tokens == plain.output_tokens
    assert grouped.total_time_s < 0.9 * plain.total_time_s


def test_data_parallel_replicas_take_requests_by_shared_prefix():
    """As `batchgen run` splits a job: four prefixes over four replicas, one prefix each, so
    each prefix is computed once, not once per replica."""
    from batchgen.simulate.config import prefix_choices
    from batchgen.simulate.driver import replica_of

    sim = SimulationConfig(model="llama3-8b", num_requests=256, prompt_len="fixed:2200",
                           output_len="fixed:20", shared_prefix_len=2000, num_prefixes=4,
                           world_size=4, device_kv_gb=40, host_kv_gb=80, seed=1)
    prefixes = prefix_choices(sim, sim.num_requests)
    owner = replica_of(sim, prefixes, 4)
    assert sorted(np.bincount(owner).tolist()) == [64] * 4
    assert sum(len(set(prefixes[owner == r])) for r in range(4)) <= 4 + 3  # runs straddle
    result = run_simulation(sim, SchedulerConfig())
    prompt_tokens = sim.num_requests * 2200
    # Each replica computes its prefixes once: at least ~(256 - 7) x 1,984 cached tokens.
    assert result.cached_prompt_tokens >= (sim.num_requests - 7) * 1984
    assert result.cached_prompt_tokens < prompt_tokens


def test_answers_of_prompts_shorter_than_the_shared_prefix_are_their_own():
    """A prompt shorter than --shared-prefix-len is all prefix, but its answer is not shared:
    the same workload (every prompt the same 200 tokens) simulates the same whether the shared
    prefix is said to be 200 or 4,000 tokens long. Generated tokens taken as shared would let a
    sequence loaded back map another request's decode pages (fewer copies, a larger batch)."""
    base = SimulationConfig(model="llama3-8b", num_requests=60, prompt_len="fixed:200",
                            output_len="fixed:1500", shared_prefix_len=200, device_kv_gb=1,
                            host_kv_gb=3, seed=1)
    exact = comparable(run_simulation(base, SchedulerConfig()))
    longer = comparable(run_simulation(dataclasses.replace(base, shared_prefix_len=4000),
                                       SchedulerConfig()))
    assert exact["unloads"] > 0
    assert longer == exact


def test_a_shared_prefix_ending_mid_page_is_reused_whole():
    """2,000-token prefixes end 16 tokens into their 32nd page: every request after the first
    of its prefix reuses all 2,000 tokens (31 pages mapped, the start of the 32nd copied), so
    the simulated reuse is what a run reports, not whole pages only."""
    sim = SimulationConfig(model="llama3-8b", num_requests=64, prompt_len="fixed:2200",
                           output_len="fixed:20", shared_prefix_len=2000, num_prefixes=2,
                           device_kv_gb=40, host_kv_gb=80, seed=1)
    result = run_simulation(sim, SchedulerConfig())
    assert result.cached_prompt_tokens == (64 - 2) * 2000
