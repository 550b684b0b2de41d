"""Page-locking the host tier as a job fills it, one chunk at a time, off the serving thread.

Copies between the device and pinned (cudaHostRegister'd) memory run ~9x faster than pageable
ones, but pinning costs host time in proportion to the memory pinned: the kernel faults in and
locks every 4 KiB page (~0.27 s per GB with 8 threads, then ~0.09 s per GB to register), and
unpinning and freeing it costs as much again at the end. A job that never moves a page to the
host must not pay that for a pool sized for the worst case.

So the segment is cut into chunks of whole KV pages (about `CHUNK_BYTES` each). A chunk is
pinned the first time a copy touches it (with the chunks after it, as `touch` says: the page
allocator hands out the lowest free ids first), by a background thread that faults the chunk
in with parallel threads and registers it. Until then copies to and from that chunk run pageable:
slower, equally correct. A copy never spans two chunks (`cut_runs`): one DMA then never
crosses a registration's edge or mixes pinned and pageable memory. Registration starts only
once `ready` is set (CUDA graphs captured: a registration must not run inside a capture).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("batchgen.host_pool")
CHUNK_BYTES = 1 << 30
"""About how many bytes of KV pages one chunk holds (rounded to whole, aligned pages)."""
OS_PAGE = 4096
"""Registrations start on an OS page boundary, so two chunks never share a locked page."""


def chunk_pages(part_bytes: list[int], chunk_bytes: int = CHUNK_BYTES) -> int:
    """KV pages per chunk: about `chunk_bytes` of the largest part, rounded up so that every
    part's share of a chunk is a whole number of OS pages."""
    align = 1
    for per_page in part_bytes:
        step = per_page & -per_page  # the largest power of two dividing it
        align = max(align, OS_PAGE // min(step, OS_PAGE))
    pages = max(1, chunk_bytes // max(part_bytes))
    return -(-pages // align) * align


class ChunkedPin:
    """Pins chunks of a host pool on demand. `parts`: (byte offset in the segment, bytes per
    KV page) of each region a page has data in (the values; fp8 pools also their scales),
    each offset OS-page aligned. `register(ptr, nbytes)` / `unregister(ptr)`: the CUDA calls
    (raise on failure); `prefault(offset, nbytes, workers)`: fault a byte range in."""

    def __init__(self, base: int, num_pages: int, parts: list[tuple[int, int]],
                 register: Callable[[int, int], None], unregister: Callable[[int], None],
                 prefault: Callable[[int, int, int], None], workers: int = 8,
                 chunk_bytes: int = CHUNK_BYTES):
        for offset, _ in parts:
            if offset % OS_PAGE:
                raise ValueError(f"a pinned part must start on an OS page (offset {offset})")
        self.base = base
        self.num_pages = num_pages
        self.parts = parts
        self.pages_per_chunk = chunk_pages([size for _, size in parts], chunk_bytes)
        self.num_chunks = -(-num_pages // self.pages_per_chunk)
        self._register, self._unregister, self._prefault = register, unregister, prefault
        self.workers = workers
        self.pinned = bytearray(self.num_chunks)
        """1 for each chunk registered (written by the pinning thread only)."""
        self._wanted = bytearray(self.num_chunks)
        self._queue: list[int] = []
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """Why a chunk could not be pinned (pinning then stops; the pool works pageable)."""

    def start(self, ready: threading.Event, device: torch.device | None = None) -> None:
        """Serve pin requests in a background thread once `ready` is set. `device`: the CUDA
        device whose context registers the chunks (without an index: the caller's current
        device)."""
        index = None
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._serve, args=(ready, index),
                                        name="batchgen-host-pin", daemon=True)
        self._thread.start()

    def touch(self, pages: Iterable[int]) -> None:
        """Ask for the chunks holding `pages` to be pinned, and the chunks after each: one
        more, plus half as many as lie below it (the pool fills from its low pages up, so a
        job that has filled c chunks soon touches the next ones; pinning ahead in proportion
        keeps a fast-filling job's copies pinned while over-pinning by at most half)."""
        chunks = sorted({page // self.pages_per_chunk for page in pages})
        new = [c for chunk in chunks for c in range(chunk, chunk + 2 + chunk // 2)
               if c < self.num_chunks and not self._wanted[c]]
        if not new or self.error is not None:
            return
        with self._wake:
            for chunk in new:
                if not self._wanted[chunk]:
                    self._wanted[chunk] = 1
                    self._queue.append(chunk)
            self._wake.notify()

    def cut_runs(self, runs: list[tuple[int, int, int]], host_is_src: bool):
        """`runs` (first source page, first destination page, count) cut so that no run
        crosses a chunk boundary on the host side."""
        size = self.pages_per_chunk
        out = []
        for src, dst, count in runs:
            while count:
                host = src if host_is_src else dst
                piece = min(count, size - host % size)
                out.append((src, dst, piece))
                src, dst, count = src + piece, dst + piece, count - piece
        return out

    @property
    def pinned_bytes(self) -> int:
        per_page = sum(size for _, size in self.parts)
        pages = sum(self._pages(chunk) for chunk in range(self.num_chunks) if self.pinned[chunk])
        return pages * per_page

    def state(self) -> str:
        total = self.num_pages * sum(size for _, size in self.parts)
        text = f"{self.pinned_bytes / 1e9:.1f} of {total / 1e9:.1f} GB pinned"
        return text if self.error is None else f"{text}; pinning failed: {self.error}"

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every requested chunk is pinned (or pinning failed or stopped)."""
        end = time.monotonic() + timeout
        with self._wake:
            while self._queue and self.error is None and not self._stop:
                if not self._wake.wait(max(0.0, end - time.monotonic())):
                    return

    def _pages(self, chunk: int) -> int:
        first = chunk * self.pages_per_chunk
        return min(self.pages_per_chunk, self.num_pages - first)

    def _ranges(self, chunk: int) -> list[tuple[int, int]]:
        first, count = chunk * self.pages_per_chunk, self._pages(chunk)
        return [(offset + first * size, count * size) for offset, size in self.parts]

    def _serve(self, ready: threading.Event, device_index: int | None) -> None:
        while not ready.wait(0.1):
            if self._stop:
                return
        if device_index is not None:
            try:
                torch.cuda.set_device(device_index)
            except BaseException as err:
                self._fail(err)
                return
        while True:
            with self._wake:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                chunk = self._queue[0]
            try:
                self._pin(chunk)
            except BaseException as err:  # reported by the runner; the pool works pageable
                self._fail(err)
                return
            with self._wake:
                self._queue.pop(0)
                self._wake.notify_all()

    def _fail(self, err: BaseException) -> None:
        self.error = err
        log.warning("pinning the host KV pool stopped (%s); its remaining copies run pageable "
                    "(slower)", err)
        with self._wake:
            self._queue.clear()
            self._wake.notify_all()

    def _pin(self, chunk: int) -> None:
        ranges = self._ranges(chunk)
        for offset, nbytes in ranges:
            self._prefault(offset, nbytes, self.workers)
        done = []
        try:
            for offset, nbytes in ranges:
                self._register(self.base + offset, nbytes)
                done.append(offset)
        except BaseException:
            for offset in done:
                self._unregister(self.base + offset)
            raise
        self.pinned[chunk] = 1

    def close(self) -> None:
        """Stop pinning (a registration in progress ends first) and unregister every chunk."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        for chunk in range(self.num_chunks):
            if self.pinned[chunk]:
                for offset, _ in self._ranges(chunk):
                    self._unregister(self.base + offset)
                self.pinned[chunk] = 0

    def __del__(self) -> None:
        # An engine dropped without close() must not leave ranges registered with CUDA: a
        # later registration of the same addresses would fail ("already mapped").
        try:
            if any(self.pinned):
                self.close()
        except Exception:
            pass


def cuda_register(ptr: int, nbytes: int) -> None:
    torch.cuda.init()  # the cudart call needs a live context
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 1e9:.1f} GB failed ({err}); check "
                           "`ulimit -l` (memlock) and free host memory")


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
