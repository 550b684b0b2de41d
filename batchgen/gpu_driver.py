"""Start NVIDIA's driver while the imports run.

The first program to touch an idle GPU pays for the driver bringing it up: NVML's or CUDA's
first call can take seconds on a machine that keeps no persistence daemon. batchgen's first
touch is the GPU count in `parallel.pick_device` (NVML, through `torch.cuda.device_count`),
which comes after seconds of importing torch and transformers. `start_driver_init` makes that
first NVML call in a background thread from the first instant of `batchgen run`, `batchgen
bench` and each worker, so the driver comes up during the imports; ctypes releases the GIL for
the call, so the imports go on meanwhile. NVML stays initialised in the process (nothing
shuts it down), which keeps the GPU up for the CUDA context made later.

NVML never starts CUDA, so the compile workers forked later still fork from a process that has
not touched CUDA; `wait_driver_init` (called by `pick_device`, before any fork) joins the
thread first. Where there is no NVML library (no NVIDIA driver, a CPU machine) the thread ends
at once and nothing changes.

This module imports nothing of batchgen, torch or anything heavy: it must run before them.
"""

from __future__ import annotations

import ctypes
import threading

THREAD_NAME = "batchgen-nvml-init"
NVML_LIBRARY = "libnvidia-ml.so.1"


def _init_nvml(library: str) -> None:
    try:
        nvml = ctypes.CDLL(library)
        nvml.nvmlInit_v2()  # its return code is not needed: torch counts the GPUs later
    except (OSError, AttributeError):
        pass  # no driver here: the CPU path never needs it


def start_driver_init(library: str = NVML_LIBRARY) -> threading.Thread:
    """NVML's first call, in a daemon thread named THREAD_NAME; returns the thread."""
    thread = threading.Thread(target=_init_nvml, args=(library,), name=THREAD_NAME,
                              daemon=True)
    thread.start()
    return thread


def wait_driver_init() -> None:
    """Join the thread `start_driver_init` started, if one runs (before counting GPUs or forking:
    a fork while it is inside NVML would copy NVML's locks held)."""
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME and thread is not threading.current_thread():
            thread.join()
