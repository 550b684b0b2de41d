"""The host pool is pinned chunk by chunk as copies first touch it, off the serving thread:
registrations never overlap and start on OS pages, nothing is registered before the graphs are
captured, a copy never spans two chunks, close undoes every registration, a failure leaves the
pool working pageable. CPU tests register through fakes; the last test uses CUDA."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from batchgen.engine.host_pin import OS_PAGE, ChunkedPin, chunk_pages

MiB = 1 << 20


class FakeCuda:
    """Records registrations like the driver would, refusing overlaps."""

    def __init__(self, fail_after: int | None = None):
        self.live: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.fail_after = fail_after
        self.calls = 0
        self.lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after:
                raise RuntimeError("cudaHostRegister failed (2)")
            first, last = ptr // OS_PAGE, (ptr + nbytes - 1) // OS_PAGE
            for start, size in self.live.items():
                if first <= (start + size - 1) // OS_PAGE and start // OS_PAGE <= last:
                    raise RuntimeError("already registered")
            self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self.lock:
            del self.live[ptr]
            self.unregistered.append(ptr)


def make_pin(cuda: FakeCuda, num_pages=40, parts=((0, 3 * MiB), (128 * MiB, 1024)),
             chunk_bytes=16 * MiB, faulted=None):
    def prefault(offset, nbytes, workers):
        if faulted is not None:
            faulted.append((offset, nbytes))

    return ChunkedPin(1 << 40, num_pages, list(parts), cuda.register, cuda.unregister,
                      prefault, workers=2, chunk_bytes=chunk_bytes)


@given(st.lists(st.integers(1, 1 << 22), min_size=1, max_size=3), st.integers(1, 1 << 31))
def test_every_part_of_a_chunk_is_whole_os_pages(part_bytes, chunk_bytes):
    pages = chunk_pages(part_bytes, chunk_bytes)
    assert all(pages * size % OS_PAGE == 0 for size in part_bytes)
    assert pages * max(part_bytes) >= min(chunk_bytes, max(part_bytes))


def test_nothing_is_registered_before_ready_and_only_touched_chunks_after():
    cuda, faulted = FakeCuda(), []
    pin = make_pin(cuda, faulted=faulted)
    # 16 MiB / 3 MiB -> 5 pages, rounded up to 8 so 1 KiB scales fill whole 4 KiB OS pages
    assert pin.pages_per_chunk == 8 and pin.num_chunks == 5
    ready = threading.Event()
    pin.start(ready)
    pin.touch([17])  # chunk 2, then 1 + 2 // 2 chunks after it
    time.sleep(0.3)
    assert not cuda.live and not any(pin.pinned)  # graphs not captured yet
    ready.set()
    pin.wait_idle(5)
    assert list(pin.pinned) == [0, 0, 1, 1, 1]
    base = 1 << 40
    assert sorted(cuda.live.items()) == sorted(
        [(base + first * 3 * MiB, 8 * 3 * MiB) for first in (16, 24, 32)]
        + [(base + 128 * MiB + first * 1024, 8 * 1024) for first in (16, 24, 32)])
    assert sorted(faulted) == sorted((ptr - base, size) for ptr, size in cuda.live.items())
    assert pin.pinned_bytes == 24 * (3 * MiB + 1024)
    assert pin.state().startswith("0.1 of 0.1 GB pinned")
    pin.touch([0])  # chunk 0 and chunk 1; the later chunks are pinned already
    pin.wait_idle(5)
    assert list(pin.pinned) == [1, 1, 1, 1, 1] and len(cuda.live) == 10
    pin.close()
    assert not cuda.live and len(cuda.unregistered) == 10 and not any(pin.pinned)


def test_the_last_chunk_may_be_partial():
    cuda = FakeCuda()
    pin = make_pin(cuda, num_pages=37)
    ready = threading.Event()
    ready.set()
    pin.start(ready)
    pin.touch([36])
    pin.wait_idle(5)
    assert cuda.live[(1 << 40) + 32 * 3 * MiB] == 5 * 3 * MiB and list(pin.pinned) == [0] * 4 + [1]
    pin.close()


def test_touching_a_pinned_or_requested_chunk_queues_nothing():
    cuda = FakeCuda()
    pin = make_pin(cuda)
    pin.touch([0, 1, 2])
    pin.touch([5, 9])
    assert pin._queue == [0, 1, 2]  # chunk 0 and the chunk after it; then chunk 1's ahead
    pin.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(1, 30)),
                max_size=6), st.booleans(), st.sampled_from([1, 3, 8]))
def test_cut_runs_never_cross_a_host_chunk(runs, host_is_src, per_chunk):
    pin = make_pin(FakeCuda(), num_pages=128)
    pin.pages_per_chunk = per_chunk
    cut = pin.cut_runs(runs, host_is_src)
    for src, dst, count in cut:
        host = src if host_is_src else dst
        assert count >= 1 and host // per_chunk == (host + count - 1) // per_chunk

    def pairs(rs):
        return [(s + i, d + i) for s, d, n in rs for i in range(n)]

    assert pairs(cut) == pairs(runs)


def test_close_stops_a_thread_that_is_still_waiting_for_ready():
    cuda = FakeCuda()
    pin = make_pin(cuda)
    pin.start(threading.Event())
    pin.touch([0])
    start = time.perf_counter()
    pin.close()
    assert time.perf_counter() - start < 2 and not cuda.live


def test_a_failed_registration_is_reported_rolled_back_and_never_raised():
    cuda = FakeCuda(fail_after=3)  # chunk 0's two parts, then chunk 1's values, then fails
    pin = make_pin(cuda)
    ready = threading.Event()
    ready.set()
    pin.start(ready)
    pin.touch([0])
    pin.wait_idle(5)
    assert "cudaHostRegister failed" in str(pin.error)
    assert list(pin.pinned) == [1, 0, 0, 0, 0]
    assert len(cuda.live) == 2  # chunk 1's half registration was undone
    assert "pinning failed" in pin.state()
    pin.touch([30])  # later copies still ask; nothing hangs
    pin.wait_idle(1)
    pin.close()
    assert not cuda.live


def test_a_context_that_cannot_be_set_stops_pinning_without_hanging(monkeypatch):
    def no_device(index):
        raise RuntimeError(f"no CUDA device {index}")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    pin = make_pin(FakeCuda())
    ready = threading.Event()
    ready.set()
    pin.start(ready, torch.device("cuda", 3))
    pin.touch([0])
    start = time.perf_counter()
    pin.wait_idle(5)
    assert time.perf_counter() - start < 2 and "no CUDA device 3" in pin.state()
    pin.close()


def test_a_part_must_start_on_an_os_page():
    with pytest.raises(ValueError, match="OS page"):
        make_pin(FakeCuda(), parts=((0, 4096), (100, 64)))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pages_round_trip_through_a_pool_pinned_as_it_fills(kv_dtype):
    from batchgen.engine.kv_cache import KVLayout
    from batchgen.engine.runner import ModelRunner
    from batchgen.sched.step import PageCopy, ScheduleOutput

    device = torch.device("cuda")
    layout = KVLayout(2, (2, 2, 64), kv_dtype, torch.bfloat16)
    runner = ModelRunner(torch.nn.Module(), layout, 64, 96, device)
    runner.host_pin.close()  # a pin with small chunks, so a copy spans several
    pin = ChunkedPin(runner.host_segment.tensor.data_ptr(), 96, runner.host_pin.parts,
                     *_cuda_calls(), runner.host_segment.prefault,
                     chunk_bytes=4 * runner.host_pin.parts[0][1])
    runner.host_pin = pin
    ready = threading.Event()
    ready.set()
    pin.start(ready, device)
    values = torch.randn(runner.device_pool.data.shape, device=device).to(kv_dtype)
    runner.device_pool.data.copy_(values)
    if layout.quantized:
        runner.device_pool.scale_pages.uniform_(0.5, 2.0)
    scales = None if not layout.quantized else runner.device_pool.scale_pages.clone()
    src, dst = list(range(2, 30)), list(range(50, 78))  # host chunks 12..19 (4 pages each)
    runner.move_pages(ScheduleOutput(swap_out=[PageCopy(0, src, dst)]))
    pin.wait_idle(30)
    assert pin.pinned[12] and pin.pinned[19] and not pin.pinned[5]
    runner.device_pool.data.zero_()
    runner.move_pages(ScheduleOutput(swap_in=[PageCopy(0, dst, src)]))
    torch.cuda.synchronize()
    assert torch.equal(runner.device_pool.data[2:30].view(torch.uint8),
                       values[2:30].view(torch.uint8))
    if scales is not None:
        assert torch.equal(runner.device_pool.scale_pages[2:30], scales[2:30])
    runner.close()


def _cuda_calls():
    from batchgen.engine.host_pin import cuda_register, cuda_unregister

    return cuda_register, cuda_unregister
