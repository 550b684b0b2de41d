"""Checkpoint tensors read ahead by several threads reach the model in checkpoint order, with
bounded memory, and a reader's error surfaces at the tensor it concerns."""

import random
import threading
import time

import pytest
import torch

from batchgen.models.weight_stream import _ReadAhead, stream_to_device


def _source(count, delay=0.0, fail_at=None, held=None):
    rng = random.Random(0)
    for i in range(count):
        if i == fail_at:
            raise OSError(f"shard truncated at tensor {i}")
        if delay:
            time.sleep(rng.random() * delay)
        if held is not None:
            held.append(i)
        yield f"t{i}", torch.full((16,), float(i))


def test_order_and_values_kept_with_many_readers():
    out = list(stream_to_device(_source(50, delay=0.002), torch.device("cpu"), readers=6))
    assert [name for name, _ in out] == [f"t{i}" for i in range(50)]
    assert all(float(t[0]) == i for i, (_, t) in enumerate(out))


def test_reader_error_raised_at_its_tensor():
    seen = []
    with pytest.raises(OSError, match="truncated at tensor 7"):
        for name, _ in stream_to_device(_source(20, fail_at=7), torch.device("cpu"), readers=3):
            seen.append(name)
    assert seen == [f"t{i}" for i in range(7)]


def test_read_ahead_is_bounded():
    taken = []
    staged = _ReadAhead(_source(100, held=taken), readers=4, ahead_bytes=4 * 16 * 4, pin=False)
    it = iter(staged)
    next(it)
    time.sleep(0.2)
    # 4 tensors of 64 bytes fit the budget; a reader may hold one more while it waits.
    assert len(taken) <= 1 + 4 + 4
    rest = list(it)
    assert len(rest) == 99
    staged.close()


def test_consumer_stopping_early_ends_the_readers():
    before = threading.active_count()
    stream = stream_to_device(_source(1000), torch.device("cpu"), readers=4, ahead_bytes=256)
    next(iter(stream))
    stream.close()  # the readers are told and joined
    assert threading.active_count() <= before


def test_readers_start_before_the_first_tensor_is_asked_for():
    """stream_to_device starts reading at once, so a caller's own work before the first
    tensor (reading the model's config) overlaps the reads; closing it unread ends them."""
    before = threading.active_count()
    taken = []
    stream = stream_to_device(_source(10, held=taken), torch.device("cpu"), readers=2)
    deadline = time.monotonic() + 5
    while len(taken) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(taken) == 10
    stream.close()
    assert threading.active_count() <= before
