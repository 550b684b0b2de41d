"""A worker imports and loads its model with the cyclic garbage collector off, and turns it on
before the engine runs a forward."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

import batchgen.runner.worker.worker as worker_mod
import batchgen.runner.worker.serve as serve_mod
import batchgen.runner.worker.worker_entry as entry
from batchgen.config import JobConfig, StorageConfig
from batchgen.io.parsed_input import parse_input
from batchgen.io.reader import identify_input
from batchgen.runner.files.job import JobSpec
from batchgen.runner.worker.process import StopFlag


@pytest.fixture
def collector_restored():
    yield
    gc.enable()


def test_entry_runs_the_worker_with_the_collector_off(monkeypatch, collector_restored):
    seen = []
    monkeypatch.setattr(entry, "requeue_on_stop_signals", lambda: None)
    monkeypatch.setattr(serve_mod, "main", lambda: seen.append(gc.isenabled()) or 0)
    assert entry.start() == 0
    assert seen == [False]


class _Stop(Exception):
    pass


def test_collector_is_back_on_before_the_engine(tmp_path, monkeypatch, collector_restored):
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "prompt": "hi"}\n')
    config = JobConfig(storage=StorageConfig(input=str(source), output=str(tmp_path / "o.jsonl"),
                                             storage_path=str(tmp_path / "state")))
    spec = JobSpec(config=config, batch_id="batch_gc", input_sha256="0" * 64, total_records=1,
                   created=0)
    for path in (spec.paths.batch_file, spec.paths.incremental(0, 1)):
        path.parent.mkdir(parents=True, exist_ok=True)
    parse_input(identify_input(source), spec.paths.parsed_input, 1 << 20, 16)  # the leader's
    seen = {}

    def load(*args, **kwargs):
        seen["load"] = gc.isenabled()
        return type("Loaded", (), {"max_context": 64, "model": None, "tokenizer": None,
                                   "eos_token_ids": ()})()

    def engine(*args, **kwargs):
        seen["engine"] = gc.isenabled()
        raise _Stop

    monkeypatch.setattr(worker_mod, "load_model", load)
    monkeypatch.setattr(worker_mod, "Engine", engine)
    gc.disable()  # as worker_entry leaves it
    with pytest.raises(_Stop):
        # A watchdog whose stats file holds no earlier attempt (all the worker reads of it
        # before the engine).
        watchdog = SimpleNamespace(stats=SimpleNamespace(counts=dict))
        worker_mod.Worker(spec, worker_mod.RankInfo(), StopFlag(30.0), watchdog)
    assert seen == {"load": False, "engine": True}
