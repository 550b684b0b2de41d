"""`batchgen ...` (the console script) and `python -m batchgen ...`. For `run`, stop signals
exit 75 from the first instant: loading the command line takes ~0.5 s, and a signal death in
that window would look like a failure to a wrapper that requeues on 75."""

from __future__ import annotations

import sys

from batchgen.runner.exits import requeue_on_stop_signals


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        requeue_on_stop_signals()
    from batchgen.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
