"""The host KV tier's memory: one shared-memory segment, sized by flag or by the auto formula.

Backings: POSIX shm in /dev/shm (default; O_EXCL, mode 0600, unlinked as soon as it is mapped so
a crash cannot leak it), memfd_create + MADV_HUGEPAGE (`--fast-init`), or a hugetlbfs file
(`--enable-hugetlbfs`). On CUDA its chunks are pinned as a job first uses them
(`engine/host_pin.py`), so copies run at PCIe speed (pageable copies are ~9x slower:
docs/architecture.md, "Measured transfer costs").
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import shutil
import threading

import torch

log = logging.getLogger("batchgen.host_pool")
SHM_DIR = "/dev/shm"
HUGETLBFS_DIR = "/dev/hugepages"
MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault in a range of a mapping for writing without changing its contents."""
PREFAULT_SLICE = 256 << 20
"""Bytes one prefault call covers (the unit the prefault threads share out)."""


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def shm_free_bytes() -> int:
    try:
        return shutil.disk_usage(SHM_DIR).free
    except OSError:
        return 0


def lazy_zeros(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor whose memory the kernel commits page by page on first touch (an
    anonymous mapping): a pool sized for the worst case costs resident memory only for the
    pages a job uses."""
    mapping = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=max(num_bytes, 1))


def auto_host_pool_bytes(model_bytes: int) -> int:
    """min(host_mem * 0.9 - model_size, /dev/shm free), warning when /dev/shm is the limit."""
    budget = int(host_memory_bytes() * 0.9) - model_bytes
    free = shm_free_bytes()
    if free < budget:
        log.warning(
            "host KV pool limited by /dev/shm (%.1f GB free < %.1f GB budget). To use all host "
            "memory: sudo mount -o remount,size=%dG /dev/shm", free / 1e9, budget / 1e9,
            max(1, host_memory_bytes() // 2**30))
    return max(0, min(budget, free))


def remove_orphans(folder: str, prefix: str) -> None:
    """Delete `prefix<pid>-*` files of processes that no longer exist: a kill between creating
    a segment's file and unlinking it (microseconds apart) leaves an empty one behind."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass  # another user's file, or gone already


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: another user's process, alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class HostSegment:
    """A shared-memory mapping viewed as a uint8 tensor; closed on `close()`."""

    def __init__(self, num_bytes: int, fast_init: bool = False, hugetlbfs: bool = False):
        self.num_bytes = max(num_bytes, 1)
        self.backing = "hugetlbfs" if hugetlbfs else "memfd" if fast_init else "shm"
        fd = self._open(fast_init, hugetlbfs)
        try:
            os.ftruncate(fd, self.num_bytes)
            self._map = mmap.mmap(fd, self.num_bytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if fast_init:
            self._advise_hugepages()
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=self.num_bytes)

    def _open(self, fast_init: bool, hugetlbfs: bool) -> int:
        if hugetlbfs:
            if os.geteuid() != 0:
                raise PermissionError("--enable-hugetlbfs needs root (and reserved huge pages: "
                                      "echo N > /proc/sys/vm/nr_hugepages)")
            remove_orphans(HUGETLBFS_DIR, "batchgen-")
            path = os.path.join(HUGETLBFS_DIR, f"batchgen-{os.getpid()}-{secrets.token_hex(4)}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.unlink(path)
            return fd
        if fast_init and hasattr(os, "memfd_create"):
            return os.memfd_create("batchgen-kv", 0)
        remove_orphans(SHM_DIR, "batchgen-kv-")
        path = os.path.join(SHM_DIR, f"batchgen-kv-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)  # the mapping keeps the memory; nothing is left behind by a crash
        return fd

    def _advise_hugepages(self) -> None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
                setting = f.read()
        except OSError:
            setting = ""
        if "[never]" in setting or "[deny]" in setting:
            log.warning("--fast-init: transparent huge pages for shmem are off (%s); continuing "
                        "with 4 KiB pages. Enable: echo always > "
                        "/sys/kernel/mm/transparent_hugepage/shmem_enabled", setting.strip())
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)

    def prefault(self, offset: int, nbytes: int, workers: int) -> None:
        """Fault bytes [offset, offset + nbytes) of the mapping in, `workers` threads each over
        its share, contents unchanged (MADV_POPULATE_WRITE; ctypes releases the GIL).
        Registering memory that is already present takes ~0.05-0.09 s per GB; faulting it in
        inside the registration, one 4 KiB page at a time, ~0.7 s per GB. Kernels without the
        advice skip this step."""
        libc = ctypes.CDLL(None, use_errno=True)
        base = self.tensor.data_ptr()
        end = min(self.num_bytes, offset + nbytes)
        slices = [(start, min(PREFAULT_SLICE, end - start))
                  for start in range(offset, end, PREFAULT_SLICE)]
        unsupported = threading.Event()

        def work(mine):
            for start, length in mine:
                if unsupported.is_set():
                    return
                if libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(length),
                                MADV_POPULATE_WRITE) != 0:
                    unsupported.set()

        pool = [threading.Thread(target=work, args=(slices[i::workers],), daemon=True)
                for i in range(max(1, min(workers, len(slices))))]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()

    def close(self) -> None:
        """Unmap the segment (its pinned chunks must be unregistered first)."""
        if hasattr(self, "tensor"):
            del self.tensor
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the OS reclaims the memory at exit
