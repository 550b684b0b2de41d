"""Fault injection on the whole job: SIGKILL of the process group at random instants (finalisation
included), a crash at each writer phase, torn tails at random offsets, a corrupt middle line.
Each ends the same way: exactly one record per custom_id, identical to an uninterrupted run."""

import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest
from test_reliability_support import (
    ROWS,
    batch_state,
    check_against_clean,
    clean_input,
    copy_clean,
    count_lines,
    incremental_file,
    job_input,
    kill_group,
    launch,
    record_figures,
    run,
    seeded_rng,
    wait_for,
    worker_pids,
)

from batchgen.io.writer import IncrementalScan, IncrementalWriter
from batchgen.testing.faults import PHASES, WRITER_FAULT_ENV

MIN_KILLS = 20
KILLS_PER_JOB = 5
"""A job's last kill waits for finalisation, as does any kill once every record is written (the
relaunch only finalizes then), so jobs are killed while finalizing even when results arrive in
a few large groups and the job ends before its last kill."""


def _phase(storage, started: float) -> str:
    status = batch_state(storage).get("status")
    if status == "finalizing":
        outputs = list((storage / "outputs").glob("*.jsonl"))
        return "finalizing/after-rename" if outputs else "finalizing/before-rename"
    if status == "completed":
        return "completed"
    stats = list((storage / "batches").glob("*.worker*.json"))
    fresh = [p for p in stats if p.stat().st_mtime >= started]
    return "generating" if fresh and worker_pids(storage) else "startup"


def _kill_at_random_instant(proc, storage, rng, mode: str) -> str | None:
    """SIGKILL the process group at an instant chosen by `mode`; the phase it hit, or None when
    the job finished first."""
    started = time.time()
    exited = lambda: proc.poll() is not None
    if mode == "time":
        wait_for(exited, rng.uniform(0.3, 8.0))
    elif mode == "lines":
        target = count_lines(storage) + rng.randint(1, 6)
        wait_for(lambda: exited() or count_lines(storage) >= target, 60)
        time.sleep(rng.uniform(0.0, 0.1))
    else:
        wait_for(lambda: exited() or batch_state(storage).get("status") == "finalizing", 60,
                 poll=0.002)
    phase = _phase(storage, started)
    if exited():
        return None
    kill_group(proc)
    proc.communicate()
    return phase


@pytest.mark.slow
def test_sigkill_storm_then_complete(tmp_path, tiny_chat_model):
    rng = seeded_rng("test_sigkill_storm_then_complete")
    inp = job_input(tmp_path)
    kills: Counter = Counter()
    totals: Counter = Counter()
    jobs = 0
    t0 = time.monotonic()
    while sum(kills.values()) < MIN_KILLS:
        jobs += 1
        storage = tmp_path / f"job{jobs}"
        for attempt in range(KILLS_PER_JOB):
            written = count_lines(storage) >= len(ROWS)
            mode = ("finalize" if written or attempt == KILLS_PER_JOB - 1
                    else rng.choice(["time", "lines"]))
            proc = launch(inp, storage, tiny_chat_model)
            phase = _kill_at_random_instant(proc, storage, rng, mode)
            if phase is None:
                assert proc.returncode == 0, proc.communicate()[1][-3000:]
                break
            kills[phase] += 1
        run(inp, storage, tiny_chat_model, check=True)
        totals.update(check_against_clean(storage, tiny_chat_model))
        assert not list((storage / "outputs").glob(".*.tmp-*")), "a killed finalize left temps"
    finalizing = kills["finalizing/before-rename"] + kills["finalizing/after-rename"]
    assert finalizing >= 1
    record_figures("sigkill_storm", kills=sum(kills.values()), by_phase=dict(kills), jobs=jobs,
                   records=totals["records"], lost=totals["lost"],
                   duplicated=totals["duplicated"], seconds=round(time.monotonic() - t0, 1))


@pytest.mark.slow
def test_crash_at_each_writer_phase(tmp_path, tiny_chat_model):
    # Self-inflicted crashes look exactly like a poison request (each one confirmed, same
    # requests in flight): --quarantine-after is raised so this test sees only the writer.
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    extra = ("--quarantine-after", "10")
    for phase in PHASES:
        before = count_lines(storage)
        proc = run(inp, storage, tiny_chat_model, *extra, env={WRITER_FAULT_ENV: f"{phase}:2"})
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "crashed (killed by signal 9)" in proc.stderr
        scan = IncrementalScan(incremental_file(storage))
        ids = [cid for _, _, cid in scan]
        assert len(ids) == len(set(ids)), f"{phase}: a result was written twice"
        assert scan.lines >= before, f"{phase}: an acknowledged result was lost"
    run(inp, storage, tiny_chat_model, *extra, check=True)
    figures = check_against_clean(storage, tiny_chat_model)
    record_figures("writer_phases", faults=len(PHASES), phases=list(PHASES), **figures)


REPAIR_OFFSETS = 300
RESUME_OFFSETS = 3


def _repair_sweep(blob: bytes, offsets: list[int], folder) -> None:
    """Open the real job's results file torn at each offset: only whole lines stay."""
    path = folder / "torn.jsonl"
    for offset in offsets:
        path.write_bytes(blob[:offset])
        whole = blob[:blob.rfind(b"\n", 0, offset) + 1]
        with IncrementalWriter(path) as writer:
            assert writer.lines == whole.count(b"\n") and len(writer.done_ids()) == writer.lines
        assert path.read_bytes() == whole, f"offset {offset}"


@pytest.mark.slow
def test_torn_tail_at_random_offsets_is_recomputed(tmp_path, tiny_chat_model):
    rng = seeded_rng("test_torn_tail_at_random_offsets_is_recomputed")
    blob = incremental_file(copy_clean(tiny_chat_model, tmp_path / "probe")).read_bytes()
    _repair_sweep(blob, rng.sample(range(len(blob) + 1), REPAIR_OFFSETS), tmp_path)
    offsets = sorted(rng.sample(range(1, len(blob)), RESUME_OFFSETS))
    recomputed = 0
    for offset in offsets:
        storage = copy_clean(tiny_chat_model, tmp_path / f"cut{offset}")
        shutil.rmtree(storage / "outputs")  # as if killed before finalisation
        with open(incremental_file(storage), "r+b") as f:
            f.truncate(offset)
        recomputed += 32 - sum(1 for _ in IncrementalScan(incremental_file(storage)))
        run(clean_input(tiny_chat_model), storage, tiny_chat_model, check=True)
        # Resuming the same job keeps `created`: the lines must be byte-for-byte the clean ones.
        check_against_clean(storage, tiny_chat_model, same_job=True)
    record_figures("torn_tail", offsets_repaired=REPAIR_OFFSETS, offsets_resumed=offsets,
                   recomputed=recomputed, lost=0, duplicated=0)


@pytest.mark.slow
def test_corrupt_middle_line_is_refused_with_a_way_out(tmp_path, tiny_chat_model):
    storage = copy_clean(tiny_chat_model, tmp_path / "s")
    shutil.rmtree(storage / "outputs")
    path = incremental_file(storage)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[5] = lines[5][: len(lines[5]) // 2] + b"\n"  # a broken line with good lines after it
    path.write_bytes(b"".join(lines))
    inp = clean_input(tiny_chat_model)
    proc = run(inp, storage, tiny_chat_model)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "line 6" in proc.stderr and "--repair-incremental" in proc.stderr
    assert "Traceback" not in proc.stderr
    subprocess.run([sys.executable, "-m", "batchgen.io.writer", "--repair-incremental", str(path)],
                   check=True, capture_output=True)
    run(inp, storage, tiny_chat_model, check=True)
    check_against_clean(storage, tiny_chat_model, same_job=True)


def test_a_result_of_no_input_record_does_not_stand_in_for_one(tmp_path, tiny_chat_model):
    """A saved result whose custom_id is no input record's (here a damaged id) must not count
    as done: the record it hid is answered, the stray line left out of the final files."""
    storage = copy_clean(tiny_chat_model, tmp_path / "s")
    shutil.rmtree(storage / "outputs")  # as if killed before finalisation
    path = incremental_file(storage)
    blob = path.read_bytes()
    victim = f'"custom_id":"{ROWS[3]["custom_id"]}"'.encode()
    assert blob.count(victim) == 1
    path.write_bytes(blob.replace(victim, b'"custom_id":"no-such-record"'))
    proc = run(clean_input(tiny_chat_model), storage, tiny_chat_model, check=True)
    assert "1 saved results belong to no record" in proc.stderr
    check_against_clean(storage, tiny_chat_model, same_job=True)
