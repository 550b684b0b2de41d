"""Checkpoint tensors to the device at close to the link's speed.

Reading a tensor (from disk or the page cache) and copying it to the device one after the
other, each copy from pageable memory and synchronous, leaves both the disk and the link idle
half the time and runs the copy at a fraction of the link's speed. `stream_to_device` reads
ahead with several threads, each landing its tensor in pinned memory (the copy that also pulls
the pages in from disk), and issues every host-to-device copy asynchronously, in checkpoint
order, on the device's current stream: the model's own copies of those tensors queue behind
them, and nothing waits on the host per tensor. The readers start when the stream is made:
`load_model` makes it before it reads the model's config, so the reads overlap the import of
transformers that reading the config costs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import torch

READ_AHEAD_BYTES = 1 << 30
"""Most bytes read ahead of the tensor being copied (pinned host memory held at once)."""
READERS = 4
"""Threads reading ahead (parallel reads of one shard's tensors)."""


def stream_to_device(weights: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                     readers: int = READERS, ahead_bytes: int = READ_AHEAD_BYTES
                     ) -> StreamedWeights:
    """(name, tensor on `device`) for each of `weights`, in order, as it is iterated. The
    readers start now: a caller that still has other work before it needs the first tensor
    (importing transformers to read the model's config) overlaps it with the reads. An error
    of the reader (a corrupt shard) is raised at the tensor it concerns."""
    return StreamedWeights(_ReadAhead(iter(weights), readers, ahead_bytes,
                                      pin=device.type == "cuda" and torch.cuda.is_available()),
                           device)


class StreamedWeights:
    """Checkpoint tensors on their way to the device (stream_to_device). Iterate once; `close`
    (also at the end of the iteration) stops the readers and drops what they hold."""

    def __init__(self, staged: _ReadAhead, device: torch.device):
        self._staged, self._device = staged, device

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for name, tensor in self._staged:
                yield name, tensor.to(self._device, non_blocking=True)
        finally:
            self.close()

    def close(self) -> None:
        self._staged.close()


class _ReadAhead:
    """Tensors of an iterator, read (and pinned) by `readers` threads ahead of the consumer,
    yielded in the iterator's order; at most `ahead_bytes` are held beyond the next one."""

    def __init__(self, source: Iterator, readers: int, ahead_bytes: int, pin: bool):
        self._source, self._pin, self._limit = source, pin, ahead_bytes
        self._lock = threading.Condition()
        self._source_lock = threading.Lock()
        self._ready: dict[int, tuple[str, torch.Tensor] | BaseException] = {}
        self._next_read = 0  # index the next reader takes
        self._next_yield = 0
        self._held = 0  # bytes read and not yet yielded
        self._done_at: int | None = None  # index one past the source's last tensor
        self._closed = False
        self._threads = [threading.Thread(target=self._read, daemon=True,
                                          name=f"batchgen-weights-{i}") for i in range(readers)]
        for thread in self._threads:
            thread.start()

    def _take(self) -> tuple[int, tuple[str, torch.Tensor]] | None:
        """The next (index, item) of the source, waiting while too much is held."""
        with self._lock:
            while (self._held >= self._limit and not self._closed
                   and self._next_read > self._next_yield):
                self._lock.wait()
            if self._closed or self._done_at is not None:
                return None
        with self._source_lock:  # one reader at a time advances the source, in index order
            if self._done_at is not None:
                return None
            index = self._next_read
            try:
                item = next(self._source)
            except BaseException as err:  # noqa: BLE001 - StopIteration, or for the consumer
                with self._lock:
                    if isinstance(err, StopIteration):
                        self._done_at = index
                    else:
                        self._done_at = index + 1
                        self._ready[index] = err
                    self._lock.notify_all()
                return None
            self._next_read += 1
        with self._lock:
            self._held += item[1].numel() * item[1].element_size()
        return index, item

    def _read(self) -> None:
        while (taken := self._take()) is not None:
            index, (name, tensor) = taken
            try:
                # Copies the bytes out of the checkpoint's mapping: the disk read happens here,
                # in this thread, in parallel with the others.
                staged = tensor.pin_memory() if self._pin else tensor.contiguous()
                result: tuple[str, torch.Tensor] | BaseException = (name, staged)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer
                result = err
            with self._lock:
                self._ready[index] = result
                self._lock.notify_all()

    def __iter__(self):
        while True:
            with self._lock:
                while (self._next_yield not in self._ready
                       and self._next_yield != self._done_at):
                    self._lock.wait()
                if self._next_yield not in self._ready:
                    return  # the source is exhausted and everything was yielded
                item = self._ready.pop(self._next_yield)
                self._next_yield += 1
                if not isinstance(item, BaseException):
                    self._held -= item[1].numel() * item[1].element_size()
                self._lock.notify_all()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        with self._lock:
            self._ready.clear()  # staged tensors (pinned memory on CUDA) nobody will take
