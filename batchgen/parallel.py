"""Where a worker sits among the others, and the collectives its model and engine use.

Ranks are grouped into tensor-parallel (TP) groups of `tp_size` consecutive ranks (so a group
stays inside a node when TP <= GPUs per node); the groups are the data-parallel (DP) replicas.
Every rank of a TP group runs the same scheduler on the same input shard, so their decisions
agree without messages (docs/architecture.md, "Determinism across ranks"); only the group's
first rank writes results.

Nothing here is a module global: a worker builds one `Placement` and one `TensorParallel` and
passes them down.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.gpu_driver import wait_driver_init

NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in NCCL, PyTorch symmetric memory and NVSHMEM in every group,
whatever the caller's environment says: on shared hosts a program using it can put the host's
GPUs out of service."""

log = logging.getLogger("batchgen.parallel")


class ParallelError(ValueError):
    """A model or flag combination that cannot be split the way it was asked."""


@dataclass(frozen=True)
class Placement:
    rank: int = 0
    """This worker's global rank."""
    world: int = 1
    """Workers across all nodes."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    local_world: int = 1
    """Workers on this node (they share the node's host KV budget)."""
    tp_size: int = 1
    """Ranks per model replica."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world % self.tp_size:
            raise ParallelError(f"--tensor-parallel-size {self.tp_size} must divide the world "
                                f"size {self.world}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world // self.tp_size

    @property
    def writes_results(self) -> bool:
        """One rank per TP group does the I/O: its replicas compute the very same results."""
        return self.tp_rank == 0


@dataclass(frozen=True)
class TensorParallel:
    """This rank's TP group: how to split a layer and the collectives that join it again."""

    size: int = 1
    rank: int = 0
    group: Any = None
    """The torch.distributed process group (None when size is 1)."""

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` items (heads, columns, experts)."""
        if total % self.size:
            raise ParallelError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                                f"{self.size}: choose --tensor-parallel-size dividing it")
        return total // self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of a full checkpoint tensor along `dim`."""
        part = self.split(tensor.shape[dim], f"dimension {dim} of a {tuple(tensor.shape)} tensor")
        return tensor.narrow(dim, self.rank * part, part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place. Every rank gets the bitwise same result (one reduction
        order), which keeps the replicas' sampling, and so their schedulers, in lockstep."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def agree_min(self, values: list[int]) -> list[int]:
        """Elementwise minimum over the group (pool sizes measured per device must agree)."""
        if self.size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def any(self, flag: bool) -> bool:
        """True when any rank of the group says so (stop signals reach ranks at different steps)."""
        return bool(self.agree_min([0 if flag else 1])[0] == 0)

    def broadcast(self, obj: Any) -> Any:
        """The group's first rank's `obj` on every rank (picklable objects)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group,
                                   device=self._device())
        return box[0]

    def gather_digests(self, digest: bytes) -> list[bytes]:
        """Every rank's 8-byte digest, in group rank order."""
        if self.size == 1:
            return [digest]
        import torch.distributed as dist

        mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.int64,
                            device=self._device())
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()).to_bytes(8, "little", signed=True) for t in out]

    def _device(self) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity: a Slurm allocation's or a cgroup's,
    not the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pick_device(name: str) -> torch.device:
    """`name`, or for "auto" CUDA when a GPU is visible, else the CPU. GPUs are counted through
    NVML where torch can (`torch.cuda.device_count`, which honours CUDA_VISIBLE_DEVICES):
    `torch.cuda.is_available()` would start CUDA's driver, and start-up forks its Triton compile
    workers after choosing the device (engine/precompile.py), from a process that must not have
    touched the GPU; the supervisor, which needs no GPU, chooses without starting it too. The
    driver's start that `gpu_driver.start_driver_init` began is joined first."""
    if name != "cpu":
        wait_driver_init()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.device_count() > 0 else "cpu")
    return torch.device(name)


def require_device(name: str) -> None:
    """Refuse an explicit `--device cuda[:N]` where torch sees no such GPU, with the fix (a
    ValueError, which the CLI prints as one `error:` line), before anything touches CUDA.
    `batchgen run`'s preflight makes the same check (exit 8)."""
    if not name.startswith("cuda"):
        return
    wait_driver_init()
    count = torch.cuda.device_count()
    index = int(name.split(":", 1)[1]) if ":" in name else 0
    if index < count:
        return
    seen = f"torch sees {count} CUDA device(s)" if count else "torch sees no CUDA device"
    raise ValueError(f"--device {name}: {seen} here: run on a GPU node (check "
                     "CUDA_VISIBLE_DEVICES and the driver), or pass --device cpu")


def init_tensor_parallel(place: Placement, device: torch.device) -> TensorParallel:
    """Join the job's process group (torchrun's env:// variables) and build the TP groups.
    Pure data parallel needs no communication at all, so nothing is joined then."""
    if place.tp_size == 1:
        return TensorParallel()
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=place.rank, world_size=place.world)
    mine = None
    for first in range(0, place.world, place.tp_size):  # every rank creates every group
        group = dist.new_group(list(range(first, first + place.tp_size)), backend=backend)
        if place.rank in range(first, first + place.tp_size):
            mine = group
    log.info("rank %d: tensor-parallel rank %d of %d (%s), data-parallel replica %d of %d",
             place.rank, place.tp_rank, place.tp_size, backend, place.dp_rank, place.dp_size)
    return TensorParallel(place.tp_size, place.tp_rank, mine)


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous of a group started here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_group(rank: int, world: int, port: int, device: torch.device) -> TensorParallel:
    """Join a one-node tensor-parallel group of `world` processes started by the caller (rank =
    local rank; `bench --tensor-parallel-size`, the TP checks and tests), meeting at
    127.0.0.1:`port`, NVLink multicast off as in every job."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NCCL_SAFE_ENV)
    return init_tensor_parallel(Placement(rank, world, rank, world, world), device)


def default_tp_size(model_bytes: int, device_bytes: float, local_world: int) -> int:
    """The smallest TP size dividing this node's GPU count whose shards fit one device with a
    quarter of it left for the KV cache."""
    sizes = [d for d in range(1, local_world + 1) if local_world % d == 0]
    for tp in sizes:
        if model_bytes / tp <= 0.75 * device_bytes:
            return tp
    return sizes[-1]


def digest(*parts: object) -> bytes:
    """A stable 8-byte hash of plain values (decisions compared across replicas)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(repr(part).encode())
    return h.digest()
