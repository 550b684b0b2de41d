"""Preflight before weights load: /dev/shm vs the host pool, memlock when pinning on CUDA, free
disk for results; each finding names its fix; errors stop the job, warnings do not."""

import logging
import resource

import pytest
from test_reliability_support import job_input, run

from batchgen.config import (
    DistConfig,
    EngineConfig,
    JobConfig,
    MemoryConfig,
    RuntimeConfig,
    StorageConfig,
)
from batchgen.io.jobfiles import JobPaths
from batchgen.runner.leader import preflight as pf
from batchgen.runner.files.errors import PreflightFailed
from batchgen.runner.exits import ExitCode

GB = 10**9


def _config(tmp_path, host_gb=None, fast_init=False, device="cpu", world=1,
            nnodes=1) -> JobConfig:
    memory = MemoryConfig(host_kv_cache_size=host_gb, fast_init=fast_init)
    return JobConfig(engine=EngineConfig(memory=memory, runtime=RuntimeConfig(device=device)),
                     storage=StorageConfig(input=str(tmp_path / "in.jsonl"),
                                           storage_path=str(tmp_path / "s")),
                     dist=DistConfig(world_size=world, nnodes=nnodes))


@pytest.fixture
def machine(monkeypatch):
    """A roomy machine; tests shrink one resource at a time."""
    state = {"shm": 100 * GB, "mem": 200 * GB, "memlock": resource.RLIM_INFINITY,
             "disk": 10**12, "cuda": False, "gpus": 1, "cores": 64}
    monkeypatch.setattr(pf, "shm_free_bytes", lambda: state["shm"])
    monkeypatch.setattr(pf, "host_memory_bytes", lambda: state["mem"])
    monkeypatch.setattr(pf, "memlock_limit", lambda: state["memlock"])
    monkeypatch.setattr(pf, "disk_free", lambda path: state["disk"])
    monkeypatch.setattr(pf, "uses_cuda", lambda device: state["cuda"] or device.startswith("cuda"))
    monkeypatch.setattr(pf, "cuda_device_count", lambda: state["gpus"])
    monkeypatch.setattr(pf, "cpu_cores", lambda: state["cores"])
    return state


def _paths(tmp_path) -> JobPaths:
    return JobPaths.for_job(tmp_path / "s", "batch_x")


def test_roomy_machine_has_no_findings(tmp_path, machine):
    cfg = _config(tmp_path, host_gb=8, device="cuda")
    assert pf.preflight(cfg, _paths(tmp_path), 10**6, 1000, 1000) == []


def test_small_dev_shm_is_an_error_naming_the_fixes(tmp_path, machine):
    machine["shm"] = 2 * GB
    with pytest.raises(PreflightFailed) as err:
        pf.preflight(_config(tmp_path, host_gb=4, world=2), _paths(tmp_path), 10, 1, 1)
    message = str(err.value)
    assert err.value.code == ExitCode.PREFLIGHT and "4.0 GB of /dev/shm, 2.0 GB" in message
    assert "mount -o remount,size=4G /dev/shm" in message and "--fast-init" in message


def test_the_host_pool_size_is_the_nodes_not_each_ranks(tmp_path, machine):
    """--host-kv-cache-size is per node (plan_pools gives each of the node's workers its share):
    8 ranks under a 60 GB pool need 60 GB of /dev/shm and host memory, not 8 x 60."""
    machine["shm"], machine["mem"] = 100 * GB, 200 * GB
    assert pf.check_host_pool(_config(tmp_path, host_gb=60, world=8)) == []


def test_fast_init_does_not_need_dev_shm(tmp_path, machine):
    machine["shm"] = 0
    assert pf.check_host_pool(_config(tmp_path, host_gb=4, fast_init=True)) == []


def test_pool_larger_than_host_memory(tmp_path, machine):
    machine["mem"] = 4 * GB
    findings = pf.check_host_pool(_config(tmp_path, host_gb=8))
    assert findings[0].error and "lower --host-kv-cache-size" in str(findings[0])


def test_small_memlock_warns_when_pinning_on_cuda(tmp_path, machine, caplog):
    machine["memlock"] = 64 * 2**10
    with caplog.at_level(logging.WARNING, "batchgen.preflight"):
        findings = pf.preflight(_config(tmp_path, host_gb=4, device="cuda"), _paths(tmp_path),
                                10, 1, 1)
    assert [f.error for f in findings] == [False]
    assert "ulimit -l unlimited" in caplog.text and "0 MiB" not in caplog.text
    assert pf.check_memlock(_config(tmp_path, host_gb=4, device="cpu")) == []


def test_memlock_is_checked_against_each_workers_share(tmp_path, machine):
    """Each worker pins its share of the node's pool: 8 ranks under a 16 GB pool pin 2 GB
    each, which a 4 GB memlock limit allows."""
    machine["memlock"] = 4 * GB
    assert pf.check_memlock(_config(tmp_path, host_gb=16, device="cuda", world=8)) == []
    assert pf.check_memlock(_config(tmp_path, host_gb=16, device="cuda", world=2)) != []


@pytest.mark.parametrize(("device", "gpus", "seen"), [
    ("cuda", 0, "torch sees no CUDA device"), ("cuda:2", 2, "torch sees 2 CUDA device(s)")])
def test_missing_cuda_device_fails_before_any_load(tmp_path, machine, device, gpus, seen):
    machine["gpus"] = gpus
    with pytest.raises(PreflightFailed) as err:
        pf.preflight(_config(tmp_path, device=device), _paths(tmp_path), 10, 1, 1)
    assert err.value.code == ExitCode.PREFLIGHT and seen in str(err.value)
    assert "--device cpu" in str(err.value)
    machine["gpus"] = 3
    assert pf.check_device(_config(tmp_path, device=device)) == []


@pytest.mark.parametrize(("world", "nnodes", "seen", "fix"), [
    (16, 1, "runs 16 ranks on this node, which has 8 GPU(s)", "--world-size 8 or less"),
    (32, 2, "--world-size 32 over --nnodes 2 runs 16 ranks", "--world-size 16 or less")])
def test_more_ranks_than_the_node_has_gpus_fails_before_any_load(tmp_path, machine, world,
                                                                  nnodes, seen, fix):
    """A rank past the node's last GPU would fail only after the others loaded their weights.
    Under torchrun / srun the launcher placed the ranks: not checked."""
    machine["gpus"] = 8
    config = _config(tmp_path, device="cuda", world=world, nnodes=nnodes)
    with pytest.raises(PreflightFailed) as err:
        pf.preflight(config, _paths(tmp_path), 10, 1, 1)
    assert err.value.code == ExitCode.PREFLIGHT and seen in str(err.value)
    assert fix in str(err.value)
    assert pf.check_ranks_per_node(config, external=True) == []
    assert pf.check_ranks_per_node(_config(tmp_path, device="cuda", world=8)) == []


def test_more_cpu_ranks_than_cores_is_a_warning(tmp_path, machine, caplog):
    """CPU ranks past the cores share them: it runs, slower than fewer ranks would; said once."""
    machine["cores"] = 2
    with caplog.at_level(logging.WARNING):
        findings = pf.preflight(_config(tmp_path, world=3), _paths(tmp_path), 10, 1, 1)
    assert [f.error for f in findings if "ranks on this node" in f.what] == [False]
    assert "runs 3 ranks on this node, which has 2 CPU core(s)" in caplog.text
    assert "--world-size 2 or less" in caplog.text
    assert pf.check_ranks_per_node(_config(tmp_path, world=2)) == []


def test_disk_below_the_floor_is_a_disk_error(tmp_path, machine):
    machine["disk"] = 1000
    with pytest.raises(PreflightFailed) as err:
        pf.preflight(_config(tmp_path), _paths(tmp_path), 10**6, 1000, 1000)
    assert err.value.code == ExitCode.DISK and "--storage-path" in str(err.value)


def test_disk_below_the_estimate_only_warns(tmp_path, machine):
    machine["disk"] = 2 * 10**6  # floor 2 * 1000 * 300 B = 0.6 MB < 2 MB < estimate ~3.2 MB
    findings = pf.preflight(_config(tmp_path), _paths(tmp_path), 10**6, 1000, 1000)
    assert [f.error for f in findings] == [False]
    assert "estimated from the input" in str(findings[0])


def test_resume_needs_room_only_for_what_is_left(machine):
    left_inc, final = pf.results_estimate(10**6, 1000, 10)
    assert left_inc * 100 == final


def test_preflight_fails_before_weights_load(tmp_path, tiny_chat_model):
    proc = run(job_input(tmp_path), tmp_path / "s", tiny_chat_model,
               "--host-kv-cache-size", "100000000")
    assert proc.returncode == 8, proc.stderr[-2000:]
    assert "preflight failed" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr


def test_a_run_stopped_by_preflight_does_not_hold_the_next_to_its_settings(tmp_path,
                                                                           tiny_chat_model):
    """--device cuda where there is none fails preflight; the same job without it (another
    dtype: settings that decide the answers) then runs, as nothing was answered under the first."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    path = job_input(tmp_path)
    failed = run(path, tmp_path / "s", tiny_chat_model, "--device", "cuda")
    assert failed.returncode == 8 and "--device cpu" in failed.stderr, failed.stderr[-2000:]
    fixed = run(path, tmp_path / "s", tiny_chat_model)
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_gpus_are_counted_without_initialising_cuda(monkeypatch):
    """The supervisor counts GPUs through torch.cuda.device_count (NVML where present), never
    torch.cuda.is_available, which initialises the CUDA driver in a process that needs none."""
    import torch

    def initialises():
        raise AssertionError("the CUDA driver was initialised in the supervisor")

    monkeypatch.setattr(torch.cuda, "is_available", initialises)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", initialises, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert pf.cuda_device_count() == 3
    assert pf.uses_cuda("auto")


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(architectures=["JambaForCausalLM"]), "unsupported architecture"),
    (lambda c: c.update(rope_scaling={"rope_type": "no-such-rope", "factor": 2.0}),
     "rope_type 'no-such-rope'"),
])
def test_a_model_batchgen_cannot_run_is_a_model_error_not_a_crash(tmp_path, tiny_chat_model,
                                                                   edit, needle):
    """An architecture batchgen does not run is refused before any worker starts; a config the
    model code refuses while it builds (an unknown rope type) ends the worker with the model's
    exit code: one line naming it, no traceback, no crash advice (nothing was in flight)."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_chat_model, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    proc = run(job_input(tmp_path), tmp_path / "s", folder)
    assert proc.returncode == ExitCode.MODEL, proc.stderr[-2000:]
    assert needle in proc.stderr and "crashed" not in proc.stderr
    assert "Traceback" not in proc.stderr
