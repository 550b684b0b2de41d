"""Shared folders: links planted among a job's files are never followed, storage folders other
users could tamper with are refused, two jobs never share one --output, and an output folder
that cannot take files is found before any work."""

import hashlib
import os
import stat
import subprocess

import pytest

from batchgen.atomic import UnsafeJobPath, atomic_file
from batchgen.io.jobfiles import JobPaths, check_folder_is_safe, derive_batch_id
from batchgen.io.results import item_id
from batchgen.io.writer import IncrementalWriter
from batchgen.runner.files.lock import JobLock
from batchgen.runner.worker.quarantine import CrashJournal
from job_utils import batchgen, chat_rows, read_jsonl, write_jsonl


def _batch_id(path) -> str:
    return derive_batch_id(hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.fixture
def victim(tmp_path):
    target = tmp_path / "victim.conf"
    target.write_text("precious\n")
    return target


def test_planted_links_in_a_storage_folder_are_refused(tmp_path, tiny_chat_model, victim):
    """Batch ids are predictable (the input's sha256): links planted at the lock and the
    results file must not truncate or overwrite their targets."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2, max_tokens=3))
    storage = tmp_path / "s"
    batch_id = _batch_id(inp)
    for folder in ("batches", "incremental"):
        (storage / folder).mkdir(parents=True)
    (storage / "batches" / f"{batch_id}.lock").symlink_to(victim)
    (storage / "incremental" / f"{batch_id}.jsonl").symlink_to(victim)
    done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", storage)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert victim.read_text() == "precious\n"
    assert not (storage / "batches" / f"{batch_id}.json").exists()


def test_job_files_never_open_through_a_link(tmp_path, victim):
    link = tmp_path / "b.lock"
    link.symlink_to(victim)
    with pytest.raises(UnsafeJobPath, match="symbolic link"):
        JobLock(link).acquire()
    with pytest.raises(UnsafeJobPath):
        IncrementalWriter(link)
    with pytest.raises(UnsafeJobPath):
        CrashJournal(link).start()
    target = tmp_path / "state.json"
    (tmp_path / f".state.json.tmp-{os.getpid()}").symlink_to(victim)  # a planted temp name
    with atomic_file(target) as f:
        f.write(b"{}")
    assert victim.read_text() == "precious\n" and target.read_bytes() == b"{}"
    assert not target.is_symlink()


def test_storage_folders_others_could_tamper_with_are_refused(tmp_path):
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(UnsafeJobPath, match="writable by every user"):
        check_folder_is_safe(open_to_all, "storage_path")
    open_to_all.chmod(0o1777)  # sticky, like /tmp: others cannot replace our files
    check_folder_is_safe(open_to_all, "storage_path")
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeJobPath, match="belongs to user id 12345"):
        check_folder_is_safe(theirs, "storage_path")


def test_a_world_writable_storage_folder_stops_the_job(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1, max_tokens=2))
    storage = tmp_path / "s"
    storage.mkdir()
    storage.chmod(0o777)
    done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", storage)
    assert done.returncode == 2 and "--storage-path" in done.stderr
    assert "writable by every user" in done.stderr and not any(storage.iterdir())


def test_job_folders_are_created_private(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1, max_tokens=2))
    old = os.umask(0)
    try:
        batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                 tmp_path / "s", check=True)
    finally:
        os.umask(old)
    for name in ("batches", "incremental", "uploads", "outputs", "logs", "logs/" + next(
            (tmp_path / "s" / "logs").iterdir()).name):
        assert stat.S_IMODE((tmp_path / "s" / name).stat().st_mode) == 0o750, name


LIVE_RESULTS = '{"id": "batch_req_live", "custom_id": "a", "response": null}\n'
"""Results of an earlier run of the live job, in its --output."""


def test_a_second_job_writing_the_same_output_is_refused(tmp_path, tiny_chat_model):
    """A live job holds its --output's lock; another job given that path exits 4."""
    out = tmp_path / "out.jsonl"
    out.write_text(LIVE_RESULTS)
    holder = JobLock(JobPaths.for_job(tmp_path / "a", "batch_a", output=out).output_lock,
                     "another live job writes it")
    holder.acquire()
    try:
        inp = write_jsonl(tmp_path / "b.jsonl", chat_rows(2, max_tokens=3))
        done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                        tmp_path / "b", "--output", out)
    finally:
        holder.release()
    assert done.returncode == 4, done.stderr[-2000:]
    assert f"another live job writes {out}" in done.stderr and f"pid {os.getpid()}" in done.stderr
    assert out.read_text() == LIVE_RESULTS


def test_an_output_rewritten_by_another_job_is_not_called_complete(tmp_path, tiny_chat_model):
    """Two inputs of equal size and custom_ids, one --output, one after the other: rerunning
    the first must merge its own results again, not say "already completed"."""
    out = tmp_path / "out.jsonl"
    first = write_jsonl(tmp_path / "first.jsonl", chat_rows(3, max_tokens=3))
    second = write_jsonl(tmp_path / "second.jsonl",
                         [{**r, "body": {**r["body"], "temperature": 1.0}}
                          for r in chat_rows(3, max_tokens=3)])
    common = ("--model", tiny_chat_model, "--storage-path", tmp_path / "s", "--output", out)
    batchgen("run", "--input", first, *common, check=True)
    batchgen("run", "--input", second, *common, check=True)
    rerun = batchgen("run", "--input", first, *common)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "already completed" not in rerun.stderr
    first_id = _batch_id(first)
    lines = read_jsonl(out)
    assert len(lines) == 3
    assert all(line["id"] == item_id(first_id, line["custom_id"]) for line in lines)
    again = batchgen("run", "--input", first, *common)
    assert "already completed" in again.stderr


def test_a_read_only_output_folder_is_found_before_any_work(tmp_path, tiny_chat_model):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0
    if not mounted:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2, max_tokens=3))
        done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                        tmp_path / "s", "--output", folder / "out.jsonl")
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True, check=False)
    assert done.returncode == 6, done.stderr[-2000:]
    assert "cannot take new files" in done.stderr and "--output" in done.stderr
    assert "loading" not in done.stderr  # found before the model loads
    assert not list((tmp_path / "s" / "incremental").glob("*.jsonl"))


def test_the_output_lock_leaves_no_file_and_stays_exclusive(tmp_path):
    """The output's lock file is removed on release; a run that was waiting on the removed
    file locks the new one, so a third run is still refused."""
    import threading

    from batchgen.runner.files.lock import JobLocked

    path = tmp_path / ".out.jsonl.lock"
    first = JobLock(path, "busy", remove_on_release=True)
    first.acquire()
    waiter = JobLock(path, "busy", remove_on_release=True)
    thread = threading.Thread(target=waiter.acquire, args=(30,))
    thread.start()
    first.release()
    thread.join(30)
    assert path.exists() and os.stat(path).st_ino == os.fstat(waiter._fd).st_ino
    with pytest.raises(JobLocked, match="busy"):
        JobLock(path, "busy").acquire()
    waiter.release()
    assert not path.exists()


@pytest.mark.parametrize("linked", ["output", "errors_output"])
def test_an_output_that_is_a_link_is_refused_with_the_path_to_give_instead(tmp_path, linked):
    """The final merge renames a new file onto --output: a link there would be replaced, its
    target never written. The message gave a storage folder's fix (--storage-path), which
    changes nothing for an output path."""
    from batchgen.io.jobfiles import refuse_planted_links

    paths = JobPaths.for_job(tmp_path / ".batchgen", "batch_x", output=tmp_path / "out.jsonl")
    real = tmp_path / "real.jsonl"
    getattr(paths, linked).symlink_to(real)
    with pytest.raises(UnsafeJobPath) as refused:
        refuse_planted_links(paths)
    said = str(refused.value)
    assert "symbolic link" in said and "--storage-path" not in said
    if linked == "output":
        assert f"--output {real}" in said
    else:
        assert "out.errors.jsonl (the errors file beside --output)" in said
