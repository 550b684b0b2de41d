"""A job's storage folder removed by hand while the job runs: the worker stops at its next
write with one clear line (no traceback), and the same command then starts the job over."""

import os
import shutil

from job_utils import chat_rows
from test_reliability_support import count_lines, job_input, kill_group, launch, run, wait_for

from batchgen.io.jobfiles import JobPaths
from batchgen.io.writer import IncrementalWriter, ResultsFileRemoved


def test_a_results_file_removed_while_written_is_reported(tmp_path):
    path = tmp_path / "inc" / "job.jsonl"
    with IncrementalWriter(path) as writer:
        writer.write_batch([b'{"custom_id": "a"}\n'])
        path.unlink()
        try:
            writer.write_batch([b'{"custom_id": "b"}\n'])
        except ResultsFileRemoved as err:
            assert "was removed while the job was writing it" in str(err)
        else:
            raise AssertionError("a write to a removed file was taken as saved")


def test_removed_job_folders_are_named(tmp_path):
    paths = JobPaths.for_job(tmp_path / "s", "batch_x")
    paths.make_dirs()
    assert paths.removed_while_running() is None
    shutil.rmtree(paths.incremental_dir)
    assert paths.removed_while_running() == f"the job's results folder {paths.incremental_dir}"
    shutil.rmtree(paths.storage_path)
    assert paths.removed_while_running() == f"the job's folder {paths.storage_path}"


ROWS = chat_rows(24, max_tokens=40)


def _remove_mid_run(tmp_path, model, remove) -> tuple:
    """Run a job one sequence at a time, `remove(storage)` once its first result is saved;
    (storage, input, stderr) once it exited 2; then the same command completes it."""
    inp = job_input(tmp_path / "in", ROWS)
    storage = tmp_path / "s"
    proc = launch(inp, storage, model, "--max-num-seqs", "1")
    try:
        assert wait_for(lambda: count_lines(storage) >= 1, timeout=240, poll=0.05)
        remove(storage)
        _, stderr = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return storage, inp, stderr


def test_a_storage_folder_removed_mid_run_stops_the_job_with_a_way_out(tmp_path,
                                                                       tiny_chat_model):
    storage, inp, stderr = _remove_mid_run(tmp_path, tiny_chat_model, shutil.rmtree)
    assert f"the job's folder {storage} was removed while the job ran" in stderr
    assert "start the job over" in stderr
    run(inp, storage, tiny_chat_model, check=True)
    assert count_lines(storage) == len(ROWS)


def test_a_results_file_removed_mid_run_is_named_by_the_supervisor(tmp_path, tiny_chat_model):
    """Only the results file goes (its folder stays): the run's last words name that file,
    not the parsed input, and do not promise a resume of results that are gone."""
    from test_reliability_support import batch_state, incremental_file

    removed = []

    def remove_results(storage):
        removed.append(incremental_file(storage))
        removed[0].unlink()

    storage, inp, _ = _remove_mid_run(tmp_path, tiny_chat_model, remove_results)
    last = batch_state(storage)["health"]["last_failure"]
    assert f"{removed[0]} was removed while the job ran" in last, last
    assert "parsed input" not in last and "start the job over" in last, last
    run(inp, storage, tiny_chat_model, check=True)
    assert count_lines(storage) == len(ROWS)


def test_a_storage_folder_removed_while_the_input_is_parsed_exits_2(tmp_path, tiny_chat_model):
    """The supervisor's own phase (a large input's parse takes seconds): no traceback and no
    exit 1 (a worker crash), but the same line as when a worker finds the folder gone."""
    rows = chat_rows(40000)
    inp = job_input(tmp_path / "in", rows)
    storage = tmp_path / "s"
    proc = launch(inp, storage, tiny_chat_model)
    try:
        assert wait_for(lambda: any((storage / "batches").glob(".*.requests.tmp-*")),
                        timeout=120, poll=0.01)
        shutil.rmtree(storage)
        _, stderr = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 2, stderr[-3000:]
    assert f"the job's folder {storage} was removed while the job ran" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_results_file_replaced_under_its_name_is_reported(tmp_path):
    """On NFS an unlinked open file stays linked (renamed .nfsXXXX): the check compares the
    file behind the name with the one written, so a name gone or taken by another file is
    seen too."""
    path = tmp_path / "job.jsonl"
    with IncrementalWriter(path) as writer:
        writer.write_batch([b'{"custom_id": "a"}\n'])
        keep = tmp_path / ".nfs0001"
        os.link(path, keep)  # as NFS's silly rename leaves it: a link is still there
        path.unlink()
        path.write_bytes(b"")  # and another file took the name
        try:
            writer.write_batch([b'{"custom_id": "b"}\n'])
        except ResultsFileRemoved:
            pass
        else:
            raise AssertionError("a write to a file its name no longer reaches was taken")


def test_followers_are_told_a_removed_folder_as_the_leader_says_it(tmp_path):
    """A folder removed during the leader's own phase (the parse) exits 2 on the leader; the
    followers of a multi-node job get the same code and words, not a crash's."""
    from types import SimpleNamespace

    from batchgen.runner.exits import ExitCode
    from batchgen.runner.leader.supervisor import _abort_followers

    paths = JobPaths.for_job(tmp_path / "s", "batch_x")
    paths.make_dirs()
    told = {}
    group = SimpleNamespace(publish_final=lambda what, wait, **kw: told.update(kw, what=what))
    shutil.rmtree(paths.storage_path)
    try:
        with _abort_followers(group, paths):
            raise FileNotFoundError(2, "No such file or directory", str(paths.parsed_input))
    except FileNotFoundError:
        pass
    assert told["what"] == "abort" and told["code"] == ExitCode.INPUT
    assert "was removed while the job ran" in told["reason"]
