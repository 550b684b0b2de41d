"""Poison requests: one in flight at K consecutive confirmed crashes (alone at the last) is
quarantined as an error line and the job completes; kills of the whole job count for nothing."""

import orjson
import pytest
from job_utils import chat_rows, write_jsonl
from test_reliability_support import (
    ROWS,
    batch_state,
    check_against_clean,
    job_input,
    outputs,
    record_figures,
    run,
)

from batchgen.io.parsed_input import ParsedRecord
from batchgen.runner.worker.quarantine import (
    ISOLATION_GROUPS,
    Quarantine,
    journal_paths,
    mark_crashed,
)
from batchgen.testing.faults import CRASH_ON_ADMIT_ENV


def _crashed_run(tmp_path, admitted: list[str], confirm: bool = True, done=(), restarted=False,
                 after: int = 3) -> Quarantine:
    """Simulate one run that admitted `admitted` and died, then the next start's recovery."""
    q = Quarantine(tmp_path, "b", 0, after)
    q.recover(set(done), restarted=False)
    q.admitted(admitted)
    if confirm:
        mark_crashed(tmp_path, "b", -9)
    nxt = Quarantine(tmp_path, "b", 0, after)
    nxt.recover(set(done), restarted=restarted)
    return nxt


def test_unconfirmed_interruption_is_no_evidence(tmp_path):
    q = _crashed_run(tmp_path, ["a", "b"], confirm=False)
    assert not q.book.strikes  # a kill -9 of the whole job: nobody saw a worker crash


def test_torchrun_restart_confirms_the_crash(tmp_path):
    q = _crashed_run(tmp_path, ["a"], confirm=False, restarted=True)
    assert q.book.strikes == {"a": 1} and q.convicted("a") is False


def test_strikes_are_consecutive_and_conviction_needs_isolation(tmp_path):
    for _ in range(3):
        q = _crashed_run(tmp_path, ["a", "b"])
    assert q.book.strikes == {"a": 3, "b": 3}
    assert not q.convicted("a")  # never alone: an innocent neighbour must not pay
    q = _crashed_run(tmp_path, ["b"])
    assert q.book.strikes == {"b": 4} and q.convicted("b")  # "a" left the streak


def test_finished_requests_and_crash_before_admission_change_nothing(tmp_path):
    _crashed_run(tmp_path, ["a", "b"])
    q = _crashed_run(tmp_path, [], done=["a"])
    assert q.book.strikes == {"b": 1}


def test_a_crash_is_counted_once_even_if_the_recovery_is_killed(tmp_path, monkeypatch):
    """A kill after the book is saved but before the next journal starts leaves the crashed
    run's journal in place: the recovery after that must not count the same crash again."""
    q = Quarantine(tmp_path, "b", 0, 3)
    q.recover(set(), restarted=False)
    q.admitted(["a"])
    mark_crashed(tmp_path, "b", -9)
    for _ in range(3):  # each recovery dies right after saving the book
        q = Quarantine(tmp_path, "b", 0, 3)
        monkeypatch.setattr(q.journal, "start", lambda: None)
        q.recover(set(), restarted=False)
    assert q.book.strikes == {"a": 1}


def test_journals_without_a_run_id_still_count(tmp_path):
    """A journal written before journals carried a run id (an older batchgen's crash)."""
    (tmp_path / "b.inflight.rank0").write_bytes(b'"a"\n{"crash": -9}\n')
    q = Quarantine(tmp_path, "b", 0, 3)
    q.recover(set(), restarted=False)
    assert q.book.strikes == {"a": 1}


def test_torn_journal_line_is_ignored(tmp_path):
    q = Quarantine(tmp_path, "b", 0, 3)
    q.recover(set(), restarted=False)
    q.admitted(["a"])
    with open(journal_paths(tmp_path, "b")[0], "ab") as f:
        f.write(b'"tor')
    mark_crashed(tmp_path, "b", 70)
    nxt = Quarantine(tmp_path, "b", 0, 3)
    nxt.recover(set(), restarted=False)
    assert nxt.book.strikes == {"a": 1}


def test_isolation_groups_shrink_the_set_in_flight(tmp_path):
    ids = [f"r{i}" for i in range(40)]
    q = _crashed_run(tmp_path, ids)
    q.book.strikes["r7"] = 2
    records = [ParsedRecord(i + 1, cid, None) for i, cid in enumerate(ids)]
    groups = q.isolation_groups(records)
    assert len(groups) <= ISOLATION_GROUPS and sum(map(len, groups)) == 40
    assert groups[0][0].key == "r7"  # most strikes first
    assert max(map(len, groups)) == 3


def test_quarantine_line_is_a_failure_line(tmp_path):
    q = Quarantine(tmp_path, "b", 0, 1)
    q.book.strikes, q.book.last_crash_in_flight = {"x": 1}, 1
    line = orjson.loads(q.error_line(ParsedRecord(6, "x", None)))
    assert line["response"] is None and line["error"]["code"] == "quarantined"
    assert line["error"]["line"] == 6 and "--quarantine-after 1" in line["error"]["message"]


@pytest.mark.slow
def test_poison_request_is_quarantined_and_the_job_completes(tmp_path, tiny_chat_model):
    # Crash 1 is seen by the supervisor (the Slurm-requeue path: run the command again);
    # crashes 2 and 3 happen under --max-restarts, where torchrun restarts the worker itself.
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    env = {CRASH_ON_ADMIT_ENV: "req-5"}
    first = run(inp, storage, tiny_chat_model, env=env)
    assert first.returncode == 1 and "crashed (killed by signal 9)" in first.stderr, \
        first.stderr[-3000:]
    second = run(inp, storage, tiny_chat_model, "--max-restarts", "3", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "quarantined ['req-5']" in second.stderr
    figures = check_against_clean(storage, tiny_chat_model, allowed_errors=("req-5",))
    _, errors = outputs(storage)
    assert errors[0]["error"]["code"] == "quarantined" and errors[0]["error"]["line"] == 6
    assert batch_state(storage)["health"]["quarantined"] == 1
    record_figures("quarantine", crashes=3, commands=2, quarantined=1, **figures)


@pytest.mark.slow
def test_a_restarted_worker_group_sums_every_attempt(tmp_path, tiny_chat_model):
    """--max-restarts: the worker dies admitting req-4 after answering req-0..3, torchrun
    restarts it, req-4 is quarantined and req-5 answered. All six were this command's: its
    summary says so, not "2 answered by this run, 4 saved by earlier runs" (the restarted
    attempt's own count)."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(6, max_tokens=4))
    storage = tmp_path / "s"
    proc = run(inp, storage, tiny_chat_model, "--max-restarts", "1", "--quarantine-after", "1",
               "--max-pool-size", "1", env={CRASH_ON_ADMIT_ENV: "req-4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quarantined ['req-4']" in proc.stderr
    assert "done: 5 results, 1 errors (6 requests) in " in proc.stderr, proc.stderr[-1500:]


@pytest.mark.slow
def test_suspects_answered_in_isolation_leave_the_count(tmp_path, tiny_chat_model):
    """One crash, then a clean run: the suspects are answered in isolation, so the completed
    job's health counts no crash suspect and the book keeps no strike."""
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    first = run(inp, storage, tiny_chat_model, env={CRASH_ON_ADMIT_ENV: "req-5"})
    assert first.returncode == 1, first.stderr[-3000:]
    second = run(inp, storage, tiny_chat_model)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "isolated groups" in second.stderr
    assert batch_state(storage)["health"]["crash_suspects"] == 0
    books = list((storage / "batches").glob("*.suspects.rank0.json"))
    assert books and orjson.loads(books[0].read_bytes())["strikes"] == {}
    check_against_clean(storage, tiny_chat_model)


def test_completion_removes_the_journal_of_a_rank_no_longer_run(tmp_path, tiny_chat_model):
    """A run of two replicas killed, then finished with one: rank 1's journal (no worker of
    the second run clears it) is gone once the job completes, never to strike a later run."""
    inp = job_input(tmp_path, ROWS[:4])
    storage = tmp_path / "s"
    batches = storage / "batches"
    batches.mkdir(parents=True, mode=0o750)
    stale = batches / "b1.inflight.rank1"
    stale.write_bytes(b'{"run": "0123456789abcdef"}\n"req-1"\n')
    done = run(inp, storage, tiny_chat_model, "--batch-id", "b1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert journal_paths(batches, "b1") == []
