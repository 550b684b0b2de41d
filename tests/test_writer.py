"""Incremental writer (repair, faults, locking), final merge, and the job files (jobfiles.py)."""

import errno
import os
import random
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.io.intake import IntakeError
from batchgen.io.jobfiles import (BatchFile, FingerprintMismatch, JobPaths, check_fingerprint,
                                  derive_batch_id, make_fingerprint, record_upload)
from batchgen.io.results import dumps, error_line
from batchgen.io.writer import (CorruptIncrementalFile, IncompleteResults, IncrementalWriter,
                                WriteFailed, WriterLocked, finalize, read_done_ids, salvage)
from batchgen.testing.faults import PHASES, WRITER_FAULT_ENV, WriterFault


def ok_line(cid: str, text: str = "answer") -> bytes:
    return dumps({"id": f"batch_req_{cid}", "custom_id": cid, "response": {
        "status_code": 200, "request_id": cid, "body": {"choices": [{"text": text}]}},
        "error": None})


def bad_line(cid: str) -> bytes:
    return dumps(error_line("b", IntakeError(cid, 1, "invalid_json", "bad")))


LINES = [ok_line(f"r{i}", "x" * (i * 7 % 23)) for i in range(12)]
BLOB = b"".join(LINES)


class Crash(Exception):
    """Stands in for the process dying at a fault point."""


def test_write_reopen_and_done_ids(tmp_path):
    path = tmp_path / "inc" / "b.jsonl"
    with IncrementalWriter(path) as w:
        assert len(w.done_ids()) == 0
        w.write_batch(LINES[:3])
        w.write_batch([])
        w.write_batch(LINES[3:5])
    with IncrementalWriter(path) as w:
        assert w.lines == 5 and w.repaired_bytes == 0
        assert "r0" in w.done_ids() and "r4" in w.done_ids() and "r5" not in w.done_ids()
    assert path.read_bytes() == b"".join(LINES[:5])


def test_lines_must_end_with_newline(tmp_path):
    with IncrementalWriter(tmp_path / "a.jsonl") as w, pytest.raises(ValueError):
        w.write_batch([b'{"custom_id": "x"}'])


def complete_prefix(blob: bytes, cut: int) -> bytes:
    return blob[:blob.rfind(b"\n", 0, cut) + 1]


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, len(BLOB)), garbage=st.sampled_from([b"", b"\x00" * 9, b'{"cus']))
def test_torn_tail_repair_at_any_offset(tmp_path_factory, cut, garbage):
    path = tmp_path_factory.mktemp("torn") / "b.jsonl"
    path.write_bytes(BLOB[:cut] + garbage)
    with IncrementalWriter(path) as w:
        expected = complete_prefix(BLOB, cut)
        assert path.read_bytes() == expected
        assert w.lines == expected.count(b"\n")
        assert w.repaired_bytes == cut + len(garbage) - len(expected)
        w.write_batch([LINES[-1]])  # appending after a repair lands right after the good prefix
    assert path.read_bytes() == expected + LINES[-1]


def test_unparsable_complete_last_line_is_cut(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(BLOB + b"\x00\x00\x00\n")
    with IncrementalWriter(path) as w:
        assert w.repaired_bytes == 4
    assert path.read_bytes() == BLOB


def test_corrupt_middle_line_is_refused_then_salvaged(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"".join(LINES[:3]) + b"garbage\n" + b"".join(LINES[3:6]))
    before = path.read_bytes()
    with pytest.raises(CorruptIncrementalFile) as info:
        IncrementalWriter(path)
    message = str(info.value)
    assert "line 4" in message and "--repair-incremental" in message and str(path) in message
    assert f"{sys.executable} -m batchgen.io.writer" in message  # the interpreter that has it
    assert path.read_bytes() == before  # refused without touching it
    assert salvage(path) == (6, 1)
    assert path.read_bytes() == b"".join(LINES[:6])
    backups = list(tmp_path.glob("b.jsonl.corrupt-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == before


@pytest.mark.parametrize("line", [
    b'{"custom_id": "r3", "garbage": "xx"}\n',  # edited by hand: JSON, but no result
    b'{"id": "x", "custom_id": "r3", "response": {"status_code": 200, "body": "text"}}\n',
    b'{"id": "x", "custom_id": "r3", "response": null, "error": null}\n',
    b'{"id": 7, "custom_id": "r3", "response": null, "error": {}}\n',
])
def test_a_json_line_that_is_no_result_is_corruption_not_an_answer(tmp_path, line):
    """It counted as r3's answer: r3 was never answered, the line went into the final files
    as they were, and the next run refused those files as no job's."""
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"".join(LINES[:3]) + line + b"".join(LINES[3:6]))
    with pytest.raises(CorruptIncrementalFile, match="line 4"):
        IncrementalWriter(path)
    assert salvage(path) == (6, 1)
    path.write_bytes(b"".join(LINES[:3]) + line)  # the last line: a torn write, cut off
    with IncrementalWriter(path) as w:
        done = w.done_ids()
        assert len(done) == 3 and all(f"r{i}" in done for i in range(3))


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_each_phase_leaves_a_repairable_file(tmp_path, phase):
    path = tmp_path / "b.jsonl"
    with IncrementalWriter(path) as w:
        w.write_batch(LINES[:2])
    seen = []

    def fault(at):
        seen.append(at)
        if at == phase:
            raise Crash(at)
    w = IncrementalWriter(path, fault=WriterFault(on_phase=fault))
    with pytest.raises(Crash):
        w.write_batch(LINES[2:8])
    with pytest.raises(WriteFailed, match="earlier flush failed"):
        w.write_batch(LINES[8:9])  # a writer that saw a crash is never trusted again
    w.close()
    assert seen == list(PHASES[:PHASES.index(phase) + 1])
    with IncrementalWriter(path) as again:
        content = path.read_bytes()
        new = b"".join(LINES[2:8])
        if phase == "before_write":
            assert content == b"".join(LINES[:2])
        elif phase == "mid_write":  # complete lines of the first half survive, the torn one not
            assert content == b"".join(LINES[:2]) + complete_prefix(new, len(new) // 2)
        else:
            assert content == b"".join(LINES[:8])
        assert again.lines == content.count(b"\n")


@pytest.mark.parametrize("phase", ["mid_write", "after_write"])
def test_enospc_rolls_back_and_reports(tmp_path, phase):
    path = tmp_path / "b.jsonl"

    def fault(at):
        if at == phase:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with IncrementalWriter(path, fault=WriterFault(on_phase=fault)) as w:
        with pytest.raises(WriteFailed) as info:
            w.write_batch(LINES[:4])
    assert "No space left" in str(info.value) and "ENOSPC" in str(info.value)
    assert "run the same command again" in str(info.value)
    assert path.read_bytes() == b""


def test_failed_fsync_is_not_retried(tmp_path, monkeypatch):
    path = tmp_path / "b.jsonl"
    w = IncrementalWriter(path)
    w.write_batch(LINES[:2])
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(WriteFailed, match="EIO"):
        w.write_batch(LINES[2:4])
    assert len(calls) == 1
    monkeypatch.undo()
    w.close()
    assert path.read_bytes() == b"".join(LINES[:2])


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:5])))
    with IncrementalWriter(tmp_path / "b.jsonl") as w:
        w.write_batch(LINES)
    monkeypatch.undo()
    assert (tmp_path / "b.jsonl").read_bytes() == BLOB


def test_second_live_writer_is_refused(tmp_path):
    path = tmp_path / "b.jsonl"
    with IncrementalWriter(path):
        with pytest.raises(WriterLocked, match="another live"):
            IncrementalWriter(path)
    IncrementalWriter(path).close()  # free again once the first one closed


def test_env_fault_kills_the_process(tmp_path):
    path = tmp_path / "b.jsonl"
    script = ("import sys; from batchgen.io.writer import IncrementalWriter\n"
              "from batchgen.testing.faults import writer_fault\n"
              "from batchgen.io.results import dumps, failure_line\n"
              "w = IncrementalWriter(sys.argv[1], fault=writer_fault())\n"
              "line = lambda cid: dumps(failure_line('b', cid, 1, 'x', 'y'))\n"
              "w.write_batch([line('a')])\n"
              "w.write_batch([line('b'), line('c')])\n")
    env = {**os.environ, WRITER_FAULT_ENV: "mid_write:2"}
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with IncrementalWriter(path) as w:
        assert "a" in w.done_ids() and "b" in w.done_ids() and "c" not in w.done_ids()


def test_finalize_merges_shuffled_rank_files_in_input_order(tmp_path):
    keys = [f"k{i}" for i in range(300)]
    failed = {k for i, k in enumerate(keys) if i % 7 == 3}
    results = [bad_line(k) if k in failed else ok_line(k, f"first {k}") for k in keys]
    random.Random(0).shuffle(results)
    files = [tmp_path / f"b.rank{r}.jsonl" for r in range(3)]
    for r, path in enumerate(files):
        path.write_bytes(b"".join(results[r::3]))
    with open(files[2], "ab") as f:  # a duplicate (later: loses), a stranger, and a torn tail
        f.write(ok_line("k5", "second") + ok_line("not-in-input") + b'{"custom_id": "k')
    out = tmp_path / "out" / "final.jsonl"
    out.parent.mkdir()
    report = finalize(files, iter(keys), out)
    succeeded = [orjson.loads(raw) for raw in out.read_bytes().splitlines()]
    errors = [orjson.loads(raw) for raw in (tmp_path / "out" / "final.errors.jsonl")
              .read_bytes().splitlines()]
    assert [r["custom_id"] for r in succeeded] == [k for k in keys if k not in failed]
    assert [r["custom_id"] for r in errors] == [k for k in keys if k in failed]
    k5 = next(r for r in succeeded if r["custom_id"] == "k5")
    assert k5["response"]["body"]["choices"][0]["text"] == "first k5"  # first record wins
    assert (report.completed, report.failed, report.ignored) == (300 - len(failed), len(failed), 2)
    assert sorted(p.name for p in out.parent.iterdir()) == ["final.errors.jsonl", "final.jsonl"]


def test_finalize_reads_order_from_the_input_file(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"custom_id": "z", "prompt": "1"}\n\n{"prompt": "2"}\nnot json\n')
    inc = tmp_path / "b.jsonl"
    inc.write_bytes(bad_line("line-4") + ok_line("line-3") + ok_line("z"))
    report = finalize([inc], inp, tmp_path / "o.jsonl", tmp_path / "e.jsonl")
    assert (tmp_path / "o.jsonl").read_bytes() == ok_line("z") + ok_line("line-3")
    assert (tmp_path / "e.jsonl").read_bytes() == bad_line("line-4")
    assert report.completed == 2 and report.failed == 1


def test_finalize_refuses_missing_results_and_writes_nothing(tmp_path):
    inc = tmp_path / "b.jsonl"
    inc.write_bytes(ok_line("a"))
    (tmp_path / "o.jsonl").write_bytes(b"old\n")
    with pytest.raises(IncompleteResults, match="1 input records have no result.*'b'"):
        finalize([inc], ["a", "b"], tmp_path / "o.jsonl")
    assert (tmp_path / "o.jsonl").read_bytes() == b"old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "o.jsonl"]


def test_finalize_of_a_job_with_most_results_missing_holds_no_list_of_them(tmp_path):
    """The merge streams the input's ids: records without a result are counted and the
    first five named, not kept one string each (a million missing ids: tens of MB)."""
    inc = tmp_path / "b.jsonl"
    inc.write_bytes(ok_line("have"))
    keys = (f"request-without-a-result-{i:08d}" for i in range(300_000))
    tracemalloc.start()
    try:
        with pytest.raises(IncompleteResults, match=r"^300000 input records have no result yet "
                           r"\(first: 'request-without-a-result-00000000', .*00004'\)"):
            finalize([inc], keys, tmp_path / "o.jsonl")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak  # the 65,536-id chunk being merged (~13 MB), no more


def test_read_done_ids_across_rank_files(tmp_path):
    a, b = tmp_path / "b.rank0.jsonl", tmp_path / "b.rank1.jsonl"
    a.write_bytes(ok_line("x") + b'{"custom_id": "tor')
    b.write_bytes(ok_line("y"))
    done = read_done_ids([a, b])
    assert len(done) == 2 and "x" in done and "y" in done and "tor" not in done
    assert a.read_bytes().endswith(b"tor")  # read-only: other ranks' files are not repaired


def test_finalize_100k_results_with_bounded_memory(tmp_path):
    keys = [f"request-{i:06d}" for i in range(100_000)]
    inc = tmp_path / "b.jsonl"
    with open(inc, "wb") as f:
        for k in reversed(keys):
            f.write(ok_line(k))
    tracemalloc.start()
    try:
        report = finalize([inc], (k for k in keys), tmp_path / "o.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.completed == 100_000
    assert peak < 20_000_000, peak


# --- jobfiles.py -------------------------------------------------------------------------------

def test_job_paths_layout(tmp_path):
    bid = derive_batch_id("ab" * 32)
    assert bid == "batch_" + "ab" * 12
    paths = JobPaths.for_job(tmp_path, bid)
    assert paths.incremental() == tmp_path / "incremental" / f"{bid}.jsonl"
    assert paths.incremental(2, 4) == tmp_path / "incremental" / f"{bid}.rank2.jsonl"
    assert paths.output == tmp_path / "outputs" / f"{bid}.jsonl"
    assert paths.errors_output == tmp_path / "outputs" / f"{bid}.errors.jsonl"
    assert paths.batch_file == tmp_path / "batches" / f"{bid}.json"
    custom = JobPaths.for_job(tmp_path, bid, tmp_path / "inc", tmp_path / "res.jsonl")
    assert custom.errors_output == tmp_path / "res.errors.jsonl"
    paths.make_dirs()
    for r in (10, 2):
        paths.incremental(r, 11).touch()
    paths.incremental().touch()
    assert [p.name for p in paths.incremental_files()] == [
        f"{bid}.jsonl", f"{bid}.rank2.jsonl", f"{bid}.rank10.jsonl"]
    with pytest.raises(ValueError, match="letters, digits"):
        JobPaths.for_job(tmp_path, "../escape")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]"])
def test_damaged_batch_file_is_a_job_error_with_its_exit_code(tmp_path, content):
    """Not a traceback and exit 1 ("a worker crashed"): exit 3 and the file to move aside."""
    from batchgen.io.jobfiles import CorruptBatchFile
    from batchgen.runner.files.errors import exit_code_of

    paths = JobPaths.for_job(tmp_path, "batch_1")
    paths.batch_file.parent.mkdir(parents=True)
    paths.batch_file.write_bytes(content)
    with pytest.raises(CorruptBatchFile, match="move it aside") as caught:
        BatchFile(paths.batch_file).load()
    assert exit_code_of(caught.value) == 3


def test_batch_file_save_load_update(tmp_path):
    paths = JobPaths.for_job(tmp_path, "batch_1")
    bf = BatchFile(paths.batch_file)
    assert bf.load() is None
    bf.update("batch_1", status="in_progress", request_counts={"total": 10},
              fingerprint={"model": "m"})
    state = bf.update("batch_1", request_counts={"completed": 4}, counters={"evictions": 2})
    assert state.request_counts == {"total": 10, "completed": 4, "failed": 0}
    loaded = bf.load()
    assert loaded == state and loaded.status == "in_progress"
    assert list(paths.batch_file.parent.iterdir()) == [paths.batch_file]  # no temp left behind
    with pytest.raises(ValueError, match="unknown batch status"):
        bf.update("batch_1", status="done-ish")
    with pytest.raises(TypeError):
        bf.update("batch_1", colour="blue")


def test_upload_record(tmp_path):
    paths = JobPaths.for_job(tmp_path, "batch_1")
    paths.make_dirs()
    record_upload(paths, Path("in.jsonl"), "f" * 64, 123, 4, "jsonl")
    data = orjson.loads(paths.upload_file.read_bytes())
    assert data["sha256"] == "f" * 64 and Path(data["path"]).is_absolute()


def test_fingerprint_mismatch_names_each_difference():
    old = make_fingerprint({"model": "a", "dtype": "bfloat16", "input_sha256": "1",
                            "sampling": {"max_tokens": 256, "stop": ("x",)}})
    check_fingerprint(old, {"model": "a", "dtype": "bfloat16", "input_sha256": "1",
                            "sampling": {"max_tokens": 256, "stop": ["x"]}})  # tuple == list
    new = {"model": "b", "dtype": "bfloat16", "input_sha256": "1",
           "sampling": {"max_tokens": 512, "stop": ("x",)}, "parse_thinking": True}
    with pytest.raises(FingerprintMismatch) as info:
        check_fingerprint(old, new)
    message = str(info.value)
    assert "model: 'a' -> 'b'" in message and "sampling.max_tokens: 256 -> 512" in message
    assert "parse_thinking: <absent> -> True" in message and "dtype" not in message


def test_a_changed_input_alone_is_named_as_the_input_not_as_settings():
    """--batch-id of a job whose input file was edited since: the settings are the same, so
    the refusal says the input changed and how to go on, not 're-run with the settings'."""
    old = make_fingerprint({"model": "a", "input_sha256": "1"})
    with pytest.raises(FingerprintMismatch) as info:
        check_fingerprint(old, {"model": "a", "input_sha256": "2"})
    message = str(info.value)
    assert "input file's content changed" in message and "Put back the file" in message
    assert "original settings" not in message


def test_finalize_sums_the_usage_of_the_results_it_writes(tmp_path):
    """The run summary's token counts: prompt, completion and cached prompt tokens of the
    success lines, a duplicate counted once."""
    def used(cid, prompt, cached):
        return dumps({"id": f"batch_req_{cid}", "custom_id": cid, "response": {
            "status_code": 200, "request_id": cid, "body": {
                "choices": [{"text": "x"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 3,
                          "prompt_tokens_details": {"cached_tokens": cached}}}},
            "error": None})

    inc = tmp_path / "b.jsonl"
    inc.write_bytes(used("a", 100, 0) + used("b", 120, 64) + used("b", 120, 64)
                    + used("c", 90, 80) + bad_line("d"))
    report = finalize([inc], ["a", "b", "c", "d"], tmp_path / "o.jsonl")
    assert (report.prompt_tokens, report.completion_tokens, report.cached_tokens) == (
        310, 9, 144)
