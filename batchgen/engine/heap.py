"""Keep Python's cyclic garbage collector off the hot loop.

By the time the engine serves, the process holds a few hundred thousand long-lived objects
(torch, transformers, the model's modules, the tokenizer). Python's collector re-scans all of
them on every full (oldest-generation) collection, which the job's own allocations trigger now
and then: on an H200 running W1 one such pass paused the host for 225 ms in a 60 s run, while
the device waited for the next step. Freezing the heap once startup is over moves those objects
out of the collector's sight while the engine serves; objects made afterwards are collected as
usual, so reference cycles the job creates are still freed.
"""

from __future__ import annotations

import contextlib
import gc


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from future collections (`gc.freeze`).
    Call when startup is done (model loaded, graphs captured, warm-up run). Returns the number
    of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap():
    """`freeze_startup_heap()` for the block only. A process that goes on after an engine
    (bench's peer or second half) must thaw: the closed engine's reference cycles (its CUDA
    graphs hold the runner) still own the device pools, and only a collection frees them. So
    must one about to exit: objects still frozen at interpreter teardown are never freed, and
    native extensions (nanobind) print each as a leak."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
