"""`python -m batchgen.runner.worker.worker_entry SPEC`: how the launcher starts a worker.

A worker spends seconds importing torch before `worker.main()` installs its stop handlers; a
stop signal in that window (Ctrl-C reaches every process of the terminal's group) would
otherwise end it with a KeyboardInterrupt traceback or a signal death. As the `batchgen` entry
point does for the supervisor, the early handlers make it exit 75 at once: nothing has
started, so nothing is lost.
"""

from __future__ import annotations

import sys

from batchgen.runner.exits import requeue_on_stop_signals

if __name__ == "__main__":
    requeue_on_stop_signals()
    from batchgen.runner.worker.worker import main

    sys.exit(main())
