"""One job run as a new user runs it: -i/-o, --max-tokens as the default of lines that give
none, --max-model-len refusing longer requests by line, job state beside the output, the
end-of-run summary, and `batchgen status OUTPUT`."""

import json

from job_utils import batchgen, read_jsonl, write_jsonl


def test_max_tokens_default_max_model_len_summary_and_status(tmp_path, tiny_chat_model):
    rows = [{"custom_id": "plain", "prompt": "Once upon a time", "ignore_eos": True,
             "temperature": 0.0},
            {"custom_id": "own", "prompt": "Once upon a time", "ignore_eos": True,
             "max_tokens": 5, "temperature": 0.0},
            {"custom_id": "long", "prompt": "Once upon a time", "max_tokens": 200}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out" / "r.jsonl"
    proc = batchgen("run", "-i", inp, "-o", out, "--model", tiny_chat_model, "--max-tokens", "3",
                    "--max-model-len", "64", "--dtype", "fp32", check=True)
    results = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    assert results["plain"]["usage"]["completion_tokens"] == 3
    assert results["own"]["usage"]["completion_tokens"] == 5
    [error] = read_jsonl(tmp_path / "out" / "r.errors.jsonl")
    message = error["response"]["body"]["error"]["message"]
    assert error["custom_id"] == "long" and "max_tokens (200)" in message
    assert "--max-model-len 64" in message and "line 3" in message
    assert (tmp_path / "out" / ".batchgen" / "batches").is_dir()  # state beside the output
    assert "done: 2 results, 1 errors (3 requests) in" in proc.stderr
    worker_lines = [line for line in proc.stderr.splitlines() if "batchgen.models" in line]
    assert worker_lines and all(line[:2] == "20" for line in worker_lines)  # no launcher tag
    assert "[default" not in proc.stderr
    assert f"results: {out}" in proc.stderr and "out tok/s this run" in proc.stderr
    status = batchgen("status", out, env={"COLUMNS": "200"})
    assert status.returncode == 0 and ": completed" in status.stdout
    assert "over 1 run " in status.stdout and "r.errors.jsonl" in status.stdout
    # no page full: nothing cached
    assert "0% of" in status.stdout and "prompt tokens in the last run" in status.stdout
    batch = next(p for p in (tmp_path / "out" / ".batchgen" / "batches").glob("*.json")
                 if p.name.count(".") == 1)
    assert json.loads(batch.read_text())["timings"]["runs"] == 1


def test_the_launchers_stop_signal_warnings_are_dropped_and_its_errors_kept(caplog):
    import logging

    from batchgen.runner.leader.launch import LAUNCHER_LOGGERS, quiet_signal_warnings

    quiet_signal_warnings()
    quiet_signal_warnings()  # once is enough
    logger = logging.getLogger(LAUNCHER_LOGGERS[1])
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Received 15 death signal, shutting down workers")
        logger.warning("Sending process 12 closing signal SIGTERM")
        logger.warning("Unable to shutdown process 12 via 15, forcefully exiting via 9")
        logger.error("failed (exitcode: 1) local_rank: 0")
    assert [r.getMessage() for r in caplog.records] == ["failed (exitcode: 1) local_rank: 0"]


def test_convert_takes_the_short_dtype_names_run_takes(tmp_path, tiny_chat_model):
    proc = batchgen("convert", "--model", tiny_chat_model, "--output", tmp_path / "c",
                    "--dtype", "bf16", check=True)
    assert "converted" in proc.stdout
    manifest = json.loads((tmp_path / "c" / "batchgen_manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16"


def test_convert_into_a_folder_that_holds_something_is_a_usage_error(tmp_path):
    """Exit 2 naming --output, before the model is read (5 is for a model that cannot run)."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("kept")
    proc = batchgen("convert", "--model", tmp_path / "absent", "--output", tmp_path / "c")
    assert proc.returncode == 2 and "--output" in proc.stderr and "not an empty folder" in \
        proc.stderr
    assert (tmp_path / "c" / "x").read_text() == "kept"


def test_rendezvous_events_are_named_as_torch_names_them_without_inspecting_the_stack(
        monkeypatch):
    """The single-node rendezvous names its events by the calling method: the stand-in gives
    the name torch's own helper gives, from the same depth, and is what the launcher uses."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from batchgen.runner.leader.launch import _method_name, cheap_rendezvous_event_names

    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)

    def record(namer):  # as torch's _record: the event is named after record's caller
        return namer()

    def next_rendezvous(namer):
        return record(namer)

    assert next_rendezvous(original) == next_rendezvous(_method_name) == "next_rendezvous"
    assert _method_name(10_000) == original(10_000) == "no_method_name"
    cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is _method_name
