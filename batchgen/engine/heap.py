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


@contextlib.contextmanager
def frozen_heap():
    """Collect once, then exempt every surviving object from collection (`gc.freeze`) for the
    block: enter when startup is done (model loaded, graphs captured, warm-up run). Thawed on
    the way out: a process that goes on after an engine (bench's peer or second half) needs
    the closed engine's reference cycles (its CUDA graphs hold the runner, which owns the
    device pools) collectable, and one about to exit must not leave frozen objects to the
    interpreter's teardown, which never frees them (native extensions such as nanobind then
    print each as a leak)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
