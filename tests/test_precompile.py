"""Start-up's precompile: Triton variants noted in a pass that skips them, compiled in worker
processes into the disk cache the launching process then reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from batchgen.bench_models import hf_config_for, random_model
from batchgen.engine import precompile as P
from batchgen.engine.kv_cache import KVLayout, KVPool


SILU = {"signature": {"x_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "stride_x": "i32",
                      "stride_o": "i32", "BLOCK": "constexpr"},
        "constexprs": {(5,): 1024},
        "attrs": {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}}
"""A variant of the SiLU-and-mul kernel: bf16 rows, block 1024, aligned pointers."""

LAUNCHER = """
import json, sys
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from batchgen_kernels import silu_mul
sig, consts, attrs = json.loads(sys.argv[1])
target = GPUTarget("cuda", 90, 32)
options = make_backend(target).parse_options({"num_warps": 4})
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
source = ASTSource(silu_mul._silu_mul_kernel, sig, {(5,): consts}, {(0,): attrs, (1,): attrs})
triton.compile(source, target=target, options=options.__dict__)
print(json.dumps(hits))
"""
"""Compiles the variant as a launching process would (without TRITON_INTERPRET, which the
kernel tests set in this one) and prints whether Triton found it in its disk cache."""


def silu_note():
    """The variant as `noted_variants` notes it: (module, qualname, Triton's serialised
    specialisation) for sm_90."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    try:
        options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4})
    except Exception as err:  # a Triton build without the NVIDIA backend
        pytest.skip(f"no CUDA backend in this Triton: {err}")
    name = "_silu_mul_kernel"
    spec = json.dumps({  # the layout of Triton's serialize_specialization_data
        "name": f"batchgen_kernels.silu_mul.{name}", "signature": SILU["signature"],
        "constant_keys": [list(k) for k in SILU["constexprs"]],
        "constant_vals": list(SILU["constexprs"].values()),
        "attrs_keys": [list(k) for k in SILU["attrs"]], "attrs_vals": list(SILU["attrs"].values()),
        "options": options.__dict__, "key": "key"})
    return "batchgen_kernels.silu_mul", name, spec


@pytest.fixture
def clean_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def launcher_hits() -> list[bool]:
    """Whether a fresh process's compile of the SiLU variant found it in the disk cache."""
    args = json.dumps([SILU["signature"], 1024, [["tt.divisibility", 16]]])
    out = subprocess.run([sys.executable, "-c", LAUNCHER, args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_worker_compiles_into_the_cache_the_launcher_reads(clean_cache):
    # Spawned: this test process may hold the kernels as the interpreter's (TRITON_INTERPRET).
    assert P.compile_in_workers([silu_note()], ("cuda", 90, 32), workers=1, fork=False) == 1
    assert launcher_hits() == [True]  # the worker's binary


FORKED = """
import json, sys
from batchgen.engine import precompile as P
print(P.compile_in_workers([tuple(json.loads(sys.argv[1]))], ("cuda", 90, 32), workers=2,
                           fork=True))
"""
"""A job's process forking its compile workers (the kernels imported for real, not under the
interpreter)."""


def test_a_forked_worker_compiles_into_the_cache_the_launcher_reads(clean_cache):
    out = subprocess.run([sys.executable, "-c", FORKED, json.dumps(silu_note())],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"
    assert launcher_hits() == [True]


def test_a_warmed_worker_compiles_its_warm_up_kernel_then_its_share(clean_cache, tmp_path,
                                                                    monkeypatch):
    note = silu_note()
    monkeypatch.setattr(P, "device_target", lambda device: ("cuda", 90, 32))
    workers = P.CompileWorkers(1, device="cuda", fork=False)
    with pytest.MonkeyPatch.context() as patch:
        reports = []
        patch.setattr(P.log, "debug", lambda *args: reports.append(args))
        assert workers.compile([note], ("cuda", 90, 32)) == 1
    workers.close()
    assert any("warm-up" in args[0] and args[3] > 0 for args in reports), reports
    kernels = {p.suffix for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert ".cubin" in kernels
    # two kernels in the cache: the warm-up's and the variant's
    assert len(list((tmp_path / "cache").rglob("*.cubin"))) == 2


def test_a_variant_a_worker_cannot_compile_costs_only_itself(clean_cache):
    note = silu_note()
    broken = ("batchgen_kernels.silu_mul", "no_such_kernel", note[2])
    assert P.compile_in_workers([broken, note], ("cuda", 90, 32), workers=1, fork=False) == 1


def test_a_worker_that_dies_is_counted_as_nothing(monkeypatch):
    # Forks that exit (3) before reading their share.
    monkeypatch.setattr(P, "_serve", lambda conn: __import__("os")._exit(3))
    workers = P.CompileWorkers(2, fork=True)
    assert P.precompile(lambda: None, torch.device("cpu"), workers) == 0  # closes them
    assert all(not proc.is_alive() for proc, _ in workers.procs)
    workers = P.CompileWorkers(2, fork=True)
    assert workers.compile([("m", "f", "{}")] * 3, ("cuda", 90, 32)) == 0
    assert [proc.exitcode for proc, _ in workers.procs] == [3, 3]
    workers.close()


def test_the_pass_notes_each_new_variant_once_and_skips_it():
    knobs = pytest.importorskip("triton").knobs
    outer = knobs.runtime.jit_cache_hook

    class Fn:
        module, name = "batchgen_kernels.rmsnorm", "_rmsnorm_kernel"

    with P.noted_variants() as notes:
        hook = knobs.runtime.jit_cache_hook
        for spec in ("a", "b", "a"):
            assert hook(key=spec, repr=spec, fn=Fn, compile={"specialization_data": spec}) is True
    assert notes == [(Fn.module, Fn.name, "a"), (Fn.module, Fn.name, "b")]
    assert knobs.runtime.jit_cache_hook is outer


def test_precompile_does_nothing_off_cuda():
    ran = []
    assert P.precompile(lambda: ran.append(1), torch.device("cpu")) == 0
    assert ran == []


def test_the_probe_forwards_run_and_write_no_kv():
    """The runner's probe batches (decode sizes, a mixed step, a prefill step) are valid
    forwards for the model, and leave the KV pool as it was (every slot -1)."""
    from batchgen.engine.graphs import DecodeGraphs
    from batchgen.engine.runner import probe

    model = random_model(hf_config_for("llama3-8b", tiny=True), torch.float32,
                         torch.device("cpu"))
    pool = KVPool(KVLayout(model.config.num_hidden_layers, tuple(model.kv_token_shape),
                           torch.float32, torch.float32), 8, "cpu")
    pool.data.normal_()
    before = pool.data.clone()
    seen, grouped = [], []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].q_lens))
    model.register_forward_pre_hook(
        lambda _, args: grouped.append(args[0].prefix_groups is not None))
    graphs = DecodeGraphs(model, pool, 16, 3, 256)
    probe(model, graphs, pool)
    assert [len(q) for q in seen[:4]] == [4, 8, 1, 2]  # eager sizes, then the buckets
    # then each bucket's shared-prefix forward (those graphs are captured mid-job)
    assert model.shared_prefix_decode
    # then a mixed step; mixed steps whose decode rows (3, each bucket's number) are one
    # prefix group; a prefill step
    mixed = [q for q, g in zip(seen, grouped) if g][len(graphs.sizes):]
    rows = sorted({3, *graphs.sizes})
    assert mixed == [[1] * n + [130, 64] for n in rows]
    assert seen[-len(rows) - 2] == [1, 1, 1, 130, 64] and not grouped[-len(rows) - 2]
    assert seen[-1] == [128, 128] and not grouped[-1]
    assert sum(seen[-1]) % 16 == 0 and sum(seen[-len(rows) - 2]) % 16
    assert torch.equal(pool.data, before)


def test_the_stand_in_keeps_the_first_two_and_last_two_layers_and_their_types():
    from batchgen.bench_models import stand_in_model

    config = hf_config_for("qwen3-8b", tiny=True)
    config.num_hidden_layers = 6
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention", "full_attention", "sliding_attention"]
    stand_in = stand_in_model(config, torch.float32, torch.device("cpu"))
    assert stand_in.config.num_hidden_layers == len(stand_in.model.layers) == 4
    assert stand_in.config.layer_types == ["sliding_attention", "full_attention",
                                           "full_attention", "sliding_attention"]
    assert config.num_hidden_layers == 6  # the job's config is left as it was
    small = hf_config_for("llama3-8b", tiny=True)  # 2 layers: all kept
    assert stand_in_model(small, torch.float32, torch.device("cpu")).config.num_hidden_layers == 2
    # MoE routing needs real kernel outputs: no pass, so nothing is drawn
    assert stand_in_model(hf_config_for("deepseek-v3-4l", tiny=True), torch.float32,
                          torch.device("cpu")) is None


def test_the_stand_in_pass_does_nothing_off_cuda():
    from batchgen.bench_models import stand_in_model
    from batchgen.config import EngineConfig
    from batchgen.engine.runner import precompile_stand_in

    model = stand_in_model(hf_config_for("llama3-8b", tiny=True), torch.float32,
                           torch.device("cpu"))
    workers = P.CompileWorkers(1)
    try:
        assert precompile_stand_in(lambda: model, EngineConfig().validate(), workers) == 0
        assert workers.submitted is None
    finally:
        workers.close()


COUNTING = """
import json, sys, torch
from triton import knobs
from batchgen.bench_models import hf_config_for, random_model, stand_in_model
from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
from batchgen.engine import runner
from batchgen.engine.engine import Engine
from batchgen.engine.precompile import CompileWorkers

counts = {"workers": 0, "misses": 0}
real = runner.precompile

def counted(forwards, device, workers=None):
    counts["workers"] += real(forwards, device, workers)
    knobs.compilation.listener = (
        lambda **kw: counts.__setitem__("misses", counts["misses"] + (not kw["cache_hit"])))
    return 0

runner.precompile = counted
cuda = torch.device("cuda")
cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.2, host_kv_cache_size=0.2),
                   runtime=RuntimeConfig(cuda_graph_max_bucket_size=8,
                                         cuda_graph_num_buckets=4)).validate()
"""
"""Counts the variants start-up's precompile has the workers compile ("workers") and those the
capture after it still compiles itself ("misses"), in a fresh process."""

STAND_IN = COUNTING + """
config = hf_config_for("llama3-8b", tiny=True)
config.num_hidden_layers = 6
workers = CompileWorkers(device=cuda)
x = torch.ones(64, 64, device=cuda, dtype=torch.bfloat16)
x @ x  # cuBLAS keeps its workspace (32 MiB on Hopper) from its first GEMM on: not the stand-in's
before = torch.cuda.memory_allocated()
counts["ahead"] = runner.precompile_stand_in(
    lambda: stand_in_model(config, torch.bfloat16, cuda), cfg, workers)
counts["kept_bytes"] = torch.cuda.memory_allocated() - before
model = random_model(config, torch.bfloat16, cuda)
Engine(model, cfg, compile_workers=workers)
print(json.dumps(counts))
"""
"""A job's start-up as the worker runs it: compile workers started, the stand-in's pass, the
real model, the engine (whose capture only waits for the workers)."""

AFTER_THE_WEIGHTS = COUNTING + """
model = random_model(hf_config_for("llama3-8b", tiny=True), torch.bfloat16, cuda)
Engine(model, cfg)
print(json.dumps(counts))
"""
"""An engine given no workers: its capture runs the pass and its own workers."""


def fresh_process_counts(script: str, tmp_path) -> dict:
    env = {**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_the_stand_in_pass_compiles_every_variant_the_capture_needs(tmp_path):
    counts = fresh_process_counts(STAND_IN, tmp_path)
    assert counts["ahead"] >= 5 and counts["workers"] == counts["ahead"], counts
    assert counts["misses"] == 0, counts
    assert counts["kept_bytes"] == 0, counts  # the stand-in's memory was given back


@pytest.mark.gpu
def test_capture_finds_every_variant_compiled_by_the_workers(tmp_path):
    """In a fresh process with an empty Triton cache, a CUDA engine's start-up precompiles
    the variants its capture needs: the capture compiles none itself."""
    counts = fresh_process_counts(AFTER_THE_WEIGHTS, tmp_path)
    assert counts["workers"] >= 5 and counts["misses"] == 0, counts


def test_the_auto_device_is_chosen_without_starting_cuda(monkeypatch):
    """Start-up forks its compile workers after choosing the device: choosing it must not
    start CUDA's driver (torch.cuda.is_available does; NVML's count does not)."""
    from batchgen.parallel import pick_device

    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: pytest.fail("is_available() starts CUDA's driver"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert pick_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("auto") == torch.device("cuda")
    assert pick_device("cpu") == torch.device("cpu")
