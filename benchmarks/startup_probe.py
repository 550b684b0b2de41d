"""Where a fresh process's start-up time goes before any model work: the imports, forking the
Triton compile workers, CUDA's initialisation and the first tensor on the device.

    python benchmarks/startup_probe.py               # the page cache as it is
    python benchmarks/startup_probe.py --readahead   # four threads read the shared libraries
                                                     # of torch, NVIDIA and Triton meanwhile

Run it first thing on a fresh machine for the cold figures; to repeat them, drop the page cache
of those libraries first (`echo 1 > /proc/sys/vm/drop_caches` as root). Prints the seconds of
each step and when it ended. Needs a CUDA device for the last three steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import threading
import time

ORIGIN = time.perf_counter()
READ_CHUNK = 1 << 24


def _read_all(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            while os.read(fd, READ_CHUNK):  # the GIL is released while the kernel reads
                pass
        finally:
            os.close(fd)


def _shared_libraries() -> list[str]:
    """The shared libraries (> 1 MB) of torch, NVIDIA's wheels and Triton, largest first."""
    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("torch").origin))
    found = []
    for root in ("torch/lib", "nvidia", "triton"):
        for folder, _, files in os.walk(os.path.join(site, root)):
            found += [os.path.join(folder, f) for f in files if ".so" in f]
    found = [p for p in found if os.path.getsize(p) > 1 << 20]
    return sorted(found, key=os.path.getsize, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readahead", action="store_true",
                        help="Read the shared libraries in four threads from the start.")
    args = parser.parse_args()
    marks: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter() - ORIGIN))

    readers = []
    if args.readahead:
        libs = _shared_libraries()
        readers = [threading.Thread(target=_read_all, args=(libs[i::4],), daemon=True)
                   for i in range(4)]
        for thread in readers:
            thread.start()
        mark(f"read-ahead started ({len(libs)} libraries, "
             f"{sum(map(os.path.getsize, libs)) / 1e9:.1f} GB)")
    import torch
    mark("import torch")
    import transformers  # noqa: F401
    mark("import transformers")
    import triton  # noqa: F401
    mark("import triton")
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=time.sleep, args=(0.5,), daemon=True) for _ in range(16)]
    for worker in workers:
        worker.start()
    mark("fork 16 processes")
    if torch.cuda.device_count():  # NVML's count: starts nothing
        torch.cuda.get_device_capability(0)
        mark("CUDA initialised (device capability)")
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        mark("first tensor on the device")
    else:
        print("no CUDA device: CUDA's steps are left out")
    for thread in readers:
        thread.join()
    if readers:
        mark("read-ahead done")
    previous = 0.0
    for name, at in marks:
        print(f"  {name:<48} {at - previous:6.2f} s (at {at:6.2f})")
        previous = at


if __name__ == "__main__":
    main()
