"""A worker: the engine fed from this rank's shard of the input, results fsynced per step.

Run by the supervisor through torch.distributed's launcher (`python -m batchgen.runner.worker
SPEC.json`); rank and world size come from the launcher's environment, never from globals.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from batchgen.engine.engine import Engine, pick_device
from batchgen.io.intake import IntakeError, PendingRequest, intake
from batchgen.io.reader import read_records, record_key, shard
from batchgen.io.results import dumps, error_line, success_line
from batchgen.io.writer import IncrementalWriter, read_done_ids
from batchgen.io.jobfiles import write_json_atomic
from batchgen.models.factory import load_model
from batchgen.runner.job import EXIT_REQUEUE, JobSpec
from batchgen.runner.outputs import OutputFormatter
from batchgen.sched.scheduler import RequestTooLarge

log = logging.getLogger("batchgen.worker")
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @staticmethod
    def from_env() -> "RankInfo":
        env = os.environ
        return RankInfo(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                        int(env.get("LOCAL_RANK", 0)))


@dataclass
class StopFlag:
    """Set by SIGTERM/SIGUSR1: stop admitting, flush what is finished, exit with the requeue code."""

    requested: bool = False
    signals: int = 0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            os._exit(EXIT_REQUEUE)  # a second signal: leave now, finished lines are already safe
        self.requested = True


@dataclass
class WorkerStats:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.time)


class Worker:
    def __init__(self, spec: JobSpec, rank: RankInfo, stop: StopFlag):
        self.spec = spec
        self.rank = rank
        self.stop = stop
        cfg = spec.config
        device = pick_device(cfg.engine.runtime.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", rank.local_rank)
        self.loaded = load_model(cfg.engine.model, device)
        self.engine = Engine(self.loaded.model, cfg.engine, self.loaded.tokenizer,
                             self.loaded.eos_token_ids,
                             skip_special_tokens=not cfg.output.detokenization_include_special_tokens)
        paths = spec.paths
        self.done = read_done_ids(paths.incremental_files())
        self.writer = IncrementalWriter(paths.incremental(rank.rank, rank.world))
        self.formatter = OutputFormatter(spec, self.loaded)
        self.pending: dict[str, PendingRequest] = {}
        self.stats = WorkerStats()
        self.stats_file = paths.batch_file.with_name(f"{spec.batch_id}.worker{rank.rank}.json")
        self._last_stats = 0.0

    def run(self) -> int:
        records = shard(read_records(self.spec.config.storage.input), self.rank.rank, self.rank.world)
        limit = min(self.spec.config.engine.scheduler.max_intake_capacity,
                    self.spec.config.engine.scheduler.max_pool_size)
        exhausted = False
        while True:
            lines: list[bytes] = []
            if not self.stop.requested and not exhausted:
                exhausted = self._intake(records, limit, lines)
            if self.engine.has_unfinished():
                for finished in self.engine.step():
                    lines.append(self._result(finished))
            if lines:
                self.writer.write_batch(lines)
            self._report()
            if self.stop.requested:
                log.warning("rank %d: stop requested; finished results are on disk, %d in flight "
                            "will be recomputed on resume", self.rank.rank, self.engine.num_requests)
                self._report(force=True)
                return EXIT_REQUEUE
            if exhausted and not self.engine.has_unfinished():
                self._report(force=True)
                return 0

    def _intake(self, records, limit: int, lines: list[bytes]) -> bool:
        """Feed requests until the engine holds `limit`; True when the shard is exhausted."""
        while self.engine.num_requests < limit:
            record = next(records, None)
            if record is None:
                return True
            if record_key(record) in self.done:
                continue
            item = intake(record, self.loaded.tokenizer, self.loaded.max_context, DEFAULT_MAX_TOKENS)
            if isinstance(item, PendingRequest):
                try:
                    self.engine.add_request(item.to_request())
                    self.pending[item.custom_id] = item
                    continue
                except RequestTooLarge as err:
                    item = IntakeError(item.custom_id, item.line, "kv_pool_too_small",
                                       f"line {item.line}: {err}")
            lines.append(dumps(error_line(self.spec.batch_id, item)))
            self.stats.failed += 1
        return False

    def _result(self, finished) -> bytes:
        pending = self.pending.pop(finished.request_id)
        line = self.formatter.success(pending, finished)
        self.stats.completed += 1
        self.stats.prompt_tokens += finished.prompt_len
        self.stats.completion_tokens += finished.completion_tokens
        return dumps(line)

    def _report(self, force: bool = False) -> None:
        """Per-rank stats + heartbeat for `batchgen status` and the supervisor (every few s)."""
        now = time.time()
        if not force and now - self._last_stats < 2.0:
            return
        self._last_stats = now
        elapsed = max(now - self.stats.started, 1e-9)
        write_json_atomic(self.stats_file, {
            "rank": self.rank.rank, "heartbeat": now, "pid": os.getpid(),
            "completed": self.stats.completed, "failed": self.stats.failed,
            "prompt_tokens": self.stats.prompt_tokens,
            "completion_tokens": self.stats.completion_tokens,
            "output_tokens_per_s": self.engine.generated_tokens / elapsed,
            "engine": self.engine.stats()})

    def close(self) -> None:
        self.writer.close()
        self.engine.close()


def die_with_supervisor() -> None:
    """SIGKILL this worker when the supervisor dies (even by SIGKILL): an orphaned worker would
    keep computing and holding the job's files. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    supervisor = os.environ.get("BATCHGEN_SUPERVISOR_PID")
    if supervisor and os.getppid() != int(supervisor):
        os._exit(EXIT_REQUEUE)  # it died before prctl took effect


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_supervisor()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s"
                        .replace("%(rank)s", os.environ.get("RANK", "0")))
    spec = JobSpec.load(argv[0])
    stop = StopFlag()
    stop.install()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    worker = Worker(spec, RankInfo.from_env(), stop)
    try:
        return worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
