"""Where a job's files may live: local (or mounted shared) paths only. A URL given as a path
(`https://`, `s3://`, `gs://`, `hf://`, ...) is refused before any work starts, rather than
read as a missing file or written under a folder named `https:`."""

from __future__ import annotations

import re

from batchgen.io.reader import InputFileError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_KNOWN = re.compile(r"^(https?|s3a?|gs|gcs|hf|az|abfss?|wasbs?|ftp|sftp|file|hdfs):/",
                    re.IGNORECASE)
"""Known schemes even after a path library collapsed `//` into `/` (`https:/host/x`)."""


_SPELLED_WITH_A_VOWEL_SOUND = {"http", "https", "s3", "s3a", "hf", "hdfs", "ftp", "sftp", "az",
                               "abfs", "abfss"}
"""Schemes read letter by letter from a vowel sound ("an https:// URL", "a gs:// URL")."""


def url_scheme(value: str) -> str | None:
    """The scheme of a URL-looking path, or None for a plain path."""
    match = _URL.match(value) or _KNOWN.match(value)
    return match.group(1).lower() if match else None


def refuse_urls(**paths: str | None) -> None:
    """Raise InputFileError for the first flag (keyword name, e.g. input=...) holding a URL."""
    for flag, value in paths.items():
        scheme = url_scheme(str(value)) if value is not None else None
        if scheme is None:
            continue
        name = "--" + flag.replace("_", "-")
        fix = ("download the file first and give its path (e.g. with `aws s3 cp`, "
               "`gcloud storage cp`, `hf download` or `curl -O`)" if flag == "input"
               else "give a local path and copy the results up after the job ends (e.g. with "
               "`aws s3 cp`, `gcloud storage cp` or `hf upload`)")
        article = "an" if scheme in _SPELLED_WITH_A_VOWEL_SOUND else "a"
        raise InputFileError(
            f"{name} {value!r} is {article} {scheme}:// URL: batchgen reads and writes local or "
            "mounted shared-filesystem paths only (http(s)://, s3://, gs://, hf:// are not "
            f"supported): {fix}")


def refuse_storage_urls(storage) -> None:
    """refuse_urls over a StorageConfig's paths (--input, --output, --storage-path,
    --incremental-output-dir)."""
    refuse_urls(input=storage.input, output=storage.output, storage_path=storage.storage_path,
                incremental_output_dir=storage.incremental_output_dir)
