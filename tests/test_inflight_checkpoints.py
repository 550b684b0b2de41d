"""The in-flight checkpoint file: appends hold only what changed, a finished request leaves
the set, a torn or corrupt tail is ignored (the requests it alone held start over), another
job's file is refused, results already saved never resume, and the file is compacted."""

import random

import pytest

from batchgen.core import ChoiceProgress, Completion, FinishReason, TokenLogprob
from batchgen.io import checkpoints
from batchgen.io.checkpoints import CheckpointLog, checkpoint_fingerprint, load

FP = checkpoint_fingerprint({"model": "m", "seed": 3}, 1)


def progress(tokens, logprobs=False, done=None):
    lps = [TokenLogprob(t, -0.1 * t - 1e-9, [(t, -0.1 * t - 1e-9), (t + 1, -7.25)])
           for t in tokens] if logprobs else None
    return ChoiceProgress(list(tokens), lps, done)


def test_appends_replay_to_the_latest_state(tmp_path):
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({})
    log.save({"a": [progress([1, 2])], "b": [progress([5], logprobs=True)]})
    size = path.stat().st_size
    log.save({"a": [progress([1, 2, 3])], "b": [progress([5, 6], logprobs=True)]})
    appended = path.stat().st_size - size
    assert appended < size  # a delta: the tokens drawn since, not the whole answer again
    assert log.save({"a": [progress([1, 2, 3])], "b": [progress([5, 6], logprobs=True)]}) == 0
    state, report = load(path, FP)
    assert state == {"a": [progress([1, 2, 3])], "b": [progress([5, 6], logprobs=True)]}
    assert (report.requests, report.tokens, report.torn) == (2, 5, False)


def test_requests_admitted_with_no_token_drawn_are_not_counted_as_continued(tmp_path):
    """A stop's message and `batchgen status` count the requests a resume continues: one
    admitted (in the engine's intake) with nothing drawn yet starts over, like one never read."""
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({"a": [progress([1, 2])], "b": [progress([]), progress([])], "c": [progress([])]})
    state, report = load(path, FP)
    assert len(state) == 3 and (report.requests, report.tokens) == (1, 2)


def test_finished_requests_leave_and_saved_results_never_resume(tmp_path):
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({"a": [progress([1])], "b": [progress([2])]})
    log.save({"b": [progress([2, 3])]})  # a finished: its result is on disk
    state, _ = load(path, FP)
    assert list(state) == ["b"]
    state, report = load(path, FP, done={"b"})  # b's result was saved after the last line
    assert state == {} and report.requests == 0


def test_a_finished_choice_keeps_its_result(tmp_path):
    path = tmp_path / "c"
    done = Completion(1, [7, 8], FinishReason.STOP, "xy", None, "\n")
    log = CheckpointLog(path, FP)
    log.start({})
    log.save({"n": [progress([1]), progress([7])]})
    log.save({"n": [progress([1, 2]), progress([7, 8], done=done)]})
    log.save({"n": [progress([1, 2, 3]), progress([7, 8], done=done)]})
    state, _ = load(path, FP)
    assert state == {"n": [progress([1, 2, 3]), progress([7, 8], done=done)]}


@pytest.mark.parametrize("first", ["start", "save"])
def test_a_logprobs_choice_saved_before_its_first_token_keeps_its_progress(tmp_path, first):
    """With n > 1 and logprobs, a choice still waiting for its first token is exported with
    no logprobs (the engine has none yet); its later tokens come with them, and the request
    must still resume (it was dropped, its tokens drawn again, at every stop)."""
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    waiting = {"n": [progress([1], logprobs=True), progress([])]}
    log.start(waiting if first == "start" else {})
    if first == "save":
        log.save(waiting)
    later = {"n": [progress([1, 2], logprobs=True), progress([9], logprobs=True)]}
    log.save(later)
    state, report = load(path, FP)
    assert (state, report.dropped) == (later, [])


def test_a_request_started_over_replaces_its_old_progress(tmp_path):
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({"a": [progress([1, 2, 3])], "b": [progress([4, 5])]})
    log.save({"a": [progress([9])], "b": [progress([4, 5])]})  # fewer tokens: seen as restart
    assert load(path, FP)[0] == {"a": [progress([9])], "b": [progress([4, 5])]}
    log.restart("b")  # as many tokens as before or more: only the worker knows
    log.save({"a": [progress([9])], "b": [progress([7, 7, 7])]})
    assert load(path, FP)[0] == {"a": [progress([9])], "b": [progress([7, 7, 7])]}


def test_a_torn_tail_is_ignored_from_where_it_tears(tmp_path):
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({})
    log.save({"a": [progress([1])]})
    good = path.read_bytes()
    log.save({"a": [progress([1, 2])], "b": [progress([4])]})
    whole = path.read_bytes()
    rng = random.Random(0)
    for cut in sorted({len(good) + rng.randrange(len(whole) - len(good) - 1) for _ in range(40)}):
        path.write_bytes(whole[:cut])
        state, report = load(path, FP)
        assert state == {"a": [progress([1])]} and report.torn, cut  # b starts over
    flipped = bytearray(whole)
    flipped[len(good) + 12] ^= 0x01  # a corrupt byte inside a complete line: its CRC fails
    path.write_bytes(bytes(flipped))
    assert load(path, FP)[0] == {"a": [progress([1])]}
    log.start(load(path, FP)[0])  # the next run's snapshot drops the torn tail
    assert path.read_bytes().count(b"\n") == 1 and load(path, FP)[1].torn is False


def test_lines_that_do_not_follow_on_drop_only_their_request(tmp_path):
    path = tmp_path / "c"
    log = CheckpointLog(path, FP)
    log.start({})
    log.save({"a": [progress([1])], "b": [progress([2])]})
    middle = path.read_bytes()
    log.save({"a": [progress([1, 5])], "b": [progress([2, 6])]})
    last = path.read_bytes()[len(middle):]
    snapshot = middle.split(b"\n")[0] + b"\n"
    path.write_bytes(snapshot + last)  # the middle line lost: the last does not follow on
    state, report = load(path, FP)
    assert state == {} and sorted(report.dropped) == ["a", "b"]


def test_another_jobs_checkpoint_is_refused(tmp_path):
    path = tmp_path / "c"
    CheckpointLog(path, FP).start({"a": [progress([1, 2])]})
    other_job = checkpoint_fingerprint({"model": "m", "seed": 4}, 1)
    other_ranks = checkpoint_fingerprint({"model": "m", "seed": 3}, 2)
    for fp in (other_job, other_ranks):
        state, report = load(path, fp)
        assert state == {} and report.refused
    assert load(path, None)[0] == {"a": [progress([1, 2])]}  # status reads any job's


def test_the_file_is_compacted_into_one_snapshot(tmp_path, monkeypatch):
    """Appends of finished and restarted requests pile up; the file is rewritten as one
    snapshot once it holds several times the tokens in flight."""

    def grow(path) -> int:
        log, tokens, largest = CheckpointLog(path, FP), [], 0
        log.start({})
        for step in range(400):  # b runs on while a new request "a<k>" comes every 20 steps
            tokens.append(step)
            state = {f"a{step // 20}": [progress(tokens[-(step % 20 + 1):])],
                     "b": [progress(tokens)]}
            log.save(state)
            largest = max(largest, path.stat().st_size)
        assert load(path, FP)[0] == state
        return largest

    monkeypatch.setattr(checkpoints, "COMPACT_MIN_BYTES", 1 << 40)
    never = grow(tmp_path / "never")
    monkeypatch.setattr(checkpoints, "COMPACT_MIN_BYTES", 2000)
    compacted = grow(tmp_path / "c")
    assert (tmp_path / "c").read_bytes().count(b"\n") < 100
    assert compacted < never / 3


def test_missing_file_is_an_empty_state(tmp_path):
    state, report = load(tmp_path / "none", FP)
    assert state == {} and report.requests == 0 and not report.torn


@pytest.mark.parametrize("interval,ok", [(0, True), (45.5, True), (-1, False)])
def test_interval_flag_is_validated(interval, ok):
    from batchgen.config import ConfigError, WatchdogConfig

    cfg = WatchdogConfig(inflight_checkpoint_interval=interval)
    if ok:
        cfg.validate()
    else:
        with pytest.raises(ConfigError, match="--inflight-checkpoint-interval=-1"):
            cfg.validate()
