"""Python garbage-collector pauses inside `batchgen bench`'s timed run.

    python benchmarks/gc_pauses.py bench --shape llama3-8b --requests 1024 ...

Runs the bench command given (any `batchgen` arguments) and times every collection inside
each timed run through `gc.callbacks`; prints the runs, total and longest pause per
generation. A full (generation 2) collection re-scans every tracked
object the process holds, so a long one shows whether the startup heap is frozen
(`batchgen/engine/heap.py`).
"""

from __future__ import annotations

import gc
import runpy
import sys
import time

import batchgen.bench as bench


class PauseLog:
    def __init__(self):
        self.by_generation: dict[int, list[float]] = {}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            pause = time.perf_counter() - self._start
            self.by_generation.setdefault(info["generation"], []).append(pause)

    def report(self) -> str:
        parts = [f"gen {g}: {len(p)} runs, {sum(p) * 1e3:.1f} ms, longest {max(p) * 1e3:.2f} ms"
                 for g, p in sorted(self.by_generation.items())]
        return (f"GC in the timed run: {'; '.join(parts) or 'none'} "
                f"({gc.get_freeze_count()} objects frozen)")


def main() -> None:
    timed_run = bench._timed_run

    def with_pauses(*args, **kwargs):
        pauses = PauseLog()
        gc.callbacks.append(pauses)
        try:
            return timed_run(*args, **kwargs)
        finally:
            gc.callbacks.remove(pauses)
            print(pauses.report(), flush=True)

    bench._timed_run = with_pauses
    sys.argv = ["batchgen", *sys.argv[1:]]
    runpy.run_module("batchgen.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
