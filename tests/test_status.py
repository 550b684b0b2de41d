"""`batchgen status`: a job by id, every job of a storage path, or a job folder given as the
argument; ids are names, never patterns; unreadable files are named."""

import json
import os
import re
import socket

import pytest
from typer.testing import CliRunner

from batchgen.cli import app

IDS = ("batch_aaa", "batch_bbb")


def storage_with_jobs(root):
    batches = root / "batches"
    batches.mkdir(parents=True)
    for i, batch_id in enumerate(IDS):
        (batches / f"{batch_id}.json").write_text(json.dumps({
            "batch_id": batch_id, "status": "completed",
            "request_counts": {"total": 4 + i, "completed": 4 + i, "failed": 0}}))
    (batches / "batch_aaa.worker0.json").write_text("{}")  # a worker's stats: not a job
    return root


def result_line(custom_id: str) -> dict:
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id,
            "response": {"status_code": 200, "body": {}}, "error": None}


def status(*args):
    result = CliRunner().invoke(app, ["status", *args])
    return result.exit_code, result.output


def test_by_id_by_storage_path_and_by_job_folder(tmp_path):
    root = storage_with_jobs(tmp_path / "jobs")
    code, out = status("batch_bbb", "--storage-path", str(root))
    assert code == 0 and "batch_bbb" in out and "batch_aaa" not in out and "5 total" in out
    for args in (["--storage-path", str(root)], [str(root)]):
        code, out = status(*args)
        assert code == 0 and "batch_aaa: completed" in out and "batch_bbb: completed" in out


def test_json_prints_one_object_a_job_for_scripts(tmp_path):
    root = storage_with_jobs(tmp_path / "jobs")
    code, out = status(str(root), "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["batch_id"] for r in records] == ["batch_aaa", "batch_bbb"]
    assert records[1]["request_counts"]["total"] == 5 and records[1]["run"] == "not running"
    assert "saved" not in records[0]  # a completed job's counts are its batch file's
    code, out = status("batch_zzz", "--storage-path", str(root), "--json")
    assert code == 1 and "no job batch_zzz" in out


def test_ids_are_not_patterns_and_missing_jobs_say_how_to_ask(tmp_path):
    root = storage_with_jobs(tmp_path / "jobs")
    code, out = status("batch_*", "--storage-path", str(root))
    assert code == 1 and "no job batch_*" in out and "job folder" in out
    code, out = status(str(tmp_path / "nowhere"))
    assert code == 1 and "no job writes" in out and "no job folder is there" in out
    code, out = status("results.jsonl", "--storage-path", str(root))  # a file, not an id
    assert code == 1 and "no job writes results.jsonl" in " ".join(out.split())


def test_the_output_folder_means_the_job_folder_run_made_in_it(tmp_path):
    """`batchgen run -o out/r.jsonl` keeps its job in out/.batchgen/: `batchgen status out`
    shows it instead of saying there is no job there."""
    storage_with_jobs(tmp_path / "out" / ".batchgen")
    code, out = status(str(tmp_path / "out"))
    assert code == 0 and "batch_aaa: completed" in out and "batch_bbb: completed" in out
    code, out = status(str(tmp_path))  # only the folder itself, not any folder below
    assert code == 1 and "no job under" in out


def test_an_unreadable_batch_file_is_named_not_a_traceback(tmp_path):
    root = storage_with_jobs(tmp_path / "jobs")
    (root / "batches" / "batch_ccc.json").write_text("{torn")
    code, out = status(str(root))
    assert code == 1 and "batch_aaa: completed" in out and "cannot read" in out
    assert "batch_ccc.json" in out and "Traceback" not in out


def test_an_unfinished_job_shows_saved_results_and_whether_a_run_holds_it(tmp_path):
    import os
    import socket
    import subprocess

    root = tmp_path / "jobs"
    batches = root / "batches"
    batches.mkdir(parents=True)
    (batches / "batch_run.json").write_text(json.dumps({
        "batch_id": "batch_run", "status": "in_progress",
        "request_counts": {"total": 9, "completed": 0, "failed": 0}}))
    (root / "incremental").mkdir()
    (root / "incremental" / "batch_run.jsonl").write_text(
        "".join(json.dumps(result_line(f"r{i}")) + "\n" for i in range(3))
        + '{"custom_id": "torn')  # a torn tail is not a saved result
    import time

    (batches / "batch_run.json").write_text(json.dumps({  # an earlier run's end, 20 min ago
        "batch_id": "batch_run", "status": "in_progress",
        "request_counts": {"total": 9, "completed": 0, "failed": 0},
        "health": {"last_heartbeat": time.time() - 1200}}))
    for rank, writes in ((0, True), (1, False)):  # rank 1: a TP peer, counting nothing
        (batches / f"batch_run.worker{rank}.json").write_text(json.dumps({
            "rank": rank, "writes_results": writes, "prompt_tokens": 1200 if writes else 7,
            "completion_tokens": 345 if writes else 7, "heartbeat": time.time() - 2,
            **({"engine": {"generated_tokens": 400, "prompt_tokens": 1500,
                           "cached_prompt_tokens": 600}} if writes else {})}))
    lock = batches / "batch_run.lock"
    lock.write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    code, out = status(str(root))
    assert code == 0 and "3 of 9 results" in out and f"running (pid {os.getpid()}" in out
    wide = CliRunner().invoke(app, ["status", str(root)], env={"COLUMNS": "250"}).output
    assert ("(runs that ended); the run going on: 1,200 in, 345 out so far in saved results, "
            "400 tokens drawn (answers in flight included)") in wide
    assert "40% of 1,500 prompt tokens in the run going on" in wide
    assert "0 completed" not in out and "9 total (completed and failed are counted" in out
    assert "none (a resume starts any unfinished request from its prompt)" in wide
    assert re.search(r"health\.last_heartbeat\s+\S+\s+2 s ago", wide), wide  # the live one
    code, out = status(str(root), "--json")
    record = json.loads(out)  # one job: one line
    assert code == 0 and record["batch_id"] == "batch_run" and record["saved"] == 3
    assert record["checkpoint"] == {"requests": 0, "tokens": 0}
    assert record["run"].startswith("running (pid") and len(record["workers"]) == 2
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(f"pid {dead.pid} on host {socket.gethostname()}\n")  # killed outright
    code, out = status(str(root))
    assert "not running: stopped before the end" in out
    assert "the run going on" not in out  # a stopped run's tokens are the batch file's
    lock.write_text("")  # a run that ended cleared it
    assert "not running" in status(str(root))[1]


def test_an_unfinished_job_is_found_by_its_output_file_before_it_exists(tmp_path,
                                                                        monkeypatch):
    """`batchgen status out/x.jsonl` while the job runs, or after it was stopped or killed:
    the results file is not there yet, its batch file names it."""
    out = tmp_path / "out"
    batches = out / ".batchgen" / "batches"
    batches.mkdir(parents=True)
    (batches / "batch_live.json").write_text(json.dumps({
        "batch_id": "batch_live", "status": "in_progress", "output_file": str(out / "x.jsonl"),
        "request_counts": {"total": 8, "completed": 0, "failed": 0}}))
    monkeypatch.chdir(tmp_path)
    for target in (str(out / "x.jsonl"), "out/x.jsonl"):
        code, text = status(target)
        assert code == 0 and "batch_live: in_progress" in text, text
    code, text = status("out/y.jsonl")  # no such output, nor a folder of that name
    assert code == 1 and "no job writes out/y.jsonl (looked in" in " ".join(text.split())
    assert "no job folder is there" in " ".join(text.split())



def test_an_output_whose_batch_file_is_unreadable_names_that_file(tmp_path):
    """`batchgen status out/x.jsonl` while the job's batch file does not parse (zero bytes,
    garbage): which output it names cannot be read, so it is named as unreadable, with what to
    do, never "no job"."""
    out = tmp_path / "out"
    batches = out / ".batchgen" / "batches"
    batches.mkdir(parents=True)
    for content in (b"", b"\xff\x00garbage{{\n", b"[]"):
        (batches / "batch_torn.json").write_bytes(content)
        code, text = status(str(out / "x.jsonl"))
        assert code == 1 and "no job" not in text and "cannot read" in text, text
        assert "batch_torn.json" in text and "move it aside" in text and "Traceback" not in text


def test_prefix_hits_share_over_engines():
    from batchgen.runner.leader.progress import prefix_hits

    assert prefix_hits([{"prompt_tokens": 1000, "cached_prompt_tokens": 870},
                        {"prompt_tokens": 1000, "cached_prompt_tokens": 0}]) == \
        "44% of 2,000 prompt tokens"
    assert prefix_hits([{}, {"prompt_tokens": 0}]) == "-"
    assert prefix_hits([{"prompt_tokens": 80, "cached_prompt_tokens": 60, "forks": 3}]) == (
        "75% of 80 prompt tokens (each choice of n > 1 counted)")
    # n > 1 choices that did not fork (no partial page to copy, or no room) count too
    assert prefix_hits([{"prompt_tokens": 130, "cached_prompt_tokens": 64, "forks": 0,
                         "extra_choices": 1}]) == (
        "49% of 130 prompt tokens (each choice of n > 1 counted)")


def test_a_job_sharing_a_system_prompt_reports_its_prefix_hits(tiny_chat_model, tmp_path):
    """Through `batchgen run`: every answer's cached_tokens, the batch record's counters and
    `batchgen status` tell the same reuse."""
    import re

    from job_utils import batchgen, read_jsonl, write_jsonl
    from test_reliability_support import ROWS

    rows = write_jsonl(tmp_path / "in.jsonl", ROWS[:12])
    storage, out = tmp_path / "s", tmp_path / "out.jsonl"
    batchgen("run", "--input", rows, "--output", out, "--storage-path", storage,
             "--model", tiny_chat_model, check=True)
    cached = [r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
              for r in read_jsonl(out)]
    assert len(cached) == 12 and sum(cached) >= 11 * 64  # the first computes the prompt
    record = next(p for p in (storage / "batches").glob("batch_*.json")
                  if p.name.count(".") == 1)  # not its .spec.json or .workerN.json
    counters = json.loads(record.read_text())["counters"]
    assert counters["cached_prompt_tokens"] == sum(cached)
    assert counters["prefix_hit_rate"] > 0
    rate = f"{counters['cached_prompt_tokens'] / counters['prompt_tokens']:.0%}"
    code, shown = status(record.stem, "--storage-path", str(storage))
    assert code == 0
    assert re.search(rf"prefix cache\s*│?\s*{rate} of {counters['prompt_tokens']:,} prompt",
                     shown), shown


def test_status_tells_the_cached_share_the_run_summary_told(tmp_path, monkeypatch):
    """The run summary's "2,196 in (1,413 of them cached, 64%)" sums the answers'
    cached_tokens; `batchgen status` says the same of the job (its usage records them), beside
    the engine's count of the last run (each choice of n > 1 counted, another share)."""
    from batchgen.runner.leader.progress import run_summary
    from batchgen.runner.leader.records import usage_total

    monkeypatch.setenv("COLUMNS", "200")  # each table row on one line
    root = storage_with_jobs(tmp_path / "jobs")
    path = root / "batches" / "batch_aaa.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "usage": usage_total(2196, 610, 1413),
                                "counters": {"prompt_tokens": 3176, "cached_prompt_tokens": 2382,
                                             "forks": 4}}))
    summary = run_summary(10.0, 21, 0, 2196, 610, 610, tmp_path / "o.jsonl",
                          tmp_path / "o.errors.jsonl", root, cached_tokens=1413)
    said = "2,196 in (1,413 of them cached, 64%), 610 out"
    assert said in summary
    code, out = status("batch_aaa", "--storage-path", str(root))
    assert code == 0 and said in out, out
    assert "75% of 3,176 prompt tokens in the last run (each choice of n > 1 counted)" in out


@pytest.mark.parametrize("killed_in", ["in_progress", "finalizing"])
def test_a_run_killed_before_recording_its_end_is_counted_by_the_next(tmp_path, killed_in):
    """A SIGKILLed run leaves the job in_progress (or finalizing: killed in its merge) and its
    workers' stats: the next run counts that run, its tokens and its seconds up to the stats'
    last write (the job's rate over all runs would otherwise divide every run's tokens by the
    timed runs' seconds; a run killed in its merge, minutes of work, went uncounted)."""
    import os

    from batchgen.io.jobfiles import BatchFile
    from batchgen.runner.leader.records import record_killed_run

    batches = tmp_path / "batches"
    batches.mkdir()
    batch_file = BatchFile(batches / "batch_k.json")
    batch_file.update("batch_k", status=killed_in,
                      timings={"started_at": 1_000, "runs": 1, "all_runs_seconds": 5.0,
                               "finished_at": 900},
                      usage={"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30})
    stats = batches / "batch_k.worker0.json"
    stats.write_text(json.dumps({"completion_tokens": 100, "prompt_tokens": 50,
                                 "cached_tokens": 40}))
    os.utime(stats, (1_012.0, 1_012.0))
    record_killed_run("batch_k", batch_file, batches)
    state = batch_file.load()
    assert state.timings["runs"] == 2 and state.timings["all_runs_seconds"] == 17.0
    assert state.usage == {"prompt_tokens": 60, "completion_tokens": 120, "total_tokens": 180,
                           "prompt_tokens_details": {"cached_tokens": 40}}
    record_killed_run("batch_k", batch_file, batches)  # recorded now: counted once
    assert batch_file.load().timings["runs"] == 2


def test_status_reads_the_saved_results_once(tmp_path, monkeypatch):
    """A million saved lines take seconds to read: the saved count and the checkpoint row
    share one pass over the incremental files."""
    from batchgen.io import writer
    from batchgen.runner.leader import status as status_module

    root = tmp_path / "jobs"
    (root / "batches").mkdir(parents=True)
    (root / "batches" / "batch_big.json").write_text(json.dumps({
        "batch_id": "batch_big", "status": "in_progress",
        "request_counts": {"total": 5, "completed": 0, "failed": 0}}))
    (root / "incremental").mkdir()
    (root / "incremental" / "batch_big.jsonl").write_text(
        "".join(json.dumps(result_line(f"r{i}")) + "\n" for i in range(2)))
    passes = []

    def counting(paths):
        passes.append(1)
        return writer.read_done_ids(paths)

    monkeypatch.setattr(status_module, "read_done_ids", counting)
    code, out = status(str(root))
    assert code == 0 and "2 of 5 results" in out and "none (a resume starts" in out
    assert len(passes) == 1


def test_status_and_the_error_reporting_import_no_torch():
    """`batchgen status` answers in a fraction of a second: the CLI, the status command and the
    errors it may report (the model's among them) load without torch (~1-3 s of imports)."""
    import subprocess
    import sys

    code = ("import sys, batchgen.cli, batchgen.runner.leader.status, "
            "batchgen.runner.files.errors; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_failed_job_shows_its_whole_log_path_and_when_it_failed(tmp_path, monkeypatch):
    import re
    import time

    monkeypatch.setenv("COLUMNS", "80")
    log = tmp_path / ("a-long-folder-name-" * 4) / "attempt_0" / "0" / "stderr.log"
    root = tmp_path / "jobs"
    (root / "batches").mkdir(parents=True)
    (root / "batches" / "batch_bad.json").write_text(json.dumps({
        "batch_id": "batch_bad", "status": "failed",
        "health": {"last_failure": "worker rank 0 crashed", "worker_log": str(log),
                   "last_failure_at": int(time.time()) - 120}}))
    code, out = status(str(root))
    assert code == 0 and "batch_bad: failed" in out
    assert str(log) in re.sub(r"[\s│]", "", out)  # folded over lines, never cut
    assert "…" not in out and "2 min ago (" in out


def test_a_completed_job_shows_an_earlier_failure_as_history(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # each table row on one line
    root = tmp_path / "jobs"
    (root / "batches").mkdir(parents=True)
    (root / "batches" / "batch_done.json").write_text(json.dumps({
        "batch_id": "batch_done", "status": "completed",
        "request_counts": {"total": 2, "completed": 2, "failed": 0},
        "health": {"last_failure": "[rank 1] died: re-run the same command to resume",
                   "last_stop": "SIGINT"}}))
    code, out = status(str(root))
    assert code == 0 and "an earlier run's: the job completed since" in out
    assert "[rank 1] died" in out  # shown as written, not read as a style
    assert "SIGINT (an earlier run's: the job completed since)" in out  # a stop, likewise


def test_the_model_and_its_hub_commit_are_shown(tmp_path, monkeypatch):
    """Which model answered, and for a Hub id the commit a resume is pinned to: the commit
    a resume refusal names ("add --revision SHA") could not be read from status before."""
    monkeypatch.setenv("COLUMNS", "160")  # the row whole on one line
    root = storage_with_jobs(tmp_path / "jobs")
    sha = "b24fabdb585ed68953e2cee9825b139bf3bc216b"
    path = root / "batches" / "batch_aaa.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "fingerprint": {
        "model": "org/tiny", "model_weights": f"eaec3ae67e3f9d9c4e3f5180fe7ba4dc@{sha}"}}))
    code, out = status("batch_aaa", "--storage-path", str(root))
    assert code == 0 and f"org/tiny (Hub commit {sha})" in out, out
    path.write_text(json.dumps({**state, "fingerprint": {
        "model": "/models/x", "model_weights": "eaec3ae67e3f9d9c4e3f5180fe7ba4dc"}}))
    code, out = status("batch_aaa", "--storage-path", str(root))
    assert code == 0 and "/models/x" in out and "Hub commit" not in out


def test_progress_rate_keeps_a_decimal_below_ten():
    """A slow CPU job's rate is not shown as 0 while its results come."""
    from batchgen.core import rate_text

    assert [rate_text(r) for r in (0.0, 0.34, 1.44, 9.94, 10.0, 12_345.6)] == [
        "0.0", "0.3", "1.4", "9.9", "10", "12,346"]


def test_large_counts_are_grouped_in_thousands():
    from batchgen.runner.leader.status import _request_counts

    done = {"status": "completed",
            "request_counts": {"total": 1234567, "completed": 1234000, "failed": 567}}
    assert _request_counts(done) == "1,234,000 completed, 567 failed, 1,234,567 total"
    running = {"status": "in_progress", "request_counts": {"total": 20000}}
    assert _request_counts(running).startswith("20,000 total (")


def test_a_job_still_starting_is_shown_as_starting(tmp_path):
    """Its batch file is written once the input is parsed and the model found (a large Hub
    download takes hours): until then status said no job existed, though a live run held it."""
    folder = tmp_path / "out" / ".batchgen"
    (folder / "batches").mkdir(parents=True)
    lock = folder / "batches" / "batch_new.lock"
    lock.write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    for target in (str(tmp_path / "out" / "res.jsonl"), str(tmp_path / "out")):
        code, out = status(target)
        assert code == 0 and "batch_new: starting (pid" in out and "fetching its model" in out
    code, out = status(str(tmp_path / "out"), "--json")
    assert json.loads(out) == {"batch_id": "batch_new", "status": "starting",
                               "run": f"running (pid {os.getpid()} on host "
                                      f"{socket.gethostname()})"}
    lock.write_text("")  # the run ended
    code, out = status(str(tmp_path / "out"))
    assert code == 1 and "batch_new" not in out
