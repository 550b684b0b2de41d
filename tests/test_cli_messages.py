"""What a user reads: one `error:` line with the fix for each mistake, validate's warnings about
unknown request fields, where job state goes, the end-of-run summary and `batchgen status`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config import StorageConfig, default_storage_path
from batchgen.runner.leader.progress import run_summary
from batchgen.runner.leader.status import age
from job_utils import batchgen, chat_rows, write_jsonl


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("make_args,needles", [
    (lambda t, inp: ["-o", t / "x.parquet"], ["--output", "JSONL", ".jsonl"]),
    (lambda t, inp: ["-o", inp], ["--output", "is the input file"]),
    (lambda t, inp: ["--storage-path", "/proc/no/such"], ["--storage-path", "writable"]),
    (lambda t, inp: ["--dtype", "bf17"], ["--dtype", "bf16"]),
    (lambda t, inp: ["-o", "."], ["--output", "names a folder", "./results.jsonl"]),
    (lambda t, inp: ["-o", f"{t}/new/"], ["--output", "names a folder", "new/results.jsonl"]),
    (lambda t, inp: ["-o", f"{t}/."], ["--output", "names a folder"]),
])
def test_user_errors_are_one_error_line_with_the_fix(tmp_path, make_args, needles):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    line = one_error_line(batchgen("run", "-i", inp, *make_args(tmp_path, inp)))
    assert all(n in line for n in needles), line


def test_csv_and_empty_inputs_say_what_to_do(tmp_path):
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,max_tokens\nhello,5\n")
    line = one_error_line(batchgen("run", "-i", csv, "-o", tmp_path / "o.jsonl"))
    assert "CSV" in line and "Parquet" in line
    command = line.split("e.g. ", 1)[1].replace("python ", f"{sys.executable} ", 1)
    subprocess.run(command, shell=True, check=True)  # the advice works as given
    result = CliRunner().invoke(app, ["validate", "-i", str(tmp_path / "prompts.parquet")])
    assert result.exit_code == 0 and "1 request: 1 valid" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = one_error_line(batchgen("run", "-i", empty, "-o", tmp_path / "o.jsonl"))
    assert "no requests" in line and "empty" in line
    result = CliRunner().invoke(app, ["validate", "-i", str(empty)])
    assert result.exit_code == 1 and "no requests" in result.output


def test_empty_parquet_inputs_say_what_to_do_for_parquet(tmp_path):
    """A Parquet file of no rows is told to write rows, not "one JSON request per line"; a
    0-byte .parquet (a writer that stopped before writing) is named empty, not "not Parquet:
    rename it to .jsonl"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"custom_id": pa.array([], pa.string()),
                             "input": pa.array([], pa.string())}), rows)
    line = one_error_line(batchgen("run", "-i", rows, "-o", tmp_path / "o.jsonl"))
    assert "no requests (it has no rows: write one request per row)" in line, line
    zero = tmp_path / "zero.parquet"
    zero.write_bytes(b"")
    line = one_error_line(batchgen("run", "-i", zero, "-o", tmp_path / "o.jsonl"))
    assert "is empty (0 bytes)" in line and ".jsonl" not in line, line


def test_validate_names_what_an_input_of_no_requests_holds(tmp_path):
    """`batchgen validate` called a file of blank lines, and a Parquet file of no rows, "empty"
    (the latter with no fix, where `batchgen run` says to write rows): it now says what the
    file holds and the fix, as the job's refusal does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    result = CliRunner().invoke(app, ["validate", "-i", str(blank)])
    assert result.exit_code == 1, result.output
    assert "no requests (it holds only blank lines: write one JSON request per line)" \
        in result.output, result.output
    rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), rows)
    result = CliRunner().invoke(app, ["validate", "-i", str(rows)])
    assert result.exit_code == 1, result.output
    assert "no requests (it has no rows: write one request per row)" in result.output


def test_missing_model_lists_the_hf_cache_among_the_places_searched(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    proc = batchgen("run", "-i", inp, "-o", tmp_path / "o.jsonl", "--model", "org/absent",
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""})
    assert proc.returncode == 5 and proc.stderr.startswith("error: ")
    assert str(tmp_path / "hf" / "hub" / "models--org--absent" / "snapshots") in proc.stderr


def test_a_missing_model_path_is_named_as_a_path_not_as_a_hub_cache_entry(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    proc = batchgen("run", "-i", inp, "-o", tmp_path / "o.jsonl", "--model", "./no-such-model",
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""})
    assert proc.returncode == 5 and proc.stderr.startswith("error: "), proc.stderr
    assert "/no-such-model" in proc.stderr and "no such file or folder" in proc.stderr
    assert "models--" not in proc.stderr  # './x' is a path: no Hub cache layout to suggest


@pytest.mark.parametrize("args", [["--tiny"], ["--mode", "embeddings", "--shape",
                                               "qwen3-embedding-0.6b", "--tiny"]])
def test_bench_on_a_cuda_device_that_is_not_there_is_one_error_line(args):
    proc = batchgen("bench", "--device", "cuda", *args, env={"CUDA_VISIBLE_DEVICES": ""})
    line = one_error_line(proc)
    assert "--device cuda" in line and "--device cpu" in line, line


EMBEDDINGS = ["--mode", "embeddings", "--shape", "qwen3-embedding-0.6b"]


@pytest.mark.parametrize("args,needle", [
    (["--dtype", "fp64"], "--dtype='fp64' is not allowed: one of auto, float32"),
    (["--device", "tpu"], "--device='tpu' is not allowed: auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device='cuda:x' is not allowed"),
    (["--peer", "xx"], "--peer 'xx': one of none, hf"),
    (["--peer-batch", "0"], "--peer-batch must be >= 1"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    ([*EMBEDDINGS, "--dtype", "fp64"], "--dtype='fp64' is not allowed"),
    ([*EMBEDDINGS, "--device", "tpu"], "--device='tpu' is not allowed"),
])
def test_bench_bad_values_are_one_error_line_before_any_model(args, needle):
    """Refused by flag as `run` refuses them, not a torch traceback or silently ignored."""
    result = CliRunner().invoke(app, ["bench", "--tiny", "--requests", "1", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "Traceback" not in result.output and result.output.count("error:") == 1


def test_bench_embeddings_takes_runs_dtype_spellings():
    result = CliRunner().invoke(app, ["bench", *EMBEDDINGS, "--tiny", "--device", "cpu",
                                      "--dtype", "fp32", "--requests", "1", "--input-len", "4",
                                      "--peer-batch", "1"])
    assert result.exit_code == 0 and "(torch.float32)" in result.output, result.output


def test_validate_says_to_move_body_fields_written_beside_body_into_it(tmp_path):
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "max_tokens": 5, "colour": "red",
             "body": {"messages": [{"role": "user", "content": "hi"}]}},
            {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "dimensions": 8,
             "body": {"input": "hi"}}]
    result = CliRunner().invoke(app, ["validate", "-i", str(write_jsonl(tmp_path / "in.jsonl",
                                                                          rows))])
    out = result.output
    assert result.exit_code == 0, out
    assert ("line 1: warning: field 'max_tokens' is outside \"body\", where it is ignored: "
            "move it into \"body\"") in out
    assert "line 1: warning: unknown field 'colour': it is ignored" in out
    assert "line 2: warning: field 'dimensions' is outside \"body\"" in out
    assert "checked without the model: what needs its tokenizer" in out  # validate passed it


def test_validate_warns_about_unknown_fields_with_the_closest_known_one(tmp_path):
    rows = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_token": 5,
                  "model": "m"}},
        {"custom_id": "b", "prompt": "hi", "temprature": 0.5},
        {"custom_id": "c", "prompt": "hi", "max_completion_token": 9, "colour": "red"},
        {"custom_id": "d", "messages": "not a list"},
        {"custom_id": "e", "prompt": "fine", "max_tokens": 3},
        {"custom_id": "f", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": ["x", "y"], "encoding_format": "base64", "dimensions": 8,
                  "model": "m", "max_tokens": 4}},
        {"custom_id": "g", "input": ["first passage", "second"], "dimension": 8},
    ]
    result = CliRunner().invoke(app, ["validate", "-i", str(write_jsonl(tmp_path / "in.jsonl",
                                                                          rows))])
    out = result.output
    assert result.exit_code == 1
    assert "line 1: warning: unknown field body.'max_token': did you mean 'max_tokens'?" in out
    assert "line 2: warning: unknown field 'temprature': did you mean 'temperature'?" in out
    assert "'max_completion_token': did you mean 'max_completion_tokens'?" in out
    assert "'colour': it is ignored" in out and "'model'" not in out  # an OpenAI field
    assert "line 6: warning: unknown field body.'max_tokens'" in out  # not on an embedding
    assert "line 7: warning: unknown field 'dimension': did you mean 'dimensions'?" in out
    assert "field 'input'" not in out and "body.'input'" not in out
    assert "'dimensions':" not in out and "'encoding_format'" not in out
    assert "7 requests: 6 valid, 1 invalid (1 invalid messages); 5 lines with unknown " \
           "fields" in out
    assert "{" not in out.splitlines()[-2]  # counts as words, not a dict


@pytest.mark.parametrize("name,meant", [
    ("topP", "top_p"), ("maxTokens", "max_tokens"), ("frequencyPenalty", "frequency_penalty"),
    ("stop_sequences", "stop"), ("stopSequences", "stop"), ("max_new_tokens", "max_tokens"),
    ("maxOutputTokens", "max_tokens"), ("num_return_sequences", "n"), ("candidateCount", "n"),
    ("random_seed", "seed"), ("TOP_P", "top_p"),
])
def test_other_apis_names_of_sampling_fields_hint_the_field_meant(name, meant):
    """camelCase spellings and other APIs' names (Gemini's topP, Anthropic's stop_sequences,
    Hugging Face's num_return_sequences) are hinted as the field they mean, never as a field
    merely spelled alike (topP was "did you mean 'stop'?")."""
    from batchgen.io.field_hints import unknown_fields

    assert unknown_fields({"prompt": "hi", name: 1}) == [
        f"unknown field {name!r}: did you mean {meant!r}?"]


def test_job_state_goes_beside_the_output_or_in_the_user_state_folder(tmp_path, monkeypatch):
    out = tmp_path / "results" / "r.jsonl"
    assert StorageConfig(input="x", output=str(out)).storage_path == str(
        tmp_path / "results" / ".batchgen")
    monkeypatch.delenv("BATCHGEN_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert StorageConfig(input="x").storage_path == str(tmp_path / "state" / "batchgen")
    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path / "mine"))
    assert default_storage_path(None) == str(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)  # never relative to the working directory
    assert Path(default_storage_path("r.jsonl")).is_absolute()
    assert StorageConfig(input="x", storage_path="given").storage_path == "given"


def test_run_summary_names_time_counts_tokens_speed_and_places(tmp_path):
    text = run_summary(125.0, 7, 1, 1234, 5000, 2500, tmp_path / "o.jsonl",
                       tmp_path / "o.errors.jsonl", tmp_path / ".batchgen")
    assert "done: 7 results, 1 errors (8 requests) in 2 min 05 s" in text
    assert "1,234 in, 5,000 out (20.0 out tok/s this run)" in text
    assert f"results: {tmp_path / 'o.jsonl'}" in text and "o.errors.jsonl" in text
    assert "batchgen status" in text
    cached = run_summary(125.0, 7, 1, 1234, 5000, 2500, tmp_path / "o.jsonl",
                         tmp_path / "o.errors.jsonl", tmp_path / ".batchgen", cached_tokens=617)
    assert "1,234 in (617 of them cached, 50%), 5,000 out" in cached


def test_run_summary_of_a_resume_says_what_this_run_did(tmp_path):
    """A resumed run's time and speed are its own; its counts and tokens are the job's: the
    summary says how many requests this run answered, so 19,990 requests "in 1 min 16 s" at
    213 tok/s does not read as the whole job's pace."""
    text = run_summary(76.0, 19955, 35, 1897493, 29978, 16188, tmp_path / "o.jsonl",
                       tmp_path / "o.errors.jsonl", tmp_path / ".batchgen", run_answered=10705)
    assert ("done: 19,955 results, 35 errors (19,990 requests: 10,705 answered by this run in "
            "1 min 16 s, 9,285 saved by earlier runs)") in text
    assert "29,978 out (all runs; this run 16,188 out, 213.0 out tok/s)" in text
    whole = run_summary(76.0, 19955, 35, 1, 2, 2, tmp_path / "o.jsonl",
                        tmp_path / "o.errors.jsonl", tmp_path / ".batchgen", run_answered=19990)
    assert "(19,990 requests) in 1 min 16 s" in whole and "earlier" not in whole
    merged = run_summary(0.5, 3, 0, 30, 6, 0, tmp_path / "o.jsonl",
                         tmp_path / "o.errors.jsonl", tmp_path / ".batchgen", run_answered=0)
    assert "(3 requests, all saved by earlier runs: this run merged them in 0.5 s)" in merged
    assert "30 in, 6 out (all runs)" in merged


def test_run_summary_of_an_embeddings_job_gives_input_tokens_per_second(tmp_path):
    """A job that generated nothing (embeddings lines only) reads its speed in input tokens,
    as `batchgen status` does, not as "0.0 out tok/s"."""
    places = (tmp_path / "o.jsonl", tmp_path / "o.errors.jsonl", tmp_path / ".batchgen")
    text = run_summary(10.0, 40, 0, 2000, 0, 0, *places, run_tokens_in=2000)
    assert "2,000 in, 0 out (200.0 in tok/s this run)" in text
    resumed = run_summary(10.0, 40, 0, 2000, 0, 0, *places, run_answered=30, run_tokens_in=1500)
    assert "0 out (all runs; this run 1,500 in, 150.0 in tok/s)" in resumed
    mixed = run_summary(10.0, 40, 0, 2000, 50, 50, *places, run_tokens_in=2000)
    assert "(5.0 out tok/s this run)" in mixed


def test_progress_and_rank_rows_give_an_embeddings_jobs_speed_in_input_tokens():
    """Ranks that generated nothing but embedded read their speed in input tokens per second,
    not "0.0 out tok/s"; any generated token makes it output tokens again."""
    from batchgen.runner.leader.progress import speed_text

    embedding = {"prompt_tokens": 9000, "completion_tokens": 0, "input_tokens_per_s": 1520.4,
                 "output_tokens_per_s": 0.0}
    assert speed_text([embedding, embedding]) == "3,041 in tok/s"
    generating = {"prompt_tokens": 900, "completion_tokens": 40, "input_tokens_per_s": 90.0,
                  "output_tokens_per_s": 4.25}
    assert speed_text([embedding, generating]) == "4.2 out tok/s"
    assert speed_text([]) == "0.0 out tok/s"  # nothing done yet
    chat_job = {**embedding, "engine": {"admitted": 12}}  # no chat answer finished yet
    assert speed_text([chat_job]) == "0.0 out tok/s"


def test_the_plain_progress_line_says_the_share_done_and_the_time_left():
    """Without a terminal (a Slurm log) the periodic line carries what the bar shows: the
    share done and the time left at the rate since an earlier moment (requests saved by
    earlier runs are not this run's speed); none until this run answered something."""
    from batchgen.runner.leader.progress import progress_line

    line = progress_line(4000, 100_000, 0, "42 out tok/s", "22% of 131,239 prompt tokens", 120.0)
    assert line == ("progress: 4,000/100,000 requests (4.0%), 42 out tok/s, prefix cache hits "
                    "22% of 131,239 prompt tokens; about 48 min 00 s left")
    resumed = progress_line(60_000, 100_000, 50_000, "42 out tok/s", "-", 100.0)
    assert resumed.endswith("(60.0%), 42 out tok/s, prefix cache hits -; about 6 min 40 s left")
    assert progress_line(50_000, 100_000, 50_000, "0.0 out tok/s", "-", 30.0).endswith("hits -")


def test_the_time_left_leaves_the_start_up_out_once_results_come(monkeypatch, caplog, tmp_path):
    """The first line's rate counts from the start (loading the model included); later lines
    count from the first line that saw a result, so start-up does not inflate the time left."""
    from types import SimpleNamespace

    from batchgen.runner.leader import progress

    clock = iter([100.0, 130.0, 160.0, 190.0, 220.0])
    monkeypatch.setattr(progress, "time", SimpleNamespace(time=lambda: next(clock)))
    reporter = progress.ProgressReporter(tmp_path, "b", total=1000, already_done=0)  # t0 = 100
    snapshots = iter([(100, "x", "-"), (400, "x", "-"), (700, "x", "-")])

    def snapshot():
        found = next(snapshots, None)
        if found is None:
            reporter._stop_event.set()
            return (700, "x", "-")
        return found

    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)
    monkeypatch.setattr(reporter, "snapshot", snapshot)
    with caplog.at_level("INFO", logger="batchgen"):
        reporter._run_plain()
    left = [r.getMessage().rsplit("about ", 1)[1] for r in caplog.records
            if r.getMessage().startswith("progress:")]
    # 100 in the first 30 s (start-up included): 900 left at 100 / 30 s; then 300 per 30 s
    assert left[:3] == ["4 min 30 s left", "1 min 00 s left", "30.0 s left"]


def test_age_reads_as_a_person_says_it():
    assert age(3.2) == "3 s ago" and age(600) == "10 min ago" and age(7200) == "2.0 h ago"


def test_status_finds_a_job_from_its_output_and_shows_totals_and_heartbeat_age(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("")
    batches = tmp_path / ".batchgen" / "batches"
    batches.mkdir(parents=True)
    (batches / "batch_x.json").write_text(json.dumps({
        "batch_id": "batch_x", "status": "completed", "output_file": str(out),
        "errors_file": str(tmp_path / "r.errors.jsonl"),
        "request_counts": {"total": 4, "completed": 3, "failed": 1},
        "usage": {"prompt_tokens": 100, "completion_tokens": 600},
        "timings": {"runs": 2, "all_runs_seconds": 30.0},
        "throughput": {"output_tokens_per_s": 50.0},
        "health": {"last_heartbeat": time.time() - 3}}))
    (batches / "batch_other.json").write_text(json.dumps({
        "batch_id": "batch_other", "status": "completed", "output_file": "/elsewhere.jsonl"}))
    result = CliRunner().invoke(app, ["status", str(out)], env={"COLUMNS": "200"})
    text = result.output
    assert result.exit_code == 0 and "batch_x: completed" in text and "batch_other" not in text
    assert "20.0 out tok/s over 2 runs" in text and "last run drew 50.0" in text
    assert "600 out (all runs)" in text and "r.errors.jsonl" in text
    assert "3 s ago" in text or "4 s ago" in text
    os.remove(batches / "batch_x.json")
    result = CliRunner().invoke(app, ["status", str(out)])
    assert result.exit_code == 1 and "no job writes" in result.output


def test_status_of_an_embeddings_job_shows_its_input_rate():
    """A job of embeddings lines generates no token: its speed is input tokens a second, not
    "0.0 out tok/s"."""
    from batchgen.runner.leader.status import _speed

    state = {"usage": {"prompt_tokens": 6000, "completion_tokens": 0},
             "timings": {"runs": 1, "all_runs_seconds": 30.0},
             "throughput": {"output_tokens_per_s": 0.0}}
    assert _speed(state) == "200.0 in tok/s over 1 run (30.0 s)"
    state["usage"]["completion_tokens"] = 300
    speed = _speed(state)
    assert speed.startswith("10.0 out tok/s over 1 run") and "last run drew 0.0" in speed


def test_status_of_a_chat_job_stopped_before_its_first_answer_gives_output_tokens():
    """A chat job whose only finished lines are embeddings (stopped before its first chat
    answer) generated no token yet, but its engine admitted requests: its speed stays in
    output tokens, not "in tok/s" as if it were an embeddings job."""
    from batchgen.runner.leader.status import _speed

    state = {"usage": {"prompt_tokens": 199, "completion_tokens": 0},
             "timings": {"runs": 1, "all_runs_seconds": 18.4},
             "throughput": {"output_tokens_per_s": 35.0},
             "counters": {"admitted": 43, "generated_tokens": 644}}
    assert _speed(state) == ("0.0 out tok/s over 1 run (18.4 s); last run drew 35.0 out tok/s "
                            "(its unsaved answers' tokens included)")


def test_run_summary_leaves_checkpointed_tokens_out_of_the_speed(tmp_path):
    """Tokens continued from an in-flight checkpoint were drawn by an earlier run: the summary
    says how many there are and counts only the rest in this run's tokens a second."""
    places = (tmp_path / "o.jsonl", tmp_path / "o.errors.jsonl", tmp_path / ".batchgen")
    resumed = run_summary(40.0, 48, 0, 18543, 4665, 4625, *places, run_answered=42,
                          run_tokens_resumed=1225)
    assert ("4,665 out (all runs; this run 4,625 out, 1,225 of them continued from a "
            "checkpoint, 85.0 out tok/s)") in resumed
    whole = run_summary(40.0, 48, 0, 18543, 4665, 4665, *places, run_tokens_resumed=1265)
    assert ("(this run 4,665 out, 1,265 of them continued from a checkpoint, 85.0 out tok/s)"
            in whole)
    fresh = run_summary(40.0, 48, 0, 18543, 4665, 4665, *places)
    assert "(116.6 out tok/s this run)" in fresh and "checkpoint" not in fresh


def test_the_batch_files_throughput_counts_the_tokens_this_run_drew(tmp_path):
    """The last run's output tokens a second count what its engines drew: not the tokens its
    answers continued from an in-flight checkpoint, but those of answers a stop left unfinished
    (a rank without engine counters counts its answers' tokens)."""
    from batchgen.runner.leader.records import drawn_tokens

    stats = [{"completion_tokens": 4625, "engine": {"generated_tokens": 3313},
              "checkpoint": {"resumed_tokens": 1312}},
             {"completion_tokens": 90, "engine": {}},
             {"completion_tokens": 0, "engine": {"generated_tokens": 644}}]
    assert drawn_tokens(stats) == 3313 + 90 + 644


def test_validate_names_each_bad_line_once(tmp_path):
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": -3}}]
    result = CliRunner().invoke(app, ["validate", "-i", str(write_jsonl(tmp_path / "in.jsonl",
                                                                          rows))])
    assert ("line 1: invalid_sampling_param: temperature must be in [0, 100], got -3"
            in result.output), result.output
    assert result.output.count("line 1:") == 1
