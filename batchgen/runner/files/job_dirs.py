"""Where a job writes, checked before anything is written, each path named by its flag.

A path that cannot work (a folder where a file goes, a file where a folder goes, an output
that is the input) fails here with exit 2 rather than as a traceback after hours of
generation. The incremental folder may be shared between jobs (--incremental-output-dir), so
it records the fingerprint of the job behind each batch id's results: results of a job
with other settings are never reused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchgen.config import ConfigError, JobConfig, default_storage_path
from batchgen.atomic import read_json_dict, write_json_atomic
from batchgen.io.jobfiles import (FOLDER_MODE, FingerprintMismatch, JobPaths, check_fingerprint,
                                  check_folder_is_safe, refuse_planted_links)
from batchgen.runner.files.errors import is_disk_error


def make_job_dirs(config: JobConfig, paths: JobPaths) -> None:
    """Refuse unusable and unsafe paths, then create the job's folders (mode 0750). Unsafe:
    a storage or incremental folder another user owns or everyone may write without the
    sticky bit, a job file that is a symbolic link (UnsafeJobPath, exit 2)."""
    _check_outputs(config, paths)
    for flag, folder in _folders(config, paths):
        if folder.exists() and not folder.is_dir():
            raise _unusable_folder(config, flag, folder, None)
        try:
            folder.mkdir(_folder_mode(config, flag), parents=True, exist_ok=True)
        except OSError as err:
            if is_disk_error(err):
                raise
            raise _unusable_folder(config, flag, folder, err) from None
        if flag != "output":  # the outputs are renamed into place, which follows no link
            check_folder_is_safe(folder, flag)
    for sub in (paths.batch_file.parent, paths.upload_file.parent):
        if os.path.lexists(sub):
            check_folder_is_safe(sub, "storage_path")
    paths.make_dirs()
    refuse_planted_links(paths)


def _folders(config: JobConfig, paths: JobPaths) -> list[tuple[str, Path]]:
    """The folders a job creates, each with its flag. A given --output's folder comes first:
    the default job folder lies inside it, so a bad --output path is named as --output, not
    as the --storage-path the user never gave."""
    folders = [("storage_path", paths.storage_path),
               ("incremental_output_dir", paths.incremental_dir)]
    output = [("output", paths.output.parent)]
    return output + folders if config.storage.output is not None else folders + output


def _folder_mode(config: JobConfig, flag: str) -> int:
    """0750 for the job's own folders; a given --output's folder holds the user's results, so
    it gets the umask's mode, as any folder the user makes."""
    return 0o777 if flag == "output" and config.storage.output is not None else FOLDER_MODE


def _unusable_folder(config: JobConfig, flag: str, folder: Path,
                     err: OSError | None) -> ConfigError:
    """The error for a job folder that is a file (`err` None) or cannot be created, named by
    the flag the user gave, with the value as given: --output's folder as --output, and so is
    the default job folder (.batchgen/ beside --output), with --storage-path as the other way
    out."""
    output = config.storage.output
    beside = (flag == "storage_path" and output is not None
              and Path(config.storage.storage_path) == Path(default_storage_path(output)))
    if output is None or (flag != "output" and not beside):
        return ConfigError(flag, str(folder), "that is a file; give a folder" if err is None
                           else f"cannot create that folder ({err.strerror}): choose a "
                                "writable place")
    what, other = ((f"its job folder {folder} (the job's state, kept beside the results)",
                    "or give --storage-path another folder") if beside else
                   (f"its folder {folder}", "or give the results another path"))
    if err is None:
        return ConfigError("output", output, f"{what} is a file: move that file away, {other}")
    return ConfigError("output", output, f"{what} cannot be created ({err.strerror}): give "
                                         "--output a folder you can write"
                                         + (f", {other}" if beside else ""))


NOT_JSONL = {".parquet", ".pq", ".csv", ".tsv", ".arrow", ".feather", ".xlsx", ".gz", ".bz2",
             ".xz", ".zst", ".zip"}
"""--output suffixes that promise another format: results are always JSONL lines."""


def _check_outputs(config: JobConfig, paths: JobPaths) -> None:
    suffix = paths.output.suffix.lower()
    if suffix in NOT_JSONL:
        raise ConfigError("output", str(paths.output),
                          f"results are written as JSONL (OpenAI batch output lines), not "
                          f"{suffix}: give a .jsonl path and convert it afterwards (e.g. "
                          "pyarrow.json.read_json(path) for Parquet)")
    source = Path(config.storage.input).resolve()
    incremental = {p.resolve() for p in (paths.incremental(), *paths.incremental_files())}
    for target in (paths.output, paths.errors_output):
        if target.resolve() == source:
            raise ConfigError("output", str(paths.output), f"{target} is the input file: the "
                                                           "results would replace it")
        if target.resolve() in incremental or (
                target.parent.resolve() == paths.incremental_dir.resolve()
                and target.name.startswith(f"{paths.batch_id}.rank")):
            raise ConfigError("output", str(paths.output), f"{target} is the job's incremental "
                                                           "file; give the results another path")
        if _results_of_a_job(target):
            raise ConfigError("output", str(paths.output), f"{target} holds another job's saved "
                                                           "results (its incremental file); give "
                                                           "the results another path")
        if target.is_dir():
            raise ConfigError("output", str(paths.output), f"{target} is a folder; give a file "
                                                           "path, e.g. results.jsonl inside it")
        if _holds_other_content(target):
            raise ConfigError("output", str(paths.output),
                              f"{target} exists and does not hold batch results (its first "
                              "line is not a result line), so it is not a file a job wrote: "
                              "the results would replace it. Move it away, or give the "
                              "results another path")
        if os.path.exists(target) and not os.path.isfile(target):
            # The results are renamed into place: a device (/dev/null), FIFO or socket there
            # would be replaced by a regular file, not written to.
            raise ConfigError("output", str(paths.output),
                              f"{target} is not a regular file (a device, pipe or socket), "
                              "which the results would replace: give a file path")


RESULT_LINE_START = re.compile(rb'\s*\{\s*"id"\s*:\s*"batch_req_')
"""How a batch result line starts (batchgen's, and OpenAI's batch output files)."""


def _holds_other_content(target: Path) -> bool:
    """Whether `target` is a non-empty regular file whose first line is not a batch result
    line: a file of the user's (notes, another input), which the final rename would destroy
    for good. A job's results, another job's included, may be replaced: they stay in that
    job's incremental file."""
    try:
        if not target.is_file() or target.is_symlink():
            return False
        with open(target, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # unreadable: the write that follows names the problem
    return bool(head.strip()) and not RESULT_LINE_START.match(head)


def _results_of_a_job(target: Path) -> bool:
    """Whether `target` is a job's incremental file: {batch_id}.jsonl or {batch_id}.rankR.jsonl
    beside that batch's owner record ({batch_id}.owner.json)."""
    batch_id = target.name.removesuffix(".jsonl").split(".rank", 1)[0]
    return target.name.endswith(".jsonl") and target.with_name(f"{batch_id}.owner.json").exists()


def claim_incremental(paths: JobPaths, fingerprint: dict, job_recorded: bool,
                      as_recorded=lambda old, new: new) -> None:
    """Record (once) the fingerprint of the job whose results the batch id's incremental files
    hold, or refuse a job with another: a shared --incremental-output-dir must not hand one job
    another's answers. A job with the same fingerprint gives the same answers, so its results
    are this job's too (wherever its folder lies: job folders are copied and moved, and the
    results file's lock keeps two live writers apart). `as_recorded(old, new)`: `new` in the
    form an earlier version recorded `old` in."""
    owner = read_json_dict(paths.incremental_owner)  # unreadable: rewritten if the job is ours
    if owner is not None and isinstance(owner.get("fingerprint"), dict):
        try:
            check_fingerprint(owner["fingerprint"], as_recorded(owner["fingerprint"],
                                                                fingerprint))
        except FingerprintMismatch as err:
            raise FingerprintMismatch(
                f"{paths.incremental_dir} holds results of batch {paths.batch_id} written by a "
                f"job with other settings: {err}. For a separate job, give it its own "
                "--incremental-output-dir.") from None
        return
    if not job_recorded and paths.incremental_files():
        raise FingerprintMismatch(
            f"{paths.incremental_dir} holds results of batch {paths.batch_id} that no job "
            f"under {paths.storage_path} recorded: give this job its own "
            "--incremental-output-dir (or another --batch-id), or point --storage-path at the "
            "job that wrote them")
    write_json_atomic(paths.incremental_owner, {"fingerprint": fingerprint})
