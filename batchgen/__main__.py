"""`batchgen ...` (the console script) and `python -m batchgen ...`. For `run`, stop signals
exit 75 from the first instant: loading the command line takes ~0.5 s, and a signal death in
that window would look like a failure to a wrapper that requeues on 75. Once the command has
decided its exit code, they are ignored: Python restores the default handlers (death by
signal) while it tears down, but keeps ignored ones ignored. `run` and `bench` start the GPU's
driver in a background thread and, where the install ships no bytecode, its compilation in
other processes before their imports (gpu_driver.py, bytecode.py)."""

from __future__ import annotations

import sys

from batchgen.bytecode import start_bytecode_compile
from batchgen.gpu_driver import start_driver_init
from batchgen.runner.exits import (
    ExitCode,
    exit_code_of,
    exit_without_teardown,
    ignore_stop_signals,
    requeue_on_stop_signals,
)


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else None
    run = command == "run"
    if run:
        requeue_on_stop_signals(announce=True)
    if command in ("run", "bench"):
        start_bytecode_compile()
        start_driver_init()
    from batchgen.cli import main as cli_main

    try:
        cli_main()
        code = ExitCode.OK
    except SystemExit as done:
        code = exit_code_of(done)
        if code is None:
            raise  # Python prints the message
    finally:
        if run:  # the exit code is decided; what is left of the exit must keep it
            ignore_stop_signals()
    exit_without_teardown(code)


if __name__ == "__main__":
    main()
