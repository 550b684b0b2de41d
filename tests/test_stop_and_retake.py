"""A stop signal runs no further step; a retaken --batch-id records its new input; the run summary
names the status command that finds the job; a job folder deleted mid-run is recorded anew; a stop
during the final merge is on record."""

import contextlib

from batchgen.runner.worker.worker import Worker


class _FakeEngine:
    """An engine whose requests never finish; step() can raise the stop flag mid-step (a
    SIGTERM arriving while a decode burst runs)."""

    def __init__(self, on_step):
        self.steps = 0
        self.settles = 0
        self.num_requests = 1
        self.generated_tokens = 0
        self._on_step = on_step

    def has_unfinished(self):
        return True

    def step(self):
        self.steps += 1
        self._on_step(self.steps)
        return []

    def settle(self):
        self.settles += 1
        return []

    def inflight_state(self):
        return {}


class _Stop:
    requested = False


class _TP:
    @staticmethod
    def any(flag):
        return flag


class _Watchdog:
    @contextlib.contextmanager
    def deadline(self, name):
        yield

    def started(self):
        pass


class _Clock:
    def mark(self, *a):
        pass


def _worker(on_step):
    w = object.__new__(Worker)
    w.stop = _Stop()
    w.tp = _TP()
    w.watchdog = _Watchdog()
    w.engine = _FakeEngine(lambda n: on_step(w, n))
    w.writer = None
    w.checkpoints = None
    w.clock = _Clock()
    w._report = lambda force=False: None
    w._intake = lambda records, limit, lines: False
    w._embedded = lambda: []
    w.rank = type("R", (), {"rank": 0})()
    saved = []
    w._checkpoint = lambda stopping: saved.append(stopping)
    return w, saved


def test_a_stop_during_a_step_runs_no_further_step():
    """docs/reliability.md promise 6: on a stop signal the worker "finishes its current step,
    flushes what finished, saves the progress of the requests in flight and exits 75". A
    signal landing during a step must not start another full step (a decode burst, or a
    prefill) before the checkpoint: on a slow machine that doubles the stop's duration, runs
    past the worker's share of --preempt-grace and the stop checkpoint is never written
    (the timer's os._exit comes first), so the tokens are drawn again on resume."""

    def signal_during_first_step(w, n):
        if n == 1:
            w.stop.requested = True

    w, saved = _worker(signal_during_first_step)
    assert w._serve(iter(()), limit=1) is True
    assert w.engine.steps == 1, "a new step was run after the stop signal"
    assert w.engine.settles == 1  # the burst still on the device is collected
    assert saved[-1] is True  # and the stop checkpoint written


def test_a_stop_says_how_many_in_flight_have_tokens_to_continue(caplog):
    """A stop's log line counts the requests in flight and those whose drawn tokens the
    checkpoint holds: a job of 1-token answers stopped with 10,239 requests read, 3 of them
    with a token drawn, must not say that all 10,239 continue from their checkpoint."""

    def signal_during_first_step(w, n):
        if n == 1:
            w.stop.requested = True

    w, _ = _worker(signal_during_first_step)
    w.engine.num_requests = 10239
    w.checkpoints = type("Checkpoints", (), {"stats": {"requests": 3}})()
    with caplog.at_level("WARNING", logger="batchgen.worker"):
        assert w._serve(iter(()), limit=1) is True
    assert "10239 in flight, 3 of them with tokens drawn, which the resume continues" in \
        caplog.text


def test_a_retaken_batch_id_records_the_new_input(tmp_path):
    """A run that stopped before its first result "decided nothing: this run's settings become
    the job's" (prepare.py). With --batch-id and another input file, the batch file must then
    describe the new input: `batchgen status` reads its request total ("saved N of TOTAL") and
    input_file (named by warn_if_replacing), which kept the first input's."""
    from batchgen.config import JobConfig, StorageConfig
    from batchgen.io.jobfiles import BatchFile
    from batchgen.runner.leader import prepare
    from job_utils import chat_rows, write_jsonl

    def start(rows, name):
        inp = write_jsonl(tmp_path / name, chat_rows(rows))
        config = JobConfig(storage=StorageConfig(
            input=str(inp), storage_path=str(tmp_path / "s"), batch_id="myjob")).validate()
        source, paths = prepare.identify(config)
        summary = prepare.parse(config, source, paths)
        prepare.prepare(config, summary, paths)
        return inp, paths

    start(5, "first.jsonl")  # killed before any result was saved
    inp, paths = start(2, "second.jsonl")
    state = BatchFile(paths.batch_file).load()
    assert state.request_counts["total"] == 2
    assert state.input_file == str(inp.resolve())


def test_tokens_in_a_checkpoint_hold_the_job_to_its_settings(tmp_path):
    """A job of long answers killed before its first result, its in-flight checkpoint holding
    tokens, has decided something: a rerun with another model (a Hub branch that moved under
    --model org/name) is refused naming the difference. Before, the rerun took the new
    settings and threw the checkpointed tokens away. A checkpoint holding requests but no
    token yet decided nothing."""
    import pytest

    from batchgen.config import EngineConfig, JobConfig, RuntimeConfig, StorageConfig
    from batchgen.core import ChoiceProgress
    from batchgen.io.checkpoints import CheckpointLog, checkpoint_path
    from batchgen.io.jobfiles import FingerprintMismatch
    from batchgen.runner.leader import prepare
    from job_utils import chat_rows, write_jsonl

    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))

    def start(seed):
        config = JobConfig(storage=StorageConfig(input=str(inp), storage_path=str(tmp_path / "s")),
                           engine=EngineConfig(runtime=RuntimeConfig(seed=seed))).validate()
        source, paths = prepare.identify(config)
        prepare.prepare(config, prepare.parse(config, source, paths), paths)
        return paths

    paths = start(seed=0)
    log = CheckpointLog(checkpoint_path(paths.batch_file, paths.batch_id, 0), "fp")
    log.start({"req-0": [ChoiceProgress([])]})  # admitted, nothing drawn: decided nothing
    start(seed=1)
    log.start({"req-0": [ChoiceProgress([5, 6, 7])]})  # killed mid-answer
    with pytest.raises(FingerprintMismatch, match="seed: 1 -> 2"):
        start(seed=2)


def test_run_summary_names_the_storage_path_status_needs(tmp_path, monkeypatch):
    """A run with --storage-path elsewhere ended with "`batchgen status OUT` shows it", but
    that command looks only in OUT's .batchgen/ and the default folder: "no job writes OUT",
    exit 1. The hint must name the job folder when status would not find it by itself."""
    from batchgen.runner.leader.progress import run_summary

    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "o.jsonl"
    beside = run_summary(1.0, 1, 0, 1, 1, 1, out, tmp_path / "o.errors.jsonl",
                         tmp_path / ".batchgen")
    assert f"`batchgen status {out}` shows it" in beside
    elsewhere = run_summary(1.0, 1, 0, 1, 1, 1, out, tmp_path / "o.errors.jsonl",
                            tmp_path / "jobs")
    assert f"`batchgen status {out} --storage-path {tmp_path / 'jobs'}` shows it" in elsewhere


def test_a_job_folder_deleted_while_it_ran_is_recorded_again(tmp_path):
    """Deleting the job folder while a run works: the run fails and its end is recorded into a
    batch file made anew, with no fingerprint, input or upload record. The next run starts the
    job over and must record it whole: before, it kept the stub, so status named no input and
    a resume with other settings was refused as 'a job with other settings' sharing an
    --incremental-output-dir instead of by the fingerprint."""
    import shutil

    import pytest

    from batchgen.config import EngineConfig, JobConfig, RuntimeConfig, StorageConfig
    from batchgen.io.jobfiles import BatchFile, FingerprintMismatch
    from batchgen.runner.leader import prepare
    from job_utils import chat_rows, write_jsonl

    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))

    def start(seed=0):
        config = JobConfig(storage=StorageConfig(input=str(inp), storage_path=str(tmp_path / "s")),
                           engine=EngineConfig(runtime=RuntimeConfig(seed=seed))).validate()
        source, paths = prepare.identify(config)
        prepare.prepare(config, prepare.parse(config, source, paths), paths)
        return paths

    paths = start()
    recorded = BatchFile(paths.batch_file).load().fingerprint
    shutil.rmtree(tmp_path / "s")  # while the run works; its end is then recorded anew:
    BatchFile(paths.batch_file).update(paths.batch_id, status="failed",
                                       health={"last_exit_code": 1})
    start()
    state = BatchFile(paths.batch_file).load()
    assert state.fingerprint == recorded
    assert state.input_file == str(inp.resolve())
    assert paths.upload_file.exists()
    # a result saved, then a kill
    paths.incremental().write_text('{"id": "batch_req_0", "custom_id": "req-0", "response": '
                                   '{"status_code": 200, "body": {}}, "error": null}\n')
    with pytest.raises(FingerprintMismatch) as err:
        start(seed=1)
    assert "seed: 0 -> 1" in str(err.value) and "incremental-output-dir" not in str(err.value)


def test_a_stop_during_the_final_merge_is_on_record(tmp_path, monkeypatch):
    """A stop signal while the outputs are merged exits 75 and the rerun merges again
    (docs/reliability.md promise 6); `batchgen status` must then say the job was stopped.
    Before, the batch file stayed 'finalizing' and health.last_stop named an older stop, or
    none, though no run was merging any more."""
    import pytest

    from batchgen.config import JobConfig, StorageConfig
    from batchgen.io.jobfiles import BatchFile
    from batchgen.runner.exits import Preempted, StopSignals
    from batchgen.runner.files.job import file_version
    from batchgen.runner.leader import prepare, supervisor
    from job_utils import chat_rows, write_jsonl

    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    config = JobConfig(storage=StorageConfig(input=str(inp), storage_path=str(tmp_path / "s"))
                       ).validate()
    source, paths = prepare.identify(config)
    spec, batch_file = prepare.prepare(config, prepare.parse(config, source, paths), paths)
    batch_file.update(spec.batch_id, health={"last_stop": "SIGINT"})  # an earlier run's

    def stopped(*args, **kwargs):
        raise Preempted("SIGTERM")

    monkeypatch.setattr(supervisor, "finalize", stopped)
    member = type("Member", (), {"group": None})()
    with pytest.raises(Preempted):  # every record has its result: the run only merges
        supervisor._run_locked(spec, batch_file, spec.total_records, StopSignals(), member, {},
                               file_version(inp))
    state = BatchFile(paths.batch_file).load()
    assert state.status == "in_progress" and state.health["last_stop"] == "SIGTERM"
