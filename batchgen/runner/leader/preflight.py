"""Preflight: what the machine must offer before weights load (minutes) only to fail later.

Checks that an explicit --device cuda exists, that this node has a GPU (on CPU: a core) for
each of its ranks, /dev/shm against the host KV pool, the memlock
limit when the pool is pinned on CUDA, that the result folders take new files, and free disk
for the results. Each finding names its
fix. Errors stop the job (exit 8, or 6 for disk); warnings are logged and the job goes on
(estimates, limits that may not apply).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import JobConfig
from batchgen.atomic import NOFOLLOW
from batchgen.core import human_bytes
from batchgen.engine.host_pool import host_memory_bytes, shm_free_bytes
from batchgen.io.jobfiles import JobPaths
from batchgen.parallel import cpu_cores
from batchgen.runner.files.errors import DISK_ERRNOS, PreflightFailed
from batchgen.runner.exits import ExitCode

log = logging.getLogger("batchgen.preflight")
MIN_LINE_BYTES = 300
"""No result line is shorter (ids, status, usage): a hard lower bound on what results need."""
LINE_OVERHEAD_BYTES = 600
"""Envelope of a typical success line, on top of its text."""
GB = 1e9


@dataclass(frozen=True)
class Finding:
    error: bool
    what: str
    fix: str
    code: int = ExitCode.PREFLIGHT

    def __str__(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


def memlock_limit() -> int:
    """RLIMIT_MEMLOCK soft limit in bytes (resource.RLIM_INFINITY when unlimited)."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def disk_free(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def cuda_device_count() -> int:
    """GPUs the workers will see, counted through NVML where torch can (it honours
    CUDA_VISIBLE_DEVICES): unlike torch.cuda.is_available(), that initialises no CUDA driver in
    the supervisor, which needs none and whose checks come before the workers start."""
    import torch

    return torch.cuda.device_count()


def uses_cuda(device: str) -> bool:
    if device == "auto":
        return cuda_device_count() > 0
    return device.startswith("cuda")


def check_device(config: JobConfig) -> list[Finding]:
    """--device cuda[:N] on a machine where torch sees no such GPU."""
    device = config.engine.runtime.device
    if not device.startswith("cuda"):
        return []
    count = cuda_device_count()
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index < count:
        return []
    seen = f"torch sees {count} CUDA device(s)" if count else "torch sees no CUDA device"
    return [Finding(True, f"--device {device}: {seen} here",
                    "run on a GPU node (check CUDA_VISIBLE_DEVICES and the driver), or pass "
                    "--device cpu")]


def check_ranks_per_node(config: JobConfig, external: bool = False) -> list[Finding]:
    """More ranks on this node than it has GPUs (on CPU: cores) for them: a rank past the last
    GPU would fail only after the others loaded their weights (an error); CPU ranks past the
    cores fight over them, which runs, slowly (a warning). Under torchrun / srun the launcher
    placed the ranks: not checked."""
    dist, device = config.dist, config.engine.runtime.device
    ranks = dist.world_size // dist.nnodes
    if external or ranks == 1 or ":" in device:  # cuda:N: every rank on that one GPU
        return []
    gpu = uses_cuda(device)
    if gpu:
        have, what, each = cuda_device_count(), "GPU(s)", "one rank per GPU"
        if have == 0:  # check_device names it
            return []
    else:
        have, what, each = cpu_cores(), "CPU core(s)", "a CPU rank gains nothing from a core "
        "another rank uses, and ranks that share cores run slower than fewer ranks"
    if ranks <= have:
        return []
    spread = f" over --nnodes {dist.nnodes}" if dist.nnodes > 1 else ""
    return [Finding(gpu, f"--world-size {dist.world_size}{spread} runs {ranks} ranks on this "
                    f"node, which has {have} {what}",
                    f"give --world-size {have * dist.nnodes} or less ({each}), or more nodes")]


def check_host_pool(config: JobConfig) -> list[Finding]:
    """/dev/shm and host memory against an explicit --host-kv-cache-size (the auto size already
    fits /dev/shm, with a warning from the pool itself). The size is the node's: its workers
    share it (engine.memory.plan_pools gives each 1 / workers on the node), so it is what the
    node needs whatever the number of ranks."""
    mem = config.engine.memory
    if mem.host_kv_cache_size is None:
        return []
    need = mem.host_kv_cache_size * GB
    findings = []
    total = host_memory_bytes()
    if need > total * 0.95:
        findings.append(Finding(True, f"--host-kv-cache-size {mem.host_kv_cache_size:g} GB (this "
                                f"node's host KV pool) is more than 95% of this host's "
                                f"{total / GB:.1f} GB", "lower --host-kv-cache-size"))
    if not (mem.fast_init or mem.enable_hugetlbfs):  # memfd and hugetlbfs bypass /dev/shm
        free = shm_free_bytes()
        if need > free:
            findings.append(Finding(
                True, f"the host KV pool needs {need / GB:.1f} GB of /dev/shm, {free / GB:.1f} GB "
                "is free", f"enlarge it (sudo mount -o remount,size={int(need // 2**30) + 1}G "
                "/dev/shm), lower --host-kv-cache-size, or pass --fast-init (memfd, not limited "
                "by /dev/shm)"))
    return findings


def check_memlock(config: JobConfig) -> list[Finding]:
    """Pinning the host pool (cudaHostRegister) and NCCL/InfiniBand registration can be refused
    under a small memlock limit; whether it applies depends on the driver, so only warn."""
    if not uses_cuda(config.engine.runtime.device):
        return []
    limit = memlock_limit()
    if limit == resource.RLIM_INFINITY:
        return []
    size = config.engine.memory.host_kv_cache_size
    ranks = max(1, config.dist.world_size // config.dist.nnodes)  # each pins its share
    if size is not None and size * GB / ranks <= limit:
        return []
    pool = f"{size:g} GB" if size is not None else "an auto-sized"
    return [Finding(False, f"the memlock limit is {human_bytes(limit)} and {pool} host KV pool "
                    "is pinned on CUDA", "ulimit -l unlimited (Slurm: --propagate=MEMLOCK; "
                    "docker: --ulimit memlock=-1; /etc/security/limits.conf: * - memlock "
                    "unlimited)")]


def results_estimate(input_bytes: int, records: int, left: int) -> tuple[int, int]:
    """(bytes the remaining incremental lines need, bytes the final outputs need), from the
    input's size: a result line is about its prompt's size plus an envelope."""
    per_line = input_bytes / max(records, 1) + LINE_OVERHEAD_BYTES
    return int(per_line * left), int(per_line * records)


def check_disk(paths: JobPaths, input_bytes: int, records: int, left: int) -> list[Finding]:
    incremental, final = results_estimate(input_bytes, records, left)
    need: dict[int, list] = {}  # filesystem -> [estimate, floor, folders]
    for folder, size, floor in ((paths.incremental_dir, incremental, left * MIN_LINE_BYTES),
                                (paths.output.parent, final, records * MIN_LINE_BYTES)):
        dev = _existing(folder).stat().st_dev
        entry = need.setdefault(dev, [0, 0, []])
        entry[0] += size
        entry[1] += floor
        entry[2].append(str(folder))
    findings = []
    for estimate, floor, folders in need.values():
        free = disk_free(Path(folders[0]))
        where = " and ".join(folders)
        fix = ("free space there, or put results on a bigger disk (--storage-path, --output, "
               "--incremental-output-dir)")
        if free < floor:
            findings.append(Finding(True, f"{where}: {human_bytes(free)} free, results need at "
                                    f"least {human_bytes(floor)}", fix, ExitCode.DISK))
        elif free < estimate:
            findings.append(Finding(False, f"{where}: {human_bytes(free)} free, results may need "
                                    f"about {human_bytes(estimate)} (estimated from the input)",
                                    fix))
    return findings


def merge_space(paths: JobPaths) -> str:
    """For a final merge the disk refused: what the final files need (about the incremental
    files' size: the merge copies each result line once) and what is free where they go."""
    need = 0
    for path in paths.incremental_files():
        try:
            need += path.stat().st_size
        except OSError:
            continue
    folder = paths.output.parent
    return (f"the final files need about {human_bytes(need)} under {folder}, "
            f"{human_bytes(disk_free(folder))} free there")


def check_writable(paths: JobPaths) -> list[Finding]:
    """The folders results go to take a new file now: a read-only output folder (a read-only
    mount, missing permission) would otherwise fail only at the final merge, after all the
    work. A probe file is created and removed in each (in the nearest existing folder above
    one not created yet)."""
    findings = []
    for flag, folder in (("--output", paths.output.parent),
                         ("--incremental-output-dir", paths.incremental_dir)):
        folder = _existing(folder)
        probe = folder / f".{paths.batch_id}.write-probe-{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600))
            probe.unlink()
        except OSError as err:
            code = ExitCode.DISK if err.errno in DISK_ERRNOS else ExitCode.INPUT
            findings.append(Finding(True, f"{folder} ({flag}) cannot take new files: "
                                    f"{err.strerror}", "make it writable, or give "
                                    f"{flag} a folder you can write", code))
    return findings


def preflight(config: JobConfig, paths: JobPaths, input_bytes: int, records: int,
              left: int, external: bool = False) -> list[Finding]:
    """Log warnings; raise PreflightFailed naming every error and its fix. Returns findings.
    `external`: torchrun / srun started this process as one rank (it launches none)."""
    findings = [*check_device(config), *check_ranks_per_node(config, external),
                *check_host_pool(config), *check_memlock(config),
                *check_writable(paths), *check_disk(paths, input_bytes, records, left)]
    for finding in findings:
        if not finding.error:
            log.warning("preflight: %s", finding)
    _raise_errors(findings)
    return findings


def refuse_unwritable(paths: JobPaths) -> None:
    """PreflightFailed when a result folder cannot take new files (check_writable)."""
    _raise_errors(check_writable(paths))


def _raise_errors(findings: list[Finding]) -> None:
    errors = [f for f in findings if f.error]
    if errors:
        codes = {f.code for f in errors}
        code = codes.pop() if len(codes) == 1 else ExitCode.PREFLIGHT
        raise PreflightFailed("preflight failed (no model was loaded and no request run):\n"
                              + "\n".join(f"  - {f}" for f in errors), code)


def _existing(path: Path) -> Path:
    """The nearest existing folder at or above `path` (outputs may not exist yet)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path
