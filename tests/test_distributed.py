"""Data parallel on CPU: `--world-size 2` launches two workers through torch's elastic launcher,
each with its own shard and incremental file; the merged output equals the one-worker run."""

import json
import os

from job_utils import batchgen, chat_rows, read_jsonl, write_jsonl

from batchgen.runner.worker.worker import cpu_threads


def final(storage):
    out = [p for p in (storage / "outputs").glob("*.jsonl") if not p.name.endswith(".errors.jsonl")]
    lines = read_jsonl(out[0])
    for line in lines:
        body = line["response"]["body"]
        body.pop("created")  # separate jobs start at different times
        # How much of a prompt was reused depends on which requests share a worker: the first
        # of each worker computes what the others copy (the answers are the same).
        body["usage"].pop("prompt_tokens_details")
    return lines


def test_world_size_two_equals_world_size_one(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(10))
    for world, name in ((1, "one"), (2, "two")):
        batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                 tmp_path / name, "--world-size", world, check=True)
    ranks = sorted(p.name for p in (tmp_path / "two" / "incremental").glob("*.jsonl"))
    assert [r.split(".", 1)[1] for r in ranks] == ["rank0.jsonl", "rank1.jsonl"]
    assert final(tmp_path / "two") == final(tmp_path / "one")


def test_resume_with_another_world_size_keeps_one_record_each(tmp_path, tiny_chat_model):
    rows = chat_rows(8)
    inp = write_jsonl(tmp_path / "in.jsonl", rows[:8])
    storage = tmp_path / "s"
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", storage,
             "--world-size", 2, check=True)
    # Drop the final outputs and half of one rank's results: a resume at world size 1 must
    # recompute exactly the missing ones and read the rank files for the rest.
    for out in (storage / "outputs").glob("*.jsonl"):
        out.unlink()
    rank1 = next((storage / "incremental").glob("*.rank1.jsonl"))
    lines = rank1.read_text().splitlines(keepends=True)
    rank1.write_text("".join(lines[:2]))
    batch = [p for p in (storage / "batches").glob("*.json") if p.name.count(".") == 1][0]
    batch.write_text(batch.read_text().replace('"completed"', '"in_progress"'))
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", storage,
             "--world-size", 1, check=True)
    ids = [r["custom_id"] for p in (storage / "incremental").glob("*.jsonl") for r in read_jsonl(p)]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows) and len(ids) == len(set(ids))
    assert len(final(storage)) == 8


def test_tensor_parallel_job_equals_world_size_one(tmp_path, tiny_chat_model):
    """--world-size 2 --tensor-parallel-size 2: one replica over two ranks, one results file."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    for world, name in ((1, "one"), (2, "tp")):
        batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                 tmp_path / name, "--world-size", world, "--tensor-parallel-size", world,
                 check=True)
    # One data-parallel replica: one results file, written by the group's first rank only.
    assert len(list((tmp_path / "tp" / "incremental").glob("*.jsonl"))) == 1
    assert final(tmp_path / "tp") == final(tmp_path / "one")
    usage = [json.loads(p.read_text())["usage"] for name in ("one", "tp")
             for p in (tmp_path / name / "batches").glob("*.json") if p.name.count(".") == 1]
    assert usage[0] == usage[1]  # each result counted once, not once per TP rank


def test_replica_divergence_is_detected(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    env = {"BATCHGEN_CHECK_REPLICAS": "1", "BATCHGEN_TEST_DIVERGE": "1:3"}
    proc = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                    tmp_path / "s", "--world-size", 2, "--tensor-parallel-size", 2, env=env)
    assert proc.returncode != 0
    assert "replicas diverged by step" in proc.stdout + proc.stderr


def test_replica_check_passes_on_agreeing_replicas(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", tmp_path / "s",
             "--world-size", 2, "--tensor-parallel-size", 2,
             env={"BATCHGEN_CHECK_REPLICAS": "1"}, check=True)


def test_cpu_workers_share_the_cores(monkeypatch):
    """Each CPU worker takes its share of the cores it may use, not all of them: two workers
    of four spin-waiting threads each on four cores decode several times slower."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    assert [cpu_threads(n) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3
