"""The files of a job: where they live, the batch metadata file, the upload record, the
fingerprint that makes a resume refuse changed settings.

JOB_DIR/uploads/{batch_id}.json       input path + sha256 (the input is referenced, not copied)
JOB_DIR/batches/{batch_id}.json       status, counts, usage, timings, fingerprint, health
JOB_DIR/incremental/{batch_id}.jsonl  (or .rank{R}.jsonl) results in completion order
JOB_DIR/outputs/{batch_id}.jsonl      final results in input order (+ .errors.jsonl)
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchgen.atomic import UnsafeJobPath, link_message, write_json_atomic

FOLDER_MODE = 0o750
"""Mode of the folders a job creates (the umask may take more away)."""
BATCH_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed")


def derive_batch_id(input_sha256: str) -> str:
    """The job identity: the same input file resumes the same job (never from custom_ids)."""
    return "batch_" + input_sha256[:24]


def errors_path_for(output: Path) -> Path:
    """out.jsonl -> out.errors.jsonl, beside it."""
    return output.with_name(output.stem + ".errors.jsonl")


@dataclass(frozen=True)
class JobPaths:
    storage_path: Path
    batch_id: str
    incremental_dir: Path
    output: Path

    @classmethod
    def for_job(cls, storage_path: str | Path, batch_id: str,
                incremental_dir: str | Path | None = None,
                output: str | Path | None = None) -> JobPaths:
        """Paths with the documented defaults; batch_id is checked because it becomes a name."""
        if not BATCH_ID_RE.match(batch_id):
            raise ValueError(f"batch id {batch_id!r}: use letters, digits, '-' and '_' "
                             "(at most 128)")
        root = Path(storage_path)
        inc = Path(incremental_dir) if incremental_dir else root / "incremental"
        out = Path(output) if output else root / "outputs" / f"{batch_id}.jsonl"
        return cls(root, batch_id, inc, out)

    @property
    def upload_file(self) -> Path:
        return self.storage_path / "uploads" / f"{self.batch_id}.json"

    @property
    def batch_file(self) -> Path:
        return self.storage_path / "batches" / f"{self.batch_id}.json"

    @property
    def spec_file(self) -> Path:
        """The job's settings as its last run was given them (runner/files/job.py: JobSpec)."""
        return self.batch_file.with_name(f"{self.batch_id}.spec.json")

    @property
    def parsed_input(self) -> Path:
        """The input's records, parsed once by the supervisor (io/parsed_input.py)."""
        return self.storage_path / "batches" / f"{self.batch_id}.requests"

    @property
    def errors_output(self) -> Path:
        return errors_path_for(self.output)

    def incremental(self, rank: int = 0, world: int = 1) -> Path:
        """This rank's incremental file: {batch_id}.jsonl alone, {batch_id}.rank{R}.jsonl in a
        data-parallel job."""
        name = f"{self.batch_id}.jsonl" if world == 1 else f"{self.batch_id}.rank{rank}.jsonl"
        return self.incremental_dir / name

    @property
    def incremental_owner(self) -> Path:
        """The fingerprint of the job whose results the batch id's incremental files hold."""
        return self.incremental_dir / f"{self.batch_id}.owner.json"

    def incremental_files(self) -> list[Path]:
        """Every incremental file of this batch on disk, whatever world size wrote it (a resume
        with another world size must still see all finished results)."""
        single = self.incremental_dir / f"{self.batch_id}.jsonl"
        ranks = sorted(self.incremental_dir.glob(f"{self.batch_id}.rank*.jsonl"),
                       key=lambda p: int(p.name.rsplit(".rank", 1)[1].split(".")[0]))
        return ([single] if single.exists() else []) + ranks

    def removed_while_running(self) -> str | None:
        """What of the job's folders is gone (removed by hand while a run used them), or None."""
        for what, folder in (("folder", self.storage_path), ("batches folder",
                                                             self.batch_file.parent),
                             ("results folder", self.incremental_dir)):
            if not folder.is_dir():
                return f"the job's {what} {folder}"
        return None

    def make_dirs(self) -> None:
        for d in (self.upload_file.parent, self.batch_file.parent, self.incremental_dir,
                  self.storage_path / "logs", self.output.parent):
            d.mkdir(FOLDER_MODE, parents=True, exist_ok=True)

    @property
    def output_lock(self) -> Path:
        """Flocked while a run may write `output`: two jobs never write one output file."""
        return self.output.with_name(f".{self.output.name}.lock")

    def job_files(self) -> list[Path]:
        """Every file of this batch id that exists (or is a link) in the job's folders, its
        log folder and its final outputs."""
        found = [self.output, self.errors_output, self.output_lock,
                 self.storage_path / "logs" / self.batch_id]
        for folder in (self.batch_file.parent, self.upload_file.parent, self.incremental_dir):
            for pattern in (f"{self.batch_id}.*", f".{self.batch_id}.*"):
                found.extend(folder.glob(pattern))
        return [p for p in found if os.path.lexists(p)]

    def remove_write_temps(self) -> None:
        """Temp files of atomic writes (batch, upload, stats, spec files) a kill left behind.
        Only under the job lock, before any worker starts: none is being written then."""
        for folder in (self.batch_file.parent, self.upload_file.parent):
            for pattern in (f".{self.batch_id}.*tmp-*", f"{self.batch_id}.*.tmp-*"):
                for stale in folder.glob(pattern):
                    stale.unlink(missing_ok=True)

    def remove_output_temps(self) -> None:
        """Temp files of a final merge that was killed (or whose close failed)."""
        for target in (self.output, self.errors_output):
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                stale.unlink(missing_ok=True)

    def remove_incremental(self) -> None:
        for path in self.incremental_files():
            path.unlink(missing_ok=True)
        self.incremental_owner.unlink(missing_ok=True)


def refuse_planted_links(paths: JobPaths) -> None:
    """Refuse a job whose files are links (checked before anything is written)."""
    for path in paths.job_files():
        if not path.is_symlink():
            continue
        if path in (paths.output, paths.errors_output):
            raise UnsafeJobPath(_output_link_message(path, path == paths.output))
        raise UnsafeJobPath(link_message(path))


def _output_link_message(path: Path, is_output: bool) -> str:
    """A final output that is a link: the merge renames a new file onto the name, which would
    replace the link, never write where it points."""
    what = f"--output {path}" if is_output else f"{path} (the errors file beside --output)"
    fix = (f"give the path it points to (--output {path.resolve()})" if is_output
           else "remove the link")
    return (f"{what} is a symbolic link (to {os.readlink(path)!r}): results are "
            "written as a new file renamed onto that name, which would replace the link, not "
            f"write where it points; {fix}")


def check_folder_is_safe(folder: Path, flag: str) -> None:
    """Refuse a folder (and a link to one) another user could tamper with: owned by another
    user (root aside), or writable by everyone without the sticky bit (as /tmp has)."""
    me = os.geteuid()
    for st, what in ((os.lstat(folder), "the link"), (os.stat(folder), "the folder")):
        if st.st_uid not in (me, 0):
            raise UnsafeJobPath(
                f"--{flag.replace('_', '-')} {folder}: {what} belongs to user id {st.st_uid}, "
                "not to you: another user could redirect the job's files; use a folder of "
                "your own")
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & stat.S_IWOTH and not (
                st.st_mode & stat.S_ISVTX):
            raise UnsafeJobPath(
                f"--{flag.replace('_', '-')} {folder}: the folder is writable by every user "
                f"(mode {stat.S_IMODE(st.st_mode):o}, no sticky bit), so anyone could plant "
                f"links among the job's files: chmod o-w {folder}, or use a folder of your own")


def record_upload(paths: JobPaths, input_path: Path, sha256: str, size_bytes: int,
                  records: int, fmt: str) -> None:
    """uploads/{batch_id}.json: which file this job read (huge inputs are not copied)."""
    write_json_atomic(paths.upload_file, {
        "path": str(Path(input_path).resolve()), "sha256": sha256, "size_bytes": size_bytes,
        "records": records, "format": fmt, "recorded_at": int(time.time())})


class FingerprintMismatch(Exception):
    """A resume with settings that would change the answers."""


class CorruptBatchFile(Exception):
    """batches/{batch_id}.json does not parse: written atomically, so something else did it."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def make_fingerprint(parts: dict[str, Any]) -> dict[str, Any]:
    """JSON-normal form of what decides the answers (model identity, dtype, kv dtype, sampling
    defaults, input sha256, parse flags...): tuples become lists, dataclasses dicts, so a
    fingerprint compares equal to itself after a trip through the batch file."""
    return orjson.loads(orjson.dumps(parts, default=str, option=orjson.OPT_NON_STR_KEYS))


def system_fingerprint(fingerprint: dict[str, Any]) -> str:
    """OpenAI's `system_fingerprint` of a job's answers: "fp_" and 10 hex digits of its
    fingerprint without the input's sha256, so every job run with the same model, weights,
    dtypes, seed and settings shows the same one, and a change to any of them another."""
    parts = {k: v for k, v in make_fingerprint(fingerprint).items() if k != "input_sha256"}
    digest = hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return "fp_" + digest[:10]


def pinned_commit(fingerprint: dict) -> str | None:
    """The Hub commit a fingerprint's `model_weights` names (`weights_signature`'s "@sha"), or
    None for a model that is no Hub snapshot."""
    weights = fingerprint.get("model_weights")
    if not isinstance(weights, str) or "@" not in weights:
        return None
    return weights.rpartition("@")[2]


def _moved_commit_hint(before: dict, after: dict) -> str:
    """Where the weights come from another Hub commit than the job's: the branch --model (or
    --revision) names has moved since the job started, and --revision with the job's commit
    finishes it with the weights it started with."""
    then, now = pinned_commit(before), pinned_commit(after)
    if then is None or now is None or then == now:
        return ""
    return (f" (`model_weights`: --model now names Hub commit {now} (its branch moved, or "
            f"another --revision), this job started with {then}: add --revision {then} to "
            "finish it with the weights it started with)")


def check_fingerprint(old: dict, new: dict) -> None:
    """Raise FingerprintMismatch naming every key (dotted for nested dicts) whose value differs."""
    a, b = _flatten(make_fingerprint(old)), _flatten(make_fingerprint(new))
    missing = object()
    diffs = []
    for key in sorted(a.keys() | b.keys()):
        before, after = a.get(key, missing), b.get(key, missing)
        if before != after:
            show = lambda v: "<absent>" if v is missing else repr(v)  # noqa: E731
            diffs.append(f"{key}: {show(before)} -> {show(after)}")
    if diffs:
        hint = (" (`sampling_defaults`: the model's generation_config.json; "
                "--generation-config none leaves them out)"
                if any(d.startswith("sampling_defaults") for d in diffs) else "")
        hint += _moved_commit_hint(a, b)
        if [d.split(":", 1)[0] for d in diffs] == ["input_sha256"]:
            raise FingerprintMismatch(
                "refusing to resume: the input file's content changed since this job started "
                f"from it ({diffs[0]}). Put back the file it read to finish it, or answer this "
                "file as a new job (another --batch-id, or none).")
        raise FingerprintMismatch(
            "refusing to resume: this job was started with settings that decide the answers "
            "differently (" + "; ".join(diffs) + f"){hint}. Re-run with the original settings, "
            "or start a new job (--batch-id or another --storage-path).")


@dataclass
class BatchState:
    """The content of batches/{batch_id}.json (status names follow the OpenAI Batch API)."""

    batch_id: str
    status: str = "validating"
    input_file: str = ""
    output_file: str = ""
    errors_file: str = ""
    request_counts: dict = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0,
                                                 "total_tokens": 0})
    timings: dict = field(default_factory=dict)
    """Unix times (created_at, started_at, finished_at, ...) and durations in seconds."""
    throughput: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    """Engine and scheduler counters (evictions, prefill steps, ...)."""
    fingerprint: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    """Heartbeats and watchdog findings."""


class BatchFile:
    """Load / save / update batches/{batch_id}.json; every save is atomic. One writer (the
    supervisor); readers (batchgen status) always see a whole file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> BatchState | None:
        try:
            data = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as e:
            raise CorruptBatchFile(f"batch file {self.path} is not valid JSON ({e}); it is "
                                   "written atomically, so something else changed it: move it "
                                   "aside") from None
        if not isinstance(data, dict):
            raise CorruptBatchFile(f"batch file {self.path} is not a JSON object: move it aside")
        known = BatchState.__dataclass_fields__
        return BatchState(**{k: v for k, v in data.items() if k in known})

    def save(self, state: BatchState) -> None:
        if state.status not in STATUSES:
            raise ValueError(f"unknown batch status {state.status!r}: one of {STATUSES}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, asdict(state))

    def update(self, batch_id: str, **changes: Any) -> BatchState:
        """Load (or start) the state, apply changes (dict fields are merged key by key), save."""
        state = self.load() or BatchState(batch_id)
        for name, value in changes.items():
            if name not in BatchState.__dataclass_fields__:
                raise TypeError(f"BatchState has no field {name!r}")
            current = getattr(state, name)
            if isinstance(current, dict) and isinstance(value, dict):
                value = {**current, **value}
            setattr(state, name, value)
        self.save(state)
        return state
