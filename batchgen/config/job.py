"""The job's configuration around the engine's: files and state, outputs, distribution and
the watchdog (`JobConfig`), and where batchgen keeps its cache and job state by default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.config.base import REASONING_FIELD_CHOICES, require
from batchgen.config.engine import EngineConfig

def cache_root() -> Path:
    """batchgen's own cache (converted GGUF models, compiled bytecode): $BATCHGEN_CACHE, else
    ~/.cache/batchgen."""
    return Path(os.environ.get("BATCHGEN_CACHE", "~/.cache/batchgen")).expanduser()


MIN_LINE_BYTES = 64
"""The smallest --max-line-bytes (run and validate): below it no request line fits."""
MAX_SECONDS = 1e9
"""Longest deadline or grace a seconds flag takes (~31 years): the watchdog's timers and the
stop grace's need one the platform's timers can hold (about 9.2e9 s), and twice a timeout
for the watchdog's backstop. Leaving a timeout out disables it."""


def default_storage_path(output: str | None) -> str:
    """Where a job's state goes without --storage-path: `.batchgen/` beside --output, else
    $BATCHGEN_STATE_DIR, else $XDG_STATE_HOME/batchgen (~/.local/state/batchgen). Never a
    folder relative to the working directory: run from a source tree, that would write job
    state into it, or create a `batchgen/` folder that shadows the package on import."""
    if output:
        return str(Path(output).expanduser().absolute().parent / ".batchgen")
    if os.environ.get("BATCHGEN_STATE_DIR"):
        return os.environ["BATCHGEN_STATE_DIR"]
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "batchgen")


@dataclass(frozen=True)
class StorageConfig:
    input: str = ""
    """Requests file: JSONL (OpenAI batch lines or plain lines) or Parquet."""
    output: str | None = None
    """Final results in input order (default {storage}/outputs/{batch_id}.jsonl); errors go to
    <stem>.errors.jsonl beside it."""
    max_tokens: int = 256
    """max_tokens of request lines that give none (nor max_completion_tokens)."""
    storage_path: str | None = None
    """Job folder: uploads/, batches/, incremental/, outputs/. Default: .batchgen/ beside
    --output, else $BATCHGEN_STATE_DIR or ~/.local/state/batchgen (XDG_STATE_HOME)."""
    batch_id: str | None = None
    """Job identity (default: derived from the input's sha256, so re-running resumes)."""
    save_result: bool = False
    """Also keep {storage}/outputs/{batch_id}.jsonl when --output points elsewhere."""
    incremental_output_dir: str | None = None
    """Folder of the incremental (fsynced, completion-order) results; default
    {storage}/incremental/."""
    no_incremental_save: bool = False
    """Do not write incremental results (a crash then loses all unfinished work)."""
    wait_for_lock: float = 0.0
    """Seconds to wait for another live run of this job to end before refusing (exit 4); 0
    refuses at once. For a requeued job that may start while the old run still flushes."""
    max_line_bytes: int = 8 << 20
    """Longest JSONL input line read (bytes, its newline not counted); a longer line is never
    held in memory and becomes a line_too_long error line (custom_id `line-N`)."""

    def __post_init__(self) -> None:
        if self.storage_path is None:
            object.__setattr__(self, "storage_path", default_storage_path(self.output))

    def validate(self) -> None:
        require(bool(self.input), "input", self.input, "a path to a .jsonl or .parquet file")
        require(self.output is None or (self.output.strip() not in ("", "-")), "output",
                 self.output, "a path to the results file (they are written and fsynced to a "
                 "file: standard output is not supported)")
        # As typed: a Path would drop the trailing "/" (or "/.") that says "this folder".
        require(self.output is None or os.path.basename(self.output) not in ("", ".", ".."),
                 "output", self.output, "that names a folder; give the results file's path, "
                 f"e.g. {os.path.join(self.output or '', 'results.jsonl')}")
        require(self.max_line_bytes >= MIN_LINE_BYTES, "max_line_bytes", self.max_line_bytes,
                 f"bytes >= {MIN_LINE_BYTES}")
        require(bool(self.storage_path), "storage_path", self.storage_path, "a folder path")
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        require(self.wait_for_lock >= 0, "wait_for_lock", self.wait_for_lock, "seconds >= 0")
        if self.batch_id is not None:
            plain = self.batch_id.replace("-", "").replace("_", "")
            ok = plain.isalnum() and len(self.batch_id) <= 128
            require(ok, "batch_id", self.batch_id, "letters, digits, '-' and '_' (at most 128)")


@dataclass(frozen=True)
class OutputConfig:
    parse_thinking: bool = False
    """Move reasoning (<think>...</think>, harmony analysis) into message.reasoning_content."""
    parse_tool_call: bool = False
    """Parse tool calls into message.tool_calls (finish_reason tool_calls), on lines that give
    tools and a tool_choice other than "none". Lines whose tool_choice forces a call are
    always parsed."""
    tool_call_parser: str = "auto"
    """Tool-call format: auto (from the model), hermes, deepseek_v3, llama3_json."""
    reasoning_field: str = "reasoning_content"
    """Where reasoning goes: reasoning_content, reasoning, or both."""
    detokenization_include_special_tokens: bool = False
    """Keep special tokens in the detokenized text."""

    def validate(self) -> None:
        require(self.reasoning_field in REASONING_FIELD_CHOICES, "reasoning_field",
                 self.reasoning_field, "one of " + ", ".join(REASONING_FIELD_CHOICES))
        parsers = ("auto", "hermes", "deepseek_v3", "llama3_json")
        require(self.tool_call_parser in parsers, "tool_call_parser", self.tool_call_parser,
                 "one of " + ", ".join(parsers))


@dataclass(frozen=True)
class DistConfig:
    world_size: int = 1
    """Total workers (GPUs) across all nodes."""
    nnodes: int = 1
    """Number of nodes."""
    node_rank: int = 0
    """This node's rank (0 is the master)."""
    dist_init_addr: str = "localhost:12355"
    """host:port of the rendezvous (the master node)."""
    tensor_parallel_size: int | None = None
    """Ranks per model replica (default: 1 for models that fit one device); DP = world / TP."""
    max_restarts: int = 0
    """Times the launcher restarts a failed worker group before giving up."""

    def validate(self) -> None:
        require(self.world_size >= 1, "world_size", self.world_size, "an integer >= 1")
        require(self.nnodes >= 1, "nnodes", self.nnodes, "an integer >= 1")
        require(self.world_size % self.nnodes == 0, "world_size", self.world_size,
                 f"must be divisible by --nnodes ({self.nnodes})")
        require(0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank,
                 f"an integer in [0, {self.nnodes})")
        host, _, port = self.dist_init_addr.rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "dist_init_addr",
                 self.dist_init_addr, "host:port, e.g. 10.0.0.1:12355")
        tp = self.tensor_parallel_size
        require(tp is None or (tp >= 1 and self.world_size % tp == 0), "tensor_parallel_size",
                 tp, f"a divisor of --world-size ({self.world_size}), the job's GPUs in all"
                 + (f": for {tp} GPUs give --world-size {tp} too (data parallel is --world-size"
                    " / --tensor-parallel-size)" if tp and tp > self.world_size else ""))
        require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")


@dataclass(frozen=True)
class WatchdogConfig:
    watchdog_timeout: float | None = None
    """Seconds one scheduler step may take (disabled by default; 600 recommended)."""
    decode_step_timeout: float | None = None
    """Seconds one decode iteration may take (disabled by default; 300 recommended). A decode
    burst (--decode-burst-steps) is timed as one iteration: keep the timeout well above a few
    steps' time."""
    startup_timeout: float | None = None
    """Seconds from launch to the first step (disabled by default; 1800 for large models)."""
    no_watchdog: bool = False
    """Disable every watchdog deadline."""
    watchdog_heartbeat_interval: float | None = None
    """Seconds between heartbeats written to the batch file's health section."""
    preempt_grace: float = 20.0
    """Seconds between SIGTERM/SIGUSR1 and exit (flush included); exit code 75 means requeue."""
    quarantine_after: int = 3
    """A request in flight during this many consecutive crashes becomes an error line."""
    inflight_checkpoint_interval: float = 30.0
    """Seconds between saves of the requests in flight (their tokens so far, fsynced, between
    steps): a kill loses at most this much decoding, and a resume continues their answers.
    0 saves only on a stop signal."""

    def validate(self) -> None:
        for name in ("watchdog_timeout", "decode_step_timeout", "startup_timeout",
                     "watchdog_heartbeat_interval"):
            value = getattr(self, name)
            require(value is None or 0 < value <= MAX_SECONDS, name, value,
                     f"seconds > 0 and <= {MAX_SECONDS:g} (leave the flag out to disable it)")
        require(0 < self.preempt_grace <= MAX_SECONDS, "preempt_grace", self.preempt_grace,
                 f"seconds > 0 and <= {MAX_SECONDS:g}")
        require(self.quarantine_after >= 1, "quarantine_after", self.quarantine_after,
                 "an integer >= 1")
        require(self.inflight_checkpoint_interval >= 0, "inflight_checkpoint_interval",
                 self.inflight_checkpoint_interval, "seconds >= 0 (0: only on a stop)")


@dataclass(frozen=True)
class JobConfig:
    """Everything `batchgen run` was told."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def validate(self) -> "JobConfig":
        self.engine.validate()
        for part in (self.storage, self.output, self.dist, self.watchdog):
            part.validate()
        return self
