"""A stop signal runs no further step; a retaken --batch-id records its new input; the run summary
names the status command that finds the job."""

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
