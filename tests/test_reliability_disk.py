"""A full or failing disk: exit 6 with a clear message (no traceback), nothing acknowledged lost,
and the same command resumes once there is space. Tiny tmpfs mounts when we may mount (root);
otherwise the worker's test hook makes the results file's disk "fill up" (ENOSPC injected)."""

import errno
import math
import os
import subprocess

import pytest
from test_reliability_support import (
    batch_state,
    check_against_clean,
    clean_storage,
    incremental_file,
    job_input,
    record_figures,
    run,
)

from batchgen.io.writer import IncrementalScan
from batchgen.testing.faults import DISK_FULL_ENV


@pytest.fixture
def tmpfs():
    mounted = []

    def mount(folder, size_bytes: int) -> bool:
        folder.mkdir(parents=True, exist_ok=True)
        size = f"size={max(4096, math.ceil(size_bytes / 4096) * 4096)}"
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(folder)],
                            capture_output=True, check=False).returncode == 0
        if ok:
            mounted.append(folder)
        return ok

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def _grow(folder) -> None:
    subprocess.run(["mount", "-o", "remount,size=16m", str(folder)], check=True)


@pytest.mark.slow
def test_results_disk_full_then_resume_with_space(tmp_path, tiny_chat_model, tmpfs):
    inp = job_input(tmp_path)
    storage, inc_dir = tmp_path / "s", tmp_path / "inc"
    half = incremental_file(clean_storage(tiny_chat_model)).stat().st_size // 2
    extra = ("--incremental-output-dir", inc_dir)
    if tmpfs(inc_dir, half):
        how, proc = "tmpfs ENOSPC", run(inp, storage, tiny_chat_model, *extra)
    else:
        how = "injected ENOSPC"
        proc = run(inp, storage, tiny_chat_model, *extra, env={DISK_FULL_ENV: str(half)})
    assert proc.returncode == 6, proc.stderr[-3000:]
    assert "No space left on device" in proc.stderr
    assert "run the same command again" in proc.stderr
    assert "Traceback" not in proc.stderr
    acknowledged = IncrementalScan(next(inc_dir.glob("*.jsonl")))
    kept = [cid for _, _, cid in acknowledged]
    assert 0 < len(kept) < 32 and acknowledged.size == acknowledged.good_end  # rolled back
    if how.startswith("tmpfs"):
        _grow(inc_dir)
    run(inp, storage, tiny_chat_model, *extra, check=True)
    figures = check_against_clean(storage, tiny_chat_model, incremental_dir=inc_dir)
    after = [cid for _, _, cid in IncrementalScan(next(inc_dir.glob("*.jsonl")))]
    assert after[:len(kept)] == kept, "an acknowledged result was lost or rewritten"
    record_figures("disk_full_results", how=how, acknowledged_before=len(kept), **figures)


@pytest.mark.slow
def test_output_disk_full_at_finalize_then_resume(tmp_path, tiny_chat_model, tmpfs):
    out_dir = tmp_path / "out"
    clean_outputs = (clean_storage(tiny_chat_model) / "outputs").glob("*.jsonl")
    half = max(p.stat().st_size for p in clean_outputs) // 2
    if not tmpfs(out_dir, half):
        pytest.skip("cannot mount a tmpfs here (needs root); the results variant covers EFBIG")
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    extra = ("--output", out_dir / "results.jsonl")
    proc = run(inp, storage, tiny_chat_model, *extra)
    assert proc.returncode == 6, proc.stderr[-3000:]
    assert "could not write the final outputs" in proc.stderr and "Traceback" not in proc.stderr
    assert "the final files need about" in proc.stderr, proc.stderr[-2000:]  # how much to free
    assert f"under {out_dir}, " in proc.stderr and " free there)" in proc.stderr
    assert not list(out_dir.iterdir()), "a failed finalize must leave no partial or temp file"
    assert "could not write the final outputs" in batch_state(storage)["health"]["last_failure"]
    _grow(out_dir)
    proc = run(inp, storage, tiny_chat_model, *extra, check=True)
    assert "32 already done" in proc.stderr  # nothing recomputed: only the merge was redone
    figures = check_against_clean(storage, tiny_chat_model, output_dir=out_dir)
    record_figures("disk_full_finalize", how="tmpfs ENOSPC", **figures)


def test_injected_full_disk_rolls_back_like_a_real_one(tmp_path):
    from batchgen.io.writer import WriteFailed
    from batchgen.io.writer import IncrementalWriter
    from batchgen.testing.faults import WriterFault

    line = b'{"custom_id": "%d", "response": null}\n'
    with IncrementalWriter(tmp_path / "r.jsonl", fault=WriterFault(disk_full_at=100)) as writer:
        writer.write_batch([line % 1, line % 2])
        with pytest.raises(WriteFailed, match="No space left on device"):
            writer.write_batch([line % 3, line % 4])
    assert (tmp_path / "r.jsonl").read_bytes() == line % 1 + line % 2


@pytest.mark.parametrize("code, advice", [
    (errno.ENOSPC, "free space and run the same command again"),
    (errno.EROFS, "mounted read-only: remount it read-write"),
    (errno.EDQUOT, "disk quota"),
    (errno.EIO, "I/O error"),
    (errno.EFBIG, "ulimit -f")])
def test_each_disk_error_says_what_to_do_about_it(code, advice):
    from batchgen.runner.files.errors import DiskError, disk_errors

    with pytest.raises(DiskError) as caught:
        with disk_errors("write the results"):
            raise OSError(code, os.strerror(code), "/data/out.jsonl")
    message = str(caught.value)
    assert message.startswith("could not write the results") and "/data/out.jsonl" in message
    assert advice in message and "saved before are safe" in message


def test_a_full_job_folder_is_named_beside_a_roomy_results_folder(tmp_path, tmpfs):
    """The in-flight checkpoint lives in the job's batches/ folder, results in
    --incremental-output-dir: when the worker exits 6 without recording why (its stats file
    sits on the full disk too), the free space of both is given, not only that of the
    results folder, which has room."""
    from types import SimpleNamespace

    from batchgen.io.jobfiles import JobPaths
    from batchgen.runner.exits import ExitCode
    from batchgen.runner.leader.launch import WorkerFailure
    from batchgen.runner.leader.failures import failure_cause

    if not tmpfs(tmp_path / "storage", 8192):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    paths = JobPaths.for_job(tmp_path / "storage", "batch_1", tmp_path / "incremental")
    paths.make_dirs()
    spec = SimpleNamespace(batch_id="batch_1", paths=paths)
    cause = failure_cause(spec, WorkerFailure(0, ExitCode.DISK, ""))
    assert f"MB free under {paths.incremental_dir}" in cause
    assert f"MB free under {paths.batch_file.parent}" in cause and "checkpoint" in cause
