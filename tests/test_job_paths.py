"""Where a job writes: unusable paths fail before anything is written (exit 2), a shared
incremental folder never hands a job the results of one with other settings, and a finished
job whose final files were cut or deleted afterwards merges them again."""

import json
import os
import stat
import time
from pathlib import Path

import pytest

from batchgen.config import ConfigError, JobConfig, StorageConfig
from batchgen.io.jobfiles import FingerprintMismatch, JobPaths
from batchgen.runner.files.job_dirs import claim_incremental, make_job_dirs
from job_utils import batchgen, chat_rows, read_jsonl, start, write_jsonl


def _setup(tmp_path, output=None, incremental=None, storage="s"):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    config = JobConfig(storage=StorageConfig(input=str(inp), storage_path=str(tmp_path / storage),
                                             output=output, incremental_output_dir=incremental))
    paths = JobPaths.for_job(tmp_path / storage, "batch_x", incremental, output)
    return config, paths


def beside_an_owner_record(folder: Path, name: str) -> Path:
    """`name` in a folder holding another job's incremental results (batch batch_y's)."""
    (folder / "batch_y.owner.json").write_text("{}")
    return folder / name


def holding(path: Path, text: str) -> Path:
    """`path`, written with `text` (a file of the user's, not a job's)."""
    path.write_text(text)
    return path


@pytest.mark.parametrize(("make_output", "flag", "needle"), [
    (lambda t: t / "in.jsonl", "--output", "is the input file"),
    (lambda t: t / "s" / "incremental" / "batch_x.jsonl", "--output", "incremental file"),
    (lambda t: t / "s" / "incremental" / "batch_x.rank1.jsonl", "--output", "incremental file"),
    (lambda t: (t / "d").mkdir() or t / "d", "--output", "is a folder"),
    (lambda t: (t / "f").write_text("") or t / "f" / "r.jsonl", "--output", "/f/r.jsonl' is "
     "not allowed: its folder"),
    (lambda t: t / "results.parquet", "--output", "written as JSONL"),
    (lambda t: t / "results.jsonl.gz", "--output", "not .gz"),
    (lambda t: os.mkfifo(t / "fifo.jsonl") or t / "fifo.jsonl", "--output", "not a regular file"),
    (lambda t: Path("/dev/null"), "--output", "not a regular file"),
    (lambda t: beside_an_owner_record(t, "batch_y.jsonl"), "--output",
     "another job's saved results"),
    (lambda t: beside_an_owner_record(t, "batch_y.rank1.jsonl"), "--output",
     "another job's saved results"),
    (lambda t: holding(t / "notes.jsonl", "my notes\n"), "--output",
     "does not hold batch results"),
    (lambda t: write_jsonl(t / "other.jsonl", chat_rows(1)), "--output",
     "does not hold batch results"),
    (lambda t: holding(t / "r.errors.jsonl", "keep\n").with_name("r.jsonl"), "--output",
     "r.errors.jsonl exists and does not hold batch results"),
])
def test_unusable_output_paths_are_refused_by_flag(tmp_path, make_output, flag, needle):
    output = make_output(tmp_path)
    config, paths = _setup(tmp_path, output=str(output))
    mode = output.lstat().st_mode if output.exists() else None
    with pytest.raises(ConfigError) as err:
        make_job_dirs(config, paths)
    assert err.value.flag == flag and needle in str(err.value)
    assert (output.lstat().st_mode if output.exists() else None) == mode  # left as it was


def test_folders_that_are_files_are_refused_by_flag(tmp_path):
    (tmp_path / "file").write_text("")
    config, paths = _setup(tmp_path, storage="file")
    with pytest.raises(ConfigError, match="--storage-path=.*that is a file"):
        make_job_dirs(config, paths)
    config, paths = _setup(tmp_path, incremental=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="--incremental-output-dir=.*that is a file"):
        make_job_dirs(config, paths)
    config, paths = _setup(tmp_path, incremental=str(tmp_path / "file" / "below"))
    with pytest.raises(ConfigError, match="--incremental-output-dir=.*cannot create"):
        make_job_dirs(config, paths)


@pytest.mark.parametrize("make_output,needle", [
    (lambda t: (t / "f").write_text("") or t / "f" / "r.jsonl", "/f is a file"),
    (lambda t: (t / "f").write_text("") or t / "f" / "sub" / "r.jsonl",
     "/f/sub cannot be created")])
def test_a_bad_output_folder_is_named_as_output_when_the_job_folder_is_beside_it(
        tmp_path, make_output, needle):
    """Without --storage-path the job folder is .batchgen/ beside --output: a user who gave
    only -o must not be told about a --storage-path."""
    output = make_output(tmp_path)
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    config = JobConfig(storage=StorageConfig(input=str(inp), output=str(output)))
    paths = JobPaths.for_job(config.storage.storage_path, "batch_x", None, str(output))
    with pytest.raises(ConfigError) as err:
        make_job_dirs(config, paths)
    assert err.value.flag == "--output" and needle in str(err.value), str(err.value)


def test_a_job_folder_beside_output_that_cannot_be_made_is_named_as_output(tmp_path,
                                                                           monkeypatch):
    """-o into an existing folder this user may not write (or holding a file named .batchgen):
    the results' folder exists, the job folder beside it cannot be made. The message names
    --output and the job folder, not a --storage-path the user never gave."""
    import errno

    output = tmp_path / "ro" / "r.jsonl"
    output.parent.mkdir()
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    config = JobConfig(storage=StorageConfig(input=str(inp), output=str(output)))
    paths = JobPaths.for_job(config.storage.storage_path, "batch_x", None, str(output))
    mkdir = Path.mkdir

    def refuse(self, *args, **kw):
        if self.name == ".batchgen":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return mkdir(self, *args, **kw)
    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError) as err:
        make_job_dirs(config, paths)
    assert err.value.flag == "--output", str(err.value)
    assert f"its job folder {output.parent / '.batchgen'}" in str(err.value)
    assert "cannot be created (Permission denied)" in str(err.value)
    assert "--storage-path another folder" in str(err.value)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    (output.parent / ".batchgen").write_text("")
    with pytest.raises(ConfigError, match="--output=.*is a file: move that file away"):
        make_job_dirs(config, paths)


def test_incremental_results_serve_only_jobs_with_their_fingerprint(tmp_path):
    shared = str(tmp_path / "shared")
    _, first = _setup(tmp_path, incremental=shared, storage="a")
    _, second = _setup(tmp_path, incremental=shared, storage="b")
    first.make_dirs()
    claim_incremental(first, {"seed": 1}, job_recorded=False)
    claim_incremental(first, {"seed": 1}, job_recorded=True)  # the same job resumes
    claim_incremental(second, {"seed": 1}, job_recorded=False)  # same answers: a copied folder
    for paths, recorded in ((first, True), (second, False)):
        with pytest.raises(FingerprintMismatch, match="seed.*its own --incremental-output-dir"):
            claim_incremental(paths, {"seed": 2}, job_recorded=recorded)
    first.remove_incremental()  # results removed (--no-incremental-save): the record goes too
    claim_incremental(second, {"seed": 2}, job_recorded=False)


def test_unrecorded_results_are_not_adopted(tmp_path):
    _, paths = _setup(tmp_path, incremental=str(tmp_path / "inc"))
    paths.make_dirs()
    # a job folder since deleted
    paths.incremental().write_text('{"id": "batch_req_0", "custom_id": "req-0", "response": '
                                   '{"status_code": 200, "body": {}}, "error": null}\n')
    with pytest.raises(FingerprintMismatch, match="no job under"):
        claim_incremental(paths, {"seed": 1}, job_recorded=False)


def test_two_jobs_sharing_an_incremental_folder_keep_their_own_answers(tmp_path,
                                                                      tiny_chat_model):
    shared = tmp_path / "inc"

    def run(name, rows, *extra):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        return batchgen("run", "--input", inp, "--storage-path", tmp_path / name, "--model",
                        tiny_chat_model, "--batch-id", "nightly", "--incremental-output-dir",
                        shared, *extra)

    rows = chat_rows(2, max_tokens=6)
    assert run("a", rows).returncode == 0
    other = [dict(r, messages=[{"role": "user", "content": "Something else"}]) for r in rows]
    proc = run("b", other)
    assert proc.returncode == 3 and "its own --incremental-output-dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "b" / "outputs" / "nightly.jsonl").exists()


def test_output_equal_to_input_leaves_the_input_alone(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    before = inp.read_bytes()
    proc = batchgen("run", "--input", inp, "--storage-path", tmp_path / "s", "--model",
                    tiny_chat_model, "--output", inp)
    assert proc.returncode == 2 and "is the input file" in proc.stderr
    assert "Traceback" not in proc.stderr and inp.read_bytes() == before


def test_cut_final_files_are_merged_again(tmp_path, tiny_chat_model):
    rows = chat_rows(3, max_tokens=6) + [{"custom_id": "bad", "messages": "not a list"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o" / "r.jsonl"
    args = ("run", "--input", inp, "--storage-path", tmp_path / "s", "--model",
            tiny_chat_model, "--output", out, "--save-result")
    batchgen(*args, check=True)
    results, errors = out.read_bytes(), (tmp_path / "o" / "r.errors.jsonl").read_bytes()
    kept = sorted((tmp_path / "s" / "outputs").iterdir())
    assert [p.name.endswith(".errors.jsonl") for p in kept] == [True, False]  # both copied
    out.write_bytes(results[:results.rindex(b"\n", 0, -1) + 1])  # the last line cut by hand
    (tmp_path / "o" / "r.errors.jsonl").unlink()
    proc = batchgen(*args, check=True)
    assert "already completed" not in proc.stderr
    assert out.read_bytes() == results
    assert (tmp_path / "o" / "r.errors.jsonl").read_bytes() == errors
    assert [json.loads(b)["custom_id"] for b in errors.splitlines()] == ["bad"]
    assert len(read_jsonl(out)) == 3


def test_input_deleted_before_the_worker_reads_it_is_no_crash(tmp_path, tiny_chat_model):
    """The worker cannot read the input any more: exit 2 naming the fix, no traceback, no
    crash strike against the requests; with the input back, the job resumes."""
    rows = chat_rows(2, max_tokens=6)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ("run", "--input", inp, "--storage-path", tmp_path / "s", "--model", tiny_chat_model)
    proc = start(*args)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "s").glob("logs/*/*")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker is launched: it imports torch and loads before reading
    inp.unlink()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    assert "put the input back" in stderr and "Traceback" not in stderr
    write_jsonl(inp, rows)
    assert batchgen(*args).returncode == 0
    assert len(read_jsonl(next((tmp_path / "s" / "outputs").glob("*[0-9a-f].jsonl")))) == 2


def test_the_fingerprint_records_the_dtypes_a_run_resolves(tmp_path):
    """"auto" is bfloat16 on CUDA and float32 on the CPU: a CPU job is not resumed on a GPU in
    another precision, and the dtype the CPU resolves to, given by name, resumes it."""
    from batchgen.config import EngineConfig, ModelConfig
    from batchgen.io.jobfiles import check_fingerprint
    from batchgen.runner.files.job import fingerprint
    from batchgen.runner.leader.prepare import _as_recorded_then

    def fp(device, **model):
        config = JobConfig(storage=StorageConfig(input="in.jsonl"),
                           engine=EngineConfig(model=ModelConfig(**model)))
        return config, fingerprint(config, "sha", "model", "weights", device)

    auto_cpu, on_cpu = fp("cpu")
    assert (on_cpu["dtype"], on_cpu["kv_dtype"]) == ("float32", "float32")
    assert fp("cuda")[1]["dtype"] == "bfloat16" and fp("cuda")[1]["kv_dtype"] == "bfloat16"
    assert fp("cuda", kv_dtype="fp8_e4m3fn")[1]["kv_dtype"] == "fp8_e4m3fn"
    check_fingerprint(on_cpu, fp("cpu", dtype="float32")[1])
    with pytest.raises(FingerprintMismatch, match="dtype: 'float32' -> 'bfloat16'"):
        check_fingerprint(on_cpu, fp("cuda")[1])
    # A job recorded by an earlier version ("auto" as given) resumes with the same flags.
    legacy = {**on_cpu, "dtype": "auto", "kv_dtype": "auto"}
    check_fingerprint(legacy, _as_recorded_then(legacy, fp("cuda")[1], auto_cpu))
    config, new = fp("cpu", dtype="bfloat16")
    with pytest.raises(FingerprintMismatch, match="dtype: 'auto' -> 'bfloat16'"):
        check_fingerprint(legacy, _as_recorded_then(legacy, new, config))


def test_a_changed_tool_call_parser_is_refused_on_resume():
    """The tool-call format decides forced calls' tokens (their grammar is built in it) and how
    answers are parsed: a resume with another --tool-call-parser mixed answers of two formats
    in one output (docs/reliability.md promise 5: other parse settings are refused)."""
    from batchgen.config import OutputConfig
    from batchgen.io.jobfiles import check_fingerprint
    from batchgen.runner.files.job import fingerprint

    def fp(parser):
        config = JobConfig(storage=StorageConfig(input="in.jsonl"),
                           output=OutputConfig(tool_call_parser=parser))
        return fingerprint(config, "sha", "model", "weights")

    assert "tool_call_parser" not in fp("auto")  # jobs recorded before it still resume
    check_fingerprint(fp("hermes"), fp("hermes"))
    with pytest.raises(FingerprintMismatch, match="tool_call_parser: 'hermes' -> 'llama3_json'"):
        check_fingerprint(fp("hermes"), fp("llama3_json"))


def test_the_chat_template_text_travels_in_the_job_spec(tmp_path):
    """Workers render chat lines with the text the supervisor read and fingerprinted (the
    spec carries it), not by reading --chat-template's file again."""
    from batchgen.config import JobConfig
    from batchgen.runner.files.job import JobSpec

    spec = JobSpec(JobConfig(), "b", "0" * 64, 1, 1, {"temperature": 0.5}, "{{ x }}")
    again = JobSpec.from_bytes(spec.to_bytes())
    assert again.chat_template == "{{ x }}" and again.sampling_defaults == {"temperature": 0.5}


def test_a_given_output_folder_gets_the_umask_mode_and_the_job_folder_0750(tmp_path):
    """docs/job-files.md: the job's own folders are 0750; an --output folder the job creates
    (and the parents it creates) get the umask's mode, as the user's own folders do."""
    output = tmp_path / "new" / "sub" / "r.jsonl"
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    config = JobConfig(storage=StorageConfig(input=str(inp), output=str(output)))
    paths = JobPaths.for_job(config.storage.storage_path, "batch_x", None, str(output))
    old = os.umask(0o022)
    try:
        make_job_dirs(config, paths)
    finally:
        os.umask(old)
    for folder in (tmp_path / "new", output.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
    for name in ("", "batches", "incremental", "uploads", "logs"):
        folder = output.parent / ".batchgen" / name
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750, folder
