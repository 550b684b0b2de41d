"""`python -m batchgen.runner.worker.worker_entry SPEC`: how the launcher starts a worker.

A worker spends seconds importing torch before `serve.main()` installs its stop handlers; a
stop signal in that window (Ctrl-C reaches every process of the terminal's group) would
otherwise end it with a KeyboardInterrupt traceback or a signal death. As the `batchgen` entry
point does for the supervisor, the early handlers make it exit 75 at once: nothing has
started, so nothing is lost.

The imports (torch, transformers) and the model load run with Python's cyclic garbage
collector off: what they create lives for the whole run, so every collection in that window
only re-scans it (importing torch and transformers took 15-25% longer with the collector on,
~0.5 s on a 2-core machine). The worker turns it back on once the model is loaded, before the
engine runs any forward (`Worker.__init__`). The GPU's driver starts in a background thread
meanwhile (gpu_driver.py), and bytecode is compiled ahead where the install ships none and no
supervisor set up a cache for it already (bytecode.py). A worker that returns leaves without the
interpreter's teardown (`exit_without_teardown`: with torch loaded, up to a second after its
results are durable and its stats written, before the launcher sees it end).
"""

from __future__ import annotations

import gc

from batchgen.bytecode import start_bytecode_compile
from batchgen.gpu_driver import start_driver_init
from batchgen.runner.exits import exit_without_teardown, requeue_on_stop_signals


def start() -> int:
    requeue_on_stop_signals()
    start_bytecode_compile()
    start_driver_init()
    gc.disable()
    from batchgen.runner.worker.serve import main

    return main()


if __name__ == "__main__":
    exit_without_teardown(start())
