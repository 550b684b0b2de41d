"""batchgen.testing.faults: every hook is off unless its variable is set, and each does what the
reliability tests rely on."""

from __future__ import annotations

import pytest

from batchgen.testing import faults

ALL_ENVS = (faults.WRITER_FAULT_ENV, faults.DISK_FULL_ENV, faults.CRASH_ON_ADMIT_ENV,
            faults.DIVERGE_ENV, faults.STUCK_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ALL_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_hook_is_off_without_its_variable(clean_env):
    assert faults.writer_fault() is None
    assert faults.admit_fault() is None
    assert faults.replica_fault(0) is None
    assert faults.stuck_seconds() == 0.0


def test_writer_fault_from_the_environment(clean_env):
    clean_env.setenv(faults.DISK_FULL_ENV, "4096")
    fault = faults.writer_fault()
    assert fault is not None and fault.disk_full_at == 4096
    clean_env.setenv(faults.WRITER_FAULT_ENV, "lost_phase")
    with pytest.raises(ValueError, match="phase must be one of"):
        faults.writer_fault()


def test_kill_at_counts_the_phase(monkeypatch):
    kills = []
    monkeypatch.setattr(faults, "_kill_self", lambda: kills.append(True))
    on_phase = faults.kill_at("after_write:3")
    for phase in faults.PHASES * 2:
        on_phase(phase)
    assert kills == []
    on_phase("after_write")
    assert kills == [True]


def test_admit_fault_kills_on_its_custom_id(clean_env, monkeypatch):
    kills = []
    monkeypatch.setattr(faults, "_kill_self", lambda: kills.append(True))
    clean_env.setenv(faults.CRASH_ON_ADMIT_ENV, "req-5")
    on_admit = faults.admit_fault()
    on_admit(["req-1", "req-2"])
    assert kills == []
    on_admit(["req-4", "req-5"])
    assert kills == [True]


def test_replica_fault_drops_one_chunk_once_on_its_rank(clean_env):
    clean_env.setenv(faults.DIVERGE_ENV, "1:3")
    assert faults.replica_fault(0) is None
    tamper = faults.replica_fault(1)
    chunks = ["a", "b"]
    tamper(2, chunks)
    assert chunks == ["a", "b"]
    tamper(4, chunks)
    assert chunks == ["a"]
    tamper(5, chunks)
    assert chunks == ["a"]


def test_stuck_seconds(clean_env):
    clean_env.setenv(faults.STUCK_ENV, "0.25")
    assert faults.stuck_seconds() == 0.25
    clean_env.setenv(faults.STUCK_ENV, "-1")
    with pytest.raises(ValueError, match="seconds >= 0"):
        faults.stuck_seconds()
