"""`batchgen run` end to end, as a user runs it (subprocesses, real files)."""

import json
import os
import random
import signal
import stat
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from job_utils import batchgen, chat_rows, read_jsonl, start, write_jsonl


def run_args(input_path, storage, model, *extra):
    return ["run", "--input", input_path, "--storage-path", storage, "--model", model,
            "--seed", "3", *extra]


def outputs(storage):
    out = sorted((storage / "outputs").glob("*.jsonl"))
    results = [p for p in out if not p.name.endswith(".errors.jsonl")]
    errors = [p for p in out if p.name.endswith(".errors.jsonl")]
    return read_jsonl(results[0]), read_jsonl(errors[0]) if errors else []


def test_run_writes_results_in_input_order(tmp_path, tiny_chat_model):
    rows = chat_rows(6)
    rows.insert(2, {"custom_id": "bad", "messages": "not a list"})
    rows.append({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    proc = batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    results, errors = outputs(tmp_path / "s")
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(6)] + ["line-8"]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    body = results[0]["response"]["body"]
    assert (body["object"] == "chat.completion"
            and body["choices"][0]["message"]["role"] == "assistant")
    assert body["usage"]["completion_tokens"] <= 24
    assert results[-1]["response"]["body"]["object"] == "text_completion"
    batch_file = [p for p in (tmp_path / "s" / "batches").glob("*.json") if p.name.count(".") == 1]
    batch = json.loads(batch_file[0].read_text())
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 8, "completed": 7, "failed": 1}
    assert "done: 7 results" in proc.stderr
    assert not list((tmp_path / "s" / "batches").glob("*.requests*"))  # the store and its stamp
    # A clean exit: nothing left for the interpreter's teardown to report (a heap still frozen
    # for the GC at exit made native extensions print each object as a leak).
    assert "Traceback" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_finished_job_rerun_is_a_noop(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    inc = next((tmp_path / "s" / "incremental").glob("*.jsonl"))
    before = inc.read_bytes()
    proc = batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    assert "already completed" in proc.stderr
    assert inc.read_bytes() == before


def test_another_input_to_the_same_output_says_it_replaces_it_and_how_to_get_it_back(
        tmp_path, tiny_chat_model):
    first = write_jsonl(tmp_path / "first.jsonl", chat_rows(3))
    second = write_jsonl(tmp_path / "second.jsonl", chat_rows(2, max_tokens=9))
    out = tmp_path / "results.jsonl"
    batchgen(*run_args(first, tmp_path / "s", tiny_chat_model), "-o", out, check=True)
    kept = read_jsonl(out)
    proc = batchgen(*run_args(second, tmp_path / "s", tiny_chat_model), "-o", out, check=True)
    assert "holds the results of another job" in proc.stderr
    assert f"batchgen run -i {first}" in proc.stderr  # how to get them back
    assert len(read_jsonl(out)) == 2
    # ...and that command writes them back without recomputing a token
    proc = batchgen(*run_args(first, tmp_path / "s", tiny_chat_model), "-o", out, check=True)
    assert "3 already done" in proc.stderr
    assert read_jsonl(out) == kept
    # the same job again says nothing of the kind
    proc = batchgen(*run_args(first, tmp_path / "s", tiny_chat_model), "-o", out, check=True)
    assert "another job" not in proc.stderr


def test_an_errors_file_of_another_job_is_named_before_it_is_replaced(tmp_path):
    """Another job's answers may all be error lines: its results file is empty and its errors
    file holds them. A job given that --output says it replaces them (no model: every line of
    both inputs is refused at intake)."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text('{"prompt": 5}\n{bad\n')
    second.write_text("{bad\n")
    out = tmp_path / "results.jsonl"
    batchgen("run", "-i", first, "-o", out, check=True)
    assert out.read_text() == "" and len(read_jsonl(tmp_path / "results.errors.jsonl")) == 2
    proc = batchgen("run", "-i", second, "-o", out, check=True)
    assert f"{tmp_path / 'results.errors.jsonl'} holds the results of another job" in proc.stderr
    assert f"batchgen run -i {first}" in proc.stderr
    proc = batchgen("run", "-i", second, "-o", out, check=True)  # its own: nothing to say
    assert "another job" not in proc.stderr


def test_resume_refuses_changed_settings(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    proc = batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model, "--kv-dtype", "fp16"))
    assert proc.returncode == 3 and "kv_dtype" in proc.stderr


def test_max_tokens_may_change_on_resume_only_where_no_request_takes_it(tmp_path,
                                                                        tiny_chat_model):
    rows = chat_rows(2)  # each sets its max_tokens: --max-tokens decides nothing
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model, "--max-tokens", "5"), check=True)
    proc = batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model, "--max-tokens", "7"),
                    check=True)
    assert "already completed" in proc.stderr
    del rows[1]["body"]["max_tokens"]  # this one takes --max-tokens
    inp = write_jsonl(tmp_path / "takes.jsonl", rows)
    batchgen(*run_args(inp, tmp_path / "t", tiny_chat_model, "--max-tokens", "5"), check=True)
    proc = batchgen(*run_args(inp, tmp_path / "t", tiny_chat_model, "--max-tokens", "7"))
    assert proc.returncode == 3 and "default_max_tokens: 5 -> 7" in proc.stderr


def test_resume_refuses_other_weights_behind_the_same_model_path(tmp_path, tiny_chat_model):
    """A new checkpoint written into the model folder mid-job must not mix two models'
    answers in one job; the original bytes put back resume as before."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_chat_model, tmp_path / "model")
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    batchgen(*run_args(inp, tmp_path / "s", model), check=True)
    weights = next(model.glob("*.safetensors"))
    original = weights.read_bytes()
    tensors = load_file(weights)
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()},
              str(weights), metadata={"format": "pt"})
    proc = batchgen(*run_args(inp, tmp_path / "s", model))
    assert proc.returncode == 3 and "model_weights" in proc.stderr, proc.stderr[-2000:]
    weights.write_bytes(original)
    proc = batchgen(*run_args(inp, tmp_path / "s", model))
    assert proc.returncode == 0 and "already completed" in proc.stderr, proc.stderr[-2000:]
    state_file = next(p for p in (tmp_path / "s" / "batches").glob("*.json")
                      if p.name.count(".") == 1)  # batches/{batch_id}.json
    state = json.loads(state_file.read_text())
    del state["fingerprint"]["model_weights"]  # a job started before weights were counted
    state_file.write_text(json.dumps(state))
    proc = batchgen(*run_args(inp, tmp_path / "s", model))
    assert proc.returncode == 0 and "already completed" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flag,value,needle", [
    ("--kv-dtype", "bf17", "--kv-dtype"),
    ("--decision-frequency-pages", "8", "--extension-gpu-page-buffer"),
    ("--gpu-memory-frac", "1.5", "--gpu-memory-frac"),
    ("--host-kv-watermark", "120", "--host-kv-watermark"),
    ("--seed", "-1", "--seed"),
    ("--seed", "99999999999999999999999", "--seed"),
    ("--storage-path", "", "--storage-path"),
])
def test_bad_flag_fails_before_loading(tmp_path, flag, value, needle):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    proc = batchgen("run", "--input", inp, "--storage-path", tmp_path / "s", flag, value)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists()


def test_missing_model_names_the_places_searched(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    proc = batchgen("run", "--input", inp, "--storage-path", tmp_path / "s", "--model",
                    "nobody/no-such-model", "--cache-dir", tmp_path / "models")
    assert proc.returncode == 5
    assert "not found" in proc.stderr and str(tmp_path / "models") in proc.stderr


def test_duplicate_custom_id_fails_before_loading(tmp_path):
    rows = chat_rows(3)
    rows[2]["custom_id"] = "req-0"
    proc = batchgen("run", "--input", write_jsonl(tmp_path / "in.jsonl", rows), "--storage-path",
                    tmp_path / "s", "--model", "nobody/none")
    assert proc.returncode == 2 and "req-0" in proc.stderr and "line" in proc.stderr


def test_parquet_input(tmp_path, tiny_chat_model):
    table = pa.table({"custom_id": ["a", "b"], "prompt": ["Hello there", "The sky is"],
                      "max_tokens": [5, 7], "temperature": [0.0, 0.0]})
    pq.write_table(table, tmp_path / "in.parquet")
    batchgen(*run_args(tmp_path / "in.parquet", tmp_path / "s", tiny_chat_model), check=True)
    results, errors = outputs(tmp_path / "s")
    assert [r["custom_id"] for r in results] == ["a", "b"] and not errors


def test_sigkill_at_random_moments_then_resume(tmp_path, tiny_chat_model):
    # Greedy: sampled tokens may legitimately differ when batch composition changes the last
    # bits of the logits; the promise is identical results for greedy decoding.
    rows = chat_rows(24, max_tokens=40, temperature=0.0)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    batchgen(*run_args(inp, tmp_path / "clean", tiny_chat_model), check=True)
    clean, _ = outputs(tmp_path / "clean")
    rng = random.Random(int(os.environ.get("BATCHGEN_TEST_SEED", "0")) or None)
    storage = tmp_path / "killed"
    for _ in range(3):
        proc = start(*run_args(inp, storage, tiny_chat_model))
        time.sleep(rng.uniform(2.0, 12.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    resumed, _ = outputs(storage)
    assert [r["custom_id"] for r in resumed] == [r["custom_id"] for r in clean]
    # Two separate jobs differ only in their start time ("created"); ids are derived.
    for line in clean + resumed:
        line["response"]["body"].pop("created")
    assert resumed == clean
    incremental = [json.loads(l) for p in (storage / "incremental").glob("*.jsonl")
                   for l in p.read_text().splitlines()]
    ids = [r["custom_id"] for r in incremental]
    assert len(ids) == len(set(ids)) == len(rows)
    # Usage is the output's, however many runs were killed before recording theirs.
    assert batch_record(storage)["usage"] == usage_of(resumed)


def batch_record(storage) -> dict:
    return json.loads(next(p for p in (storage / "batches").glob("*.json")
                           if p.name.count(".") == 1).read_text())


def usage_of(results: list[dict]) -> dict:
    prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in results)
    completion = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    cached = sum(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                 for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def test_no_incremental_save_removes_its_files_only_once_completed(tmp_path, tiny_chat_model):
    """--no-incremental-save deletes the incremental files after the job is on record as
    completed; files left by a kill between the two go at the next (no-op) run."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    storage = tmp_path / "s"
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)  # keeps its files
    assert list((storage / "incremental").glob("*.jsonl"))
    proc = batchgen(*run_args(inp, storage, tiny_chat_model, "--no-incremental-save"),
                    check=True)
    assert "already completed" in proc.stderr
    assert not list((storage / "incremental").glob("*.jsonl"))
    results, _ = outputs(storage)
    assert batch_record(storage)["usage"] == usage_of(results)


def test_validate_command(tmp_path):
    rows = chat_rows(3) + [{"custom_id": "x", "messages": [{"role": "user"}]}]
    proc = batchgen("validate", "--input", write_jsonl(tmp_path / "in.jsonl", rows))
    assert proc.returncode == 1
    assert "3 valid, 1 invalid" in proc.stdout and "line 4" in proc.stdout
    proc = batchgen("validate", "--input", tmp_path / "in.jsonl", "--max-tokens", "-5")
    assert proc.returncode == 2 and "--max-tokens=-5" in proc.stderr and "line 1" not in proc.stderr


def test_response_format_is_enforced_and_bad_schemas_are_error_lines(tmp_path, tiny_chat_model):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    rows = [{"custom_id": "json", "messages": [{"role": "user", "content": "Reply."}],
             "max_tokens": 40, "temperature": 0.8, "seed": 2,
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}}},
            {"custom_id": "bad", "messages": [{"role": "user", "content": "Reply."}],
             "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                 "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    results, errors = outputs(tmp_path / "s")
    message = results[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert json.loads(message) in ({"ok": True}, {"ok": False})
    assert errors[0]["custom_id"] == "bad"
    assert errors[0]["response"]["body"]["error"]["code"] == "unsupported_response_format"


def test_input_edited_during_the_run_is_not_published(tmp_path, tiny_chat_model):
    """Workers read the input as they go: a line appended mid-run would be answered under the
    original input's identity. The job refuses to publish (exit 3) and says how to start over;
    touching the file without changing it is fine."""
    from batchgen.runner.files.job import JobSpec, check_input_unchanged, file_version

    rows = chat_rows(30, max_tokens=40)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    storage = tmp_path / "s"
    proc = start(*run_args(inp, storage, tiny_chat_model))
    deadline = time.time() + 120
    while not any(p.stat().st_size for p in (storage / "incremental").glob("*.jsonl")):
        assert proc.poll() is None and time.time() < deadline, "the job ended before any result"
        time.sleep(0.05)
    with open(inp, "a") as f:
        f.write(json.dumps({"custom_id": "late", "messages": [
            {"role": "user", "content": "added mid-run"}]}) + "\n")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-2000:]
    assert "changed while job" in err and "Nothing was published" in err
    assert not list((storage / "outputs").glob("*.jsonl"))
    spec = JobSpec.from_bytes(next((storage / "batches").glob("*.spec.json")).read_bytes())
    # As that message says, the edited file starts over: a new job, not a refused resume.
    proc = batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    assert "0 already done" in proc.stderr

    # The version check alone: a touched but identical input passes, an edited one does not.
    original = tmp_path / "original.jsonl"
    write_jsonl(original, rows)
    inp.write_bytes(original.read_bytes())
    version = file_version(inp)
    os.utime(inp)
    check_input_unchanged(spec, version)
    write_jsonl(inp, rows[:-1])
    with pytest.raises(Exception, match="changed while job"):
        check_input_unchanged(spec, version)


def reopen(storage, batch_id: str) -> None:
    """The batch file as a run killed before "completed" was recorded leaves it."""
    record = storage / "batches" / f"{batch_id}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "in_progress"}))


def test_a_rerun_clears_temp_files_of_killed_atomic_writes(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    storage = tmp_path / "s"
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    batch_id = next((storage / "uploads").glob("*.json")).stem
    leftovers = [storage / "batches" / f".{batch_id}.json.tmp-1234",
                 storage / "batches" / f".{batch_id}.worker0.json.tmp-99",
                 storage / "batches" / f"{batch_id}.spec.json.tmp-77",
                 storage / "uploads" / f".{batch_id}.json.tmp-5"]
    for path in leftovers:
        path.write_text("{")
    reopen(storage, batch_id)
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    assert not [p for p in leftovers if p.exists()]


def test_save_result_keeps_an_atomic_copy_at_the_default_path(tmp_path, tiny_chat_model):
    """--output elsewhere + --save-result: the job folder's default output holds the same
    bytes; a copy killed halfway left only a temp file, which the next run removes."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    storage, elsewhere = tmp_path / "s", tmp_path / "mine" / "results.jsonl"
    batchgen(*run_args(inp, storage, tiny_chat_model, "--output", elsewhere, "--save-result"),
             check=True)
    batch_id = next((storage / "uploads").glob("*.json")).stem
    default = storage / "outputs" / f"{batch_id}.jsonl"
    assert default.read_bytes() == elsewhere.read_bytes()
    assert len(read_jsonl(default)) == 3
    umask = os.umask(0)
    os.umask(umask)  # the job folder's outputs/ is 0750; the user's own folder the umask's
    assert stat.S_IMODE(default.parent.stat().st_mode) == 0o750
    assert stat.S_IMODE(elsewhere.parent.stat().st_mode) == 0o777 & ~umask
    default.unlink()  # as if killed while copying, before "completed" was recorded
    killed_copy = default.with_name(f".{default.name}.tmp-4321")
    killed_copy.write_text('{"custom_id": "req-0"')
    reopen(storage, batch_id)
    batchgen(*run_args(inp, storage, tiny_chat_model, "--output", elsewhere, "--save-result"),
             check=True)
    assert default.read_bytes() == elsewhere.read_bytes() and not killed_copy.exists()


def test_a_completed_job_is_recognised_without_parsing_its_input(tmp_path, tiny_chat_model,
                                                                 monkeypatch):
    """A rerun of a completed job under the same settings exits before the input is parsed
    again (a million lines take tens of seconds); a changed setting is left to the full check,
    which refuses it."""
    import typer

    from batchgen.cli import app
    from batchgen.cli_options import build_config
    from batchgen.runner.leader import prepare

    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    args = run_args(inp, tmp_path / "s", tiny_chat_model, "--device", "cpu")
    batchgen(*args, check=True)

    def config(*extra):
        command = typer.main.get_command(app).commands["run"]
        return build_config(command.make_context("run", [*map(str, args[1:]), *extra]).params)

    source, paths = prepare.identify(config())
    assert prepare.completed_already(config(), source, paths)
    assert not prepare.completed_already(config("--seed", "4"), source, paths)
    paths.errors_output.write_text("")  # the final files changed by hand: merge again
    paths.output.write_text(paths.output.read_text().split("\n", 1)[1])
    assert not prepare.completed_already(config(), source, paths)


def test_a_refused_rerun_of_a_completed_job_leaves_no_parsed_input(tmp_path, tiny_chat_model):
    """Another --seed on a completed job is refused (exit 3) after the input was parsed again:
    that store (~2x the input) must not stay in the folder of a job that completed."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    storage = tmp_path / "s"
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    assert not list((storage / "batches").glob("*.requests*"))
    proc = batchgen("run", "--input", inp, "--storage-path", storage, "--model",
                    tiny_chat_model, "--seed", "5")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert not list((storage / "batches").glob("*.requests*"))


def test_an_unfinished_jobs_input_changed_between_runs_is_refused(tmp_path, tiny_chat_model):
    """Lines appended to the input of a job that has not finished (killed, stopped) make the
    same command another job (its batch id comes from the content): it would answer every line
    again while the saved results wait unused. Refused (exit 3) naming both ways on: put back,
    the job resumes; a finished job's changed input is another job, as documented."""
    rows = chat_rows(3, max_tokens=4)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    storage = tmp_path / "s"
    batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    batch_id = next((storage / "uploads").glob("*.json")).stem
    reopen(storage, batch_id)  # as a SIGKILL mid-run leaves it
    appended = rows + [{"custom_id": "late", "prompt": "appended", "max_tokens": 2}]
    write_jsonl(inp, appended)
    proc = batchgen(*run_args(inp, storage, tiny_chat_model))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"changed since job {batch_id}" in proc.stderr
    assert "3 of its 3 results are saved" in proc.stderr and "--batch-id" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(list((storage / "uploads").glob("*.json"))) == 1  # no new job recorded
    write_jsonl(inp, rows[::-1])  # reordered: the same bytes in all
    proc = batchgen(*run_args(inp, storage, tiny_chat_model))
    assert proc.returncode == 3 and "the same " in proc.stderr \
        and " bytes, other content" in proc.stderr, proc.stderr[-2000:]
    write_jsonl(inp, rows)
    proc = batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    assert "3 already done" in proc.stderr
    assert "all saved by earlier runs: this run merged them" in proc.stderr
    write_jsonl(inp, appended)
    proc = batchgen(*run_args(inp, storage, tiny_chat_model), check=True)
    assert "0 already done" in proc.stderr


def test_a_job_of_refused_lines_only_loads_no_model(tmp_path, tiny_chat_model):
    """Every line is one the parse refuses: their error lines (as a worker writes them) are
    written without launching a worker, which would load a model for nothing, and the job
    completes."""
    bad = [{"custom_id": "a", "messages": "not a list"},
           {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {}},
           {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}}]
    inp = write_jsonl(tmp_path / "bad.jsonl", bad)
    proc = batchgen(*run_args(inp, tmp_path / "s", tiny_chat_model), check=True)
    assert "no model is loaded" in proc.stderr and "done: 0 results, 3 errors" in proc.stderr
    assert not list((tmp_path / "s" / "batches").glob("*.worker*.json"))  # no worker ran
    assert batch_record(tmp_path / "s")["request_counts"] == {"total": 3, "completed": 0,
                                                                "failed": 3}
    _, errors = outputs(tmp_path / "s")
    assert [e["custom_id"] for e in errors] == ["a", "b", "c"]
    assert [e["response"]["body"]["error"]["param"] for e in errors] == [
        "messages", "messages", "temperature"]
    assert all(e["id"].startswith("batch_req_") and e["response"]["status_code"] == 400
               for e in errors)
