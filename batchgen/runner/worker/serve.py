"""A worker process from its spec file to its exit code.

`main` sets the process up (stop flag, stats file, watchdog) and `serve` runs the Worker.
What ends a worker decides its code: 0 shard done, 75 stopped by a signal, 70 watchdog, and
for failures that are not the requests' fault (`known_failure`: the disk, another live writer,
the job's files gone, the model) one clear log line, the cause in the stats file for the
supervisor's report, and no crash evidence; 71 device out of memory; anything else is a crash,
whose in-flight journal strikes the requests it held (the quarantine).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

import torch

from batchgen.engine.heap import frozen_heap
from batchgen.io.jobfiles import JobPaths
from batchgen.io.reader import InputFileError
from batchgen.io.writer import ResultsFileRemoved, WriteFailed, WriterLocked
from batchgen.models.loader import CheckpointError, ModelNotFoundError
from batchgen.models.registry import UnsupportedModelError
from batchgen.parallel import ParallelError
from batchgen.runner.exits import ExitCode
from batchgen.runner.files.errors import DiskError
from batchgen.runner.files.job import JobSpec
from batchgen.runner.worker.process import (LAUNCHED_AT_ENV, StopFlag, die_with_supervisor,
                                             launched_at)
from batchgen.runner.worker.watchdog import StatsFile, Watchdog, launch_counts
from batchgen.runner.worker.worker import RankInfo, Worker, cpu_threads

log = logging.getLogger("batchgen.worker")

START_OVER = ("run the same command again to start over (keep the storage folder until the "
              "job completes)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_supervisor()
    faulthandler.enable(all_threads=True)  # a segfault or abort dumps every thread's stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s"
                        .replace("%(rank)s", os.environ.get("RANK", "0")))
    spec = JobSpec.load(argv[0]).pinned()  # the Hub commit the job's fingerprint names
    rank = RankInfo.from_env()
    stop = StopFlag(spec.config.watchdog.preempt_grace)
    stop.install()
    path = spec.paths.batch_file.with_name(f"{spec.batch_id}.worker{rank.rank}.json")
    launch = os.environ.get(LAUNCHED_AT_ENV)
    stats = StatsFile(path, initial={"rank": rank.rank, "pid": os.getpid(), "launch": launch,
                                     **launch_counts(path, launch)})
    watchdog = Watchdog(spec.config.watchdog, stats, launched_at())
    watchdog.start()
    torch.set_num_threads(cpu_threads(rank.local_world))
    return serve(spec, rank, stop, watchdog)


def serve(spec: JobSpec, rank: RankInfo, stop: StopFlag, watchdog: Watchdog) -> int:
    """Run the worker to its exit code."""
    worker = None
    try:
        worker = Worker(spec, rank, stop, watchdog)
        # Thawed before the interpreter's teardown, which must free the startup objects too
        # (native extensions report what is left alive as leaks).
        with frozen_heap():
            code = worker.run()
    except torch.cuda.OutOfMemoryError as err:
        log.error("rank %d: device out of memory (%s); the requests in flight will be retried "
                  "in smaller groups on restart", rank.rank, str(err).splitlines()[0])
        return ExitCode.DEVICE_OOM
    except Exception as err:
        failure = known_failure(err, spec.paths if spec is not None else None)
        if failure is None:
            raise
        code, said, fields = failure
        log.error("rank %d: %s", rank.rank, said)  # one clear line, no traceback
        watchdog.stats.update({"failure": said, **fields})  # the supervisor's report names it
    finally:
        if worker is not None:
            worker.close()
    if worker is not None and worker.writer is not None:
        worker.quarantine.clean_exit()
    return code


def known_failure(err: Exception, paths: JobPaths | None) -> tuple[int, str, dict] | None:
    """(exit code, the line to log, more stats fields) of a failure no request caused, or
    None for a crash."""
    if isinstance(err, (WriteFailed, DiskError)):
        return ExitCode.DISK, str(err), {}
    if isinstance(err, (ResultsFileRemoved, FileNotFoundError)):
        removed = paths.removed_while_running() if paths is not None else None
        if removed is None and not isinstance(err, ResultsFileRemoved):
            return None
        # A results file gone alone leaves every folder: the supervisor reads which from here.
        gone = removed or f"the job's results file {getattr(err, 'path', None) or 'of this rank'}"
        said = f"{removed} was removed while the job ran" if removed else str(err)
        return ExitCode.INPUT, f"{said}; {START_OVER}", {"removed": gone}
    if isinstance(err, WriterLocked):  # another live writer of the results file
        return ExitCode.LOCKED, str(err), {}
    if isinstance(err, InputFileError):  # the parsed input gone or damaged
        return ExitCode.INPUT, str(err), {}
    # The model cannot be served (an architecture or config batchgen does not run, a damaged
    # checkpoint, or a --tensor-parallel-size that does not divide its heads): no request is at
    # fault, and a rerun cannot help until the model or the flags change.
    if isinstance(err, (CheckpointError, ModelNotFoundError, UnsupportedModelError,
                        ParallelError)):
        return ExitCode.MODEL, str(err), {}
    return None


if __name__ == "__main__":
    sys.exit(main())
