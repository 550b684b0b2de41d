"""A worker: the engine fed from this rank's shard of the input, results fsynced per step.

Run by the supervisor through torch.distributed's launcher (`python -m
batchgen.runner.worker.worker_entry SPEC.json`, which calls serve.main); rank and world size
come from the launcher's environment, never from globals. serve.py maps what ends a worker to
its exit code.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from batchgen.engine.engine import Engine
from batchgen.engine.memory import job_demand_tokens
from batchgen.engine.embed import step_tokens
from batchgen.engine.precompile import CompileWorkers
from batchgen.engine.resume import ResumeError
from batchgen.io.embeddings import EmbeddingRequest
from batchgen.io.intake import (IntakeError, ParsedRequest, PendingRequest, tokenize_parsed,
                               with_model_defaults)
from batchgen.io.parsed_input import read_parsed
from batchgen.io.results import dumps, error_line, is_success
from batchgen.io.templates import SpecialTextNote
from batchgen.io.jobfiles import JobPaths
from batchgen.io.writer import IdSet, IncrementalWriter, WriterLocked, read_done_ids
from batchgen.models.convert import read_manifest
from batchgen.models.factory import load_model, model_folder, weight_bytes
from batchgen.models.loader import MANIFEST
from batchgen.parallel import (Placement, cpu_cores, default_tp_size,
                               init_tensor_parallel, pick_device)
from batchgen.phases import StartupClock
from batchgen.runner.files.errors import disk_errors
from batchgen.runner.worker.embed_jobs import EmbeddingJobs
from batchgen.runner.worker.grammars import Grammars
from batchgen.runner.worker.inflight import InflightCheckpoints, with_progress
from batchgen.runner.worker.job_size import held_at_once, job_sequences
from batchgen.runner.worker.stand_in import precompile_hook
from batchgen.runner.exits import ExitCode
from batchgen.runner.files.job import JobSpec
from batchgen.runner.worker.outputs import OutputFormatter
from batchgen.runner.worker.process import StopFlag, launched_at
from batchgen.runner.worker.quarantine import Quarantine
from batchgen.runner.worker.watchdog import Watchdog, guard_decode_steps
from batchgen.sched.scheduler import RequestTooLarge
from batchgen.testing import faults

log = logging.getLogger("batchgen.worker")
STATS_EVERY_S = 2.0
ORPHAN_WAIT_S = 10.0
ERROR_LINES_PER_STEP = 4096
"""Most error lines one intake pass holds before they are written: a long run of bad lines
(an input of mostly refused lines) is flushed as it is read, not held whole in memory."""


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    restarted: bool = False
    """torchrun restarted this worker group after a failure."""
    local_world: int = 1

    @staticmethod
    def from_env() -> RankInfo:
        env = os.environ
        return RankInfo(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                        int(env.get("LOCAL_RANK", 0)),
                        int(env.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0,
                        int(env.get("LOCAL_WORLD_SIZE", 1)))


def placement(spec: JobSpec, rank: RankInfo, device: torch.device) -> Placement:
    """Where this worker sits: --tensor-parallel-size, or the smallest TP that fits the model
    on one device (logged). Every rank computes the same answer from the same inputs."""
    tp = spec.config.dist.tensor_parallel_size
    if tp is None:
        tp = sharded_tp_size(spec.config.engine.model, rank.world)
    if tp is None:
        tp = 1
        if device.type == "cuda" and rank.world > 1:
            memory = spec.config.engine.memory
            total = torch.cuda.get_device_properties(device).total_memory
            device_bytes = total * memory.gpu_memory_frac
            model_bytes = weight_bytes(spec.config.engine.model, device, rank.world)
            tp = default_tp_size(model_bytes, device_bytes, rank.local_world)
            if rank.rank == 0:
                log.info("tensor-parallel size %d: the smallest that fits %.1f GB of weights "
                         "on one device (--tensor-parallel-size overrides it)", tp,
                         model_bytes / 1e9)
    return Placement(rank.rank, rank.world, rank.local_rank, rank.local_world, tp)


def sharded_tp_size(model_cfg, world: int) -> int | None:
    """The TP size a `batchgen convert --tensor-parallel-size` folder was sharded for (it can
    load at no other), or None when the weights are whole."""
    folder, _ = model_folder(model_cfg, world)
    if not (folder / MANIFEST).is_file():
        return None
    size = read_manifest(folder).get("tensor_parallel_size", 1)
    return size if size > 1 else None


@dataclass
class WorkerStats:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Of prompt_tokens, those the prefix cache held (the results' usage says so each)."""
    started: float = field(default_factory=time.time)


class Worker:
    """One rank. Data-parallel replicas (TP groups) take disjoint, equal shards of the input,
    requests that start alike in the same shard (io/prefix_shards.py); inside a TP group every
    rank reads the same shard and runs the same scheduler, and only the group's first rank
    writes results and the crash journal."""

    def __init__(self, spec: JobSpec, rank: RankInfo, stop: StopFlag, watchdog: Watchdog):
        self.spec, self.rank, self.stop, self.watchdog = spec, rank, stop, watchdog
        self.clock = StartupClock(origin=launched_at() or None)
        self.clock.mark("process")
        self.stats = WorkerStats(**watchdog.stats.counts())  # an earlier attempt's, restarted
        device, compile_workers = self._open_device()
        self.place = placement(spec, rank, device)
        self.tp = init_tensor_parallel(self.place, device)
        self._open_job_files()
        self.clock.mark("config")
        sequences = job_sequences(self._records(), self.done,
                                  spec.config.engine.runtime.cuda_graph_max_bucket_size)
        self._start_engine(device, compile_workers, sequences)
        self.formatter = OutputFormatter(spec, self.loaded)
        self.grammars = Grammars(self.loaded.tokenizer, self.loaded.hf_config.vocab_size,
                                 self.loaded.eos_token_ids, self.formatter.tool_format)
        self.special_text = SpecialTextNote(self.loaded.tokenizer)
        self.embeddings = EmbeddingJobs(self.loaded, spec.batch_id,
                                        step_tokens(spec.config.engine.scheduler.max_prefill_tokens))
        self.handled: set[str] = set()
        """Suspects served (or quarantined) before the main pass, which must skip them."""
        self._last_stats = 0.0

    def _open_device(self) -> tuple[torch.device, CompileWorkers | None]:
        """This rank's device and, on CUDA, Triton's compile processes: forks taken before
        this process touches the GPU, which compile while the weights load
        (engine/precompile.py)."""
        device = pick_device(self.spec.config.engine.runtime.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.rank.local_rank)
        compile_workers = None
        if device.type == "cuda":
            compile_workers = CompileWorkers(device=device)
            self.clock.mark("workers")
            torch.cuda.set_device(device)  # creates CUDA's context
            self.clock.mark("device")
        return device, compile_workers

    def _open_job_files(self) -> None:
        """The quarantine, and on the rank that writes results the results file, the crash
        journal and the in-flight checkpoints; what is done and what can resume mid-answer,
        the same on every rank of a TP group (which must admit the same requests the same
        way)."""
        cfg, paths, place = self.spec.config, self.spec.paths, self.place
        self.quarantine = Quarantine(paths.batch_file.parent, self.spec.batch_id, place.dp_rank,
                                     cfg.watchdog.quarantine_after)
        self.writer = self.checkpoints = None
        self.done = None
        if place.writes_results:
            with disk_errors("open the results file and the crash journal"):
                self.writer, self.done = open_results(paths, place.dp_rank, place.dp_size)
                self.quarantine.recover(self.done, self.rank.restarted)
            with disk_errors("open the in-flight checkpoint"):
                self.checkpoints = InflightCheckpoints(
                    paths, self.spec.batch_id, place.dp_rank, place.dp_size,
                    cfg.watchdog.inflight_checkpoint_interval, self.done)
        self.done = self.tp.broadcast(self.done if self.writer else None)
        self.resumable = self.tp.broadcast(self.checkpoints.resumable if self.checkpoints
                                           else None)

    def _start_engine(self, device: torch.device, compile_workers: CompileWorkers | None,
                      sequences: int) -> None:
        """Load the model (kernels compiled meanwhile) and start the engine, its KV pools sized
        for what this replica's share of the job can hold at once."""
        spec, rank, cfg = self.spec, self.rank, self.spec.config
        self.loaded = load_model(cfg.engine.model, device, rank.world, self.tp,
                                 before_weights=precompile_hook(
                                     compile_workers, device, cfg.engine, sequences, self.tp,
                                     lambda: self.clock.mark("precompile")))
        self.clock.mark("weights")
        if spec.chat_template is not None and self.loaded.tokenizer is not None:
            # the text the supervisor read and fingerprinted, never the file again
            self.loaded.tokenizer.chat_template = spec.chat_template
        # Off through the imports and the load (worker_entry.py); on again before the engine
        # runs forwards, whose cyclic garbage (an exception's frames) may hold device memory.
        gc.enable()
        sched = cfg.engine.scheduler
        # Only lines that decode hold KV: a job left with embeddings (and bad lines) only
        # (sequences 0) needs no more than one request's pages, and one resumed with a few
        # requests left their pages, not a pool, pinned on the host, sized for every line.
        decoding = held_at_once(sequences, cfg.engine.runtime.cuda_graph_max_bucket_size,
                                -(-spec.total_records // self.place.dp_size))
        demand = job_demand_tokens(decoding,
                                   min(sched.max_intake_capacity, sched.max_pool_size),
                                   self.loaded.max_context)
        self.engine = Engine(self.loaded.model, cfg.engine, self.loaded.tokenizer,
                             self.loaded.eos_token_ids,
                             skip_special_tokens=(
                                 not cfg.output.detokenization_include_special_tokens),
                             tp=self.tp, host_share=1.0 / rank.local_world,
                             demand_tokens=demand,
                             job_sequences=sequences,
                             compile_workers=compile_workers)
        self._mark_engine_phases()
        guard_decode_steps(self.engine, self.watchdog, faults.stuck_seconds())

    def _mark_engine_phases(self) -> None:
        """The engine's start-up (pools, then CUDA graphs) as phases of this worker."""
        phases = self.engine.runner.startup
        end = time.time()
        graphs = phases.get("graphs", 0.0)
        self.clock.mark("host_pool", end - graphs)
        if "graphs" in phases:
            self.clock.mark("graphs", end)

    def _records(self):
        """This replica's shard of the records the supervisor parsed (never the input), less
        those whose results are saved (passed over unread)."""
        return read_parsed(self.spec.paths.parsed_input, self.place.dp_rank, self.place.dp_size,
                           skip=self.done)

    def run(self) -> int:
        self.stop.serving = True
        # The writing rank owns the crash journal; its replicas serve the same groups.
        groups = self._isolate_suspects() if self.writer else None
        groups, handled = self.tp.broadcast((groups, self.handled))
        self.handled = set(handled)
        for group in groups:
            self.handled.update(r.key for r in group)
            if self._serve(iter(group), limit=len(group)):
                return ExitCode.REQUEUE
        if self.writer and self.quarantine.book.strikes:
            self.quarantine.suspects_served()  # answered, or no longer this replica's
            self._report(force=True)
        sched = self.spec.config.engine.scheduler
        rest = (r for r in self._records() if r.key not in self.handled)
        if self._serve(rest, min(sched.max_intake_capacity, sched.max_pool_size)):
            return ExitCode.REQUEUE
        if self.checkpoints:
            self.checkpoints.remove()
            self._report(force=True)
        return ExitCode.OK

    def _isolate_suspects(self) -> list[list]:
        """Quarantine the convicted suspects; the others are served first, in small groups."""
        q = self.quarantine
        if not q.book.strikes:
            return []
        records = [r for r in self._records() if q.is_suspect(r.key)]
        convicted = [r for r in records if q.convicted(r.key)]
        others = [r for r in records if not q.convicted(r.key)]
        if convicted:
            self.writer.write_batch([q.error_line(r) for r in convicted])
            keys = [r.key for r in convicted]
            q.mark_quarantined(keys)
            self.handled.update(keys)
            self.stats.failed += len(keys)
            log.error("rank %d: quarantined %s after repeated crashes", self.rank.rank, keys)
        groups = q.isolation_groups(others)
        if groups:
            log.warning("rank %d: %d requests were in flight at the last crash; serving them "
                        "first in %d isolated groups", self.rank.rank,
                        sum(map(len, groups)), len(groups))
        return groups

    def _serve(self, records, limit: int) -> bool:
        """Admit from `records` (at most `limit` in the engine) until they are all finished;
        True when a stop signal ended it early."""
        exhausted = False
        while True:
            # A stop signal reaches the ranks of a TP group at different steps: they act on it
            # together, or their schedulers (and collectives) would part ways.
            stopping = self.tp.any(self.stop.requested)
            with self.watchdog.deadline("step"):
                lines: list[bytes] = []
                if not stopping and not exhausted:
                    exhausted = self._intake(records, limit, lines)
                lines.extend(self._embedded())
                # Stopping: no new step (a whole decode burst or prefill could outlast the
                # worker's share of the grace period, and the stop checkpoint with it); only
                # the burst the last step queued is collected.
                if not stopping and self.engine.has_unfinished():
                    lines.extend(self._result(f) for f in self.engine.step())
                    self.clock.mark("first_token")
                if stopping:  # a burst still on the device: its tokens go into the checkpoint
                    lines.extend(self._result(f) for f in self.engine.settle())
                if lines and self.writer:
                    self.writer.write_batch(lines)
                    self.clock.mark("first_result")
                self._checkpoint(stopping)
            self.watchdog.started()
            self._report()
            if stopping:
                log.warning("rank %d: stop requested; finished results are on disk; %s",
                            self.rank.rank, self._in_flight_words())
                self._report(force=True)
                return True
            if exhausted and not self.engine.has_unfinished() and not len(self.embeddings):
                self._report(force=True)
                return False

    def _in_flight_words(self) -> str:
        """What a stop leaves in flight: the requests read, and those of them whose drawn
        tokens the checkpoint holds (the rest have none to continue: they start on resume)."""
        read = self.engine.num_requests
        held = self.checkpoints.stats["requests"] if self.checkpoints else 0
        return (f"{read} in flight, {min(held, read)} of them with tokens drawn, which the "
                "resume continues from the checkpoint")

    def _checkpoint(self, stopping: bool) -> None:
        """Save the progress of the requests in flight, after the results they depend on are
        durable: on a stop, and every --inflight-checkpoint-interval seconds."""
        if self.checkpoints is None or not (stopping or self.checkpoints.due()):
            return
        # Saved progress not admitted yet (a long input admits as it goes) stays in the file.
        with disk_errors(f"write the in-flight checkpoint {self.checkpoints.file.path}"):
            self.checkpoints.save(lambda: {**self.resumable, **self.engine.inflight_state()},
                                  self.engine.generated_tokens)

    def _admit(self, request) -> None:
        """Add `request`, continued from its checkpoint when it has one; a checkpoint that
        cannot continue it is dropped and the request starts over."""
        resumed = with_progress(request, self.resumable)
        try:
            self.engine.add_request(resumed)
        except ResumeError as err:
            log.warning("rank %d: %s; it starts over", self.rank.rank, err)
            if self.checkpoints:
                self.checkpoints.file.restart(request.request_id)
            self.engine.add_request(request)

    def _intake(self, records, limit: int, lines: list[bytes]) -> bool:
        """Feed requests until the engine holds `limit` (or `lines` holds ERROR_LINES_PER_STEP
        error lines, written before reading on); True when `records` is exhausted. Each
        line is journaled before its template, tokenizer and grammar run: a crash in them (a
        native library's) gives it a strike like a crash in the engine would."""
        exhausted = False
        while (self.engine.num_requests + len(self.embeddings) < limit
               and len(lines) < ERROR_LINES_PER_STEP):
            record = next(records, None)
            if record is None:
                exhausted = True
                break
            if record.key in self.done:
                continue
            if self.writer:
                with disk_errors("journal the request read"):
                    self.quarantine.admitted([record.key])
            item = record.item  # parsed and checked by the supervisor: tokenized here
            if isinstance(item, ParsedRequest):
                item = with_model_defaults(item, self.spec.sampling_defaults)
            if not isinstance(item, IntakeError):
                item = tokenize_parsed(item, self.loaded.tokenizer, self.loaded.max_context,
                                       self.spec.config.engine.model.max_model_len,
                                       self.loaded.hf_config.vocab_size)
            if isinstance(item, EmbeddingRequest):
                item = self.embeddings.add(item)  # None: queued for this step's embedding
                if item is None:
                    continue
            if isinstance(item, PendingRequest) and not self.loaded.model.generates:
                item = IntakeError(item.custom_id, item.line, "unsupported_model",
                                   f"line {item.line}: {self.loaded.name} has no language-model "
                                   "head (no lm_head.weight in its checkpoint, and config.json's "
                                   "tie_word_embeddings is false: an embedding model's "
                                   "checkpoint): it answers /v1/embeddings lines only; a model "
                                   "that generates needs its lm_head.weight restored", "model")
            if isinstance(item, PendingRequest):
                self.special_text.check(item.line, item.messages, item.prompt)
                request = self.grammars.request(item)
                if isinstance(request, IntakeError):
                    item = request
            if isinstance(item, PendingRequest):
                try:
                    self._admit(request)
                    continue
                except RequestTooLarge as err:
                    item = pool_too_small(item, err)
            lines.append(dumps(error_line(self.spec.batch_id, item)))
            self.stats.failed += 1
        return exhausted

    def _embedded(self) -> list[bytes]:
        done = self.embeddings.run()
        failed = sum(not is_success(line) for line, _ in done)
        self.stats.completed += len(done) - failed
        self.stats.failed += failed
        self.stats.prompt_tokens += sum(tokens for _, tokens in done)
        return [dumps(line) for line, _ in done]

    def _result(self, finished) -> bytes:
        line = self.formatter.success(finished.request.origin, finished)
        self.stats.completed += 1
        self.stats.prompt_tokens += finished.prompt_len
        self.stats.completion_tokens += finished.completion_tokens
        self.stats.cached_tokens += finished.cached_tokens
        return dumps(line)

    def _report(self, force: bool = False) -> None:
        """Per-rank stats + heartbeat for `batchgen status` and the supervisor (every few s)."""
        now = time.time()
        if not force and now - self._last_stats < STATS_EVERY_S:
            return
        self._last_stats = now
        elapsed = max(now - self.stats.started, 1e-9)
        q = self.quarantine.book
        # A TP group computes each result once across its ranks: only the writing rank counts
        # it (the others still report their heartbeat and health).
        counted = self.writer is not None
        stats = self.stats if counted else WorkerStats(started=self.stats.started)
        self.watchdog.stats.update({
            "rank": self.rank.rank, "pid": os.getpid(), "writes_results": counted,
            "completed": stats.completed, "failed": stats.failed,
            "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "cached_tokens": stats.cached_tokens,
            "output_tokens_per_s": self.engine.generated_tokens / elapsed if counted else 0.0,
            "input_tokens_per_s": stats.prompt_tokens / elapsed,
            "engine": self.engine.stats() if counted else {}, "suspects": len(q.strikes),
            "quarantined": list(q.quarantined),
            "checkpoint": dict(self.checkpoints.stats) if self.checkpoints else {},
            "startup": list(self.clock.durations().items()), "startup_origin": self.clock.origin,
            "host_pool_pin": self.engine.runner.host_pin_state(),
            **self.watchdog.health()})

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        self.engine.close()


def pool_too_small(item: PendingRequest, err: RequestTooLarge) -> IntakeError:
    """The error line of a request no KV pool of this run can hold. Like any error line it is
    saved as the line's result, so rerunning the job does not retry it: the message says to
    answer the refused lines as a job of their own, with the larger pool."""
    return IntakeError(item.custom_id, item.line, "kv_pool_too_small",
                       f"line {item.line}: {err}. This error is the line's saved result, so "
                       "rerunning this job does not retry it: put the lines the errors file "
                       "names in a new input and run that with the larger pool")


def cpu_threads(local_world: int = 1) -> int:
    """Torch's intra-op threads for this worker: its share of the cores this process may use (its
    CPU affinity: a Slurm allocation's or cgroup's, not the whole machine's) among the node's
    `local_world` ranks, unless OMP_NUM_THREADS is set (its first level wins). OpenMP threads
    spin-wait, so more threads than idle cores (every rank taking every core) makes CPU decoding
    many times slower."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return max(1, cpu_cores() // max(1, local_world))


def open_results(paths: JobPaths, dp_rank: int, dp_size: int,
                 wait_s: float = ORPHAN_WAIT_S) -> tuple[IncrementalWriter, IdSet]:
    """This rank's results file, locked, and the ids finished in any rank's file, read once
    the lock is ours: a live writer we waited for may have added lines meanwhile."""
    writer = open_writer(paths.incremental(dp_rank, dp_size), wait_s)
    return writer, read_done_ids(paths.incremental_files())


def open_writer(path, wait_s: float = ORPHAN_WAIT_S) -> IncrementalWriter:
    """Open this rank's results file. The worker of a killed run dies of PDEATHSIG
    asynchronously and holds the file's lock until it is gone: give it a moment."""
    deadline = time.monotonic() + wait_s
    fault = faults.writer_fault()
    while True:
        try:
            return IncrementalWriter(path, fault=fault)
        except WriterLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

