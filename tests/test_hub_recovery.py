"""Hub downloads as a user meets them when something is off: a connection cut mid-file, a
repo the Hub refuses, a cache folder that is a file, a folder named like the repo in the
working directory, a repo page's address given as --model, an offline run over a download
that stopped part way, a resume after the branch moved, a node whose cache is cold. Against
the loopback Hub (fake_hub.py); no test touches the network."""

from __future__ import annotations

import logging
import shutil

import pytest

from batchgen.io.jobfiles import FingerprintMismatch, check_fingerprint
from batchgen.models import hub, hub_fetch
from batchgen.models.loader import ModelNotFoundError, hub_id_meant, resolve_model
from test_hub import WEIGHTS, _sharded_repo


def _ranges(server, name: str) -> list[str | None]:
    return [r for m, p, r in server.requests if m == "GET" and p.endswith("/" + name)]


def test_a_connection_cut_mid_file_continues_in_the_same_run(fake_hub, repo_folder, tmp_path,
                                                             monkeypatch, caplog):
    """A proxy closing a long download early: the bytes so far are kept and the file is taken
    up again where it stopped, not deleted and fetched afresh on the next run. The log line
    says it continues, not "run again" (the run is not over)."""
    monkeypatch.setattr(hub_fetch, "RETRY_WAIT_S", 0.0)
    size = (repo_folder / WEIGHTS).stat().st_size
    cut = size // 3
    fake_hub.cut_after[WEIGHTS] = cut
    with caplog.at_level(logging.WARNING, logger="batchgen.hub"):
        path = resolve_model("org/tiny", cache_dir=str(tmp_path / "cache")).path
    assert (path / WEIGHTS).read_bytes() == (repo_folder / WEIGHTS).read_bytes()
    assert _ranges(fake_hub, WEIGHTS) == [None, f"bytes={cut}-"]
    assert f"was cut at {cut} of {size} bytes; continuing in 0 s (retry 1 of 3)" in caplog.text
    assert "run again" not in caplog.text


def test_a_download_cut_past_its_retries_is_continued_by_the_next_run(fake_hub, repo_folder,
                                                                      tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setattr(hub_fetch, "RETRIES", 0)
    cut = (repo_folder / WEIGHTS).stat().st_size // 2
    fake_hub.cut_after[WEIGHTS] = cut
    cache = str(tmp_path / "cache")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/tiny", cache_dir=cache)
    assert f"was cut at {cut} of" in str(err.value) and "run again" in str(err.value)
    with caplog.at_level(logging.INFO, logger="batchgen.hub"):
        path = resolve_model("org/tiny", cache_dir=cache).path
    assert "already there: continued" in caplog.text
    assert (path / WEIGHTS).read_bytes() == (repo_folder / WEIGHTS).read_bytes()
    assert _ranges(fake_hub, WEIGHTS) == [None, f"bytes={cut}-"]


def test_a_repo_the_hub_refuses_leaves_no_folder_in_the_cache(fake_hub, repo_folder, tmp_path,
                                                             monkeypatch):
    """A typo (404), a private repo (401) or a gated one (its info is public, its files are
    refused) leaves no `models--org--name` folder behind (`hf cache` calls one without
    snapshots corrupted; an offline run took an empty snapshot for a download stopped part
    way, to be finished by unsetting HF_HUB_OFFLINE)."""
    fake_hub.add("org/private", repo_folder, private_token="secret")
    fake_hub.add("org/gated", repo_folder, gated=True, granted_token="granted")
    cache = tmp_path / "cache"
    for model in ("org/absent", "org/private", "org/gated"):
        with pytest.raises(ModelNotFoundError):
            resolve_model(model, cache_dir=str(cache))
        assert not hub.repo_folder(cache, model).exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not found on disk"):
        resolve_model("org/gated", cache_dir=str(cache))


def test_a_cache_dir_that_is_a_file_is_named_with_its_fix(fake_hub, tmp_path):
    """Not a traceback (exit 1): the cache folder's fault, named with the fix (exit 5)."""
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/tiny", cache_dir=str(cache))
    message = str(err.value)
    assert f"cannot download org/tiny into the model cache {cache}: Not a directory" in message
    assert "a file stands where a folder of it should be" in message and "--cache-dir" in message


def test_a_folder_named_like_the_repo_holding_no_model_does_not_stop_the_download(
        fake_hub, tmp_path, monkeypatch, caplog):
    """`-o org/tiny/out.jsonl --model org/tiny`: the job's own output folder is not taken for
    the model (the rerun used to be refused as "a folder without config.json"); `./org/tiny`
    still means the local folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "org" / "absent").mkdir()
    cache = str(tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="batchgen.loader"):
        path = resolve_model("org/tiny", cache_dir=cache).path
    assert path.name == fake_hub.repos["org/tiny"].sha and (path / WEIGHTS).is_file()
    assert "./org/tiny is a folder without config.json, not a model" in caplog.text
    with pytest.raises(ModelNotFoundError, match="is a folder without config.json"):
        resolve_model("./org/tiny", cache_dir=cache)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/absent", cache_dir=cache)
    assert "(404)" in str(err.value) and "./org/absent here is a folder" in str(err.value)


@pytest.mark.parametrize("given, fix", [
    ("org/tiny/", "--model org/tiny ("),
    (" org/tiny", "--model org/tiny ("),
    ("https://huggingface.co/org/tiny", "--model org/tiny ("),
    ("https://huggingface.co/org/tiny/tree/v2", "--model org/tiny --revision v2 ("),
    ("https://huggingface.co/models/org/tiny/", "--model org/tiny ("),
    ("hf://org/tiny", "--model org/tiny ("),
    ("huggingface.co/org/tiny", "--model org/tiny ("),
    ("hf.co/org/tiny/tree/v2", "--model org/tiny --revision v2 ("),
    ("org/tiny@v2", "--model org/tiny --revision v2 ("),
    ("org/tiny:v2", "--model org/tiny --revision v2 ("),
])
def test_a_repo_page_address_or_a_trailing_slash_names_the_repo_id(fake_hub, tmp_path, given,
                                                                   fix):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(given, cache_dir=str(tmp_path / "cache"))
    assert f"--model {given!r} is not a Hub repo id: give {fix}" in str(err.value)
    assert "\n" not in str(err.value) and not fake_hub.requests


def test_what_is_not_a_repo_address_is_left_alone():
    for model in ("org/tiny", "a/b/c", "./org/tiny/", "name", "https://example.com/x",
                  "name@v2", "org/tiny@", "./org/tiny@v2"):
        assert hub_id_meant(model) is None, model


def test_offline_over_a_download_stopped_part_way_says_what_it_lacks(fake_hub, tiny_chat_model,
                                                                     tmp_path, monkeypatch):
    """Not "not found on disk" beside a listing of the folder that holds it: the snapshot is
    named, with the shard it lacks, and the fix."""
    halves = _sharded_repo(tiny_chat_model, tmp_path / "sharded")
    fake_hub.add("org/sharded", tmp_path / "sharded")
    cache = str(tmp_path / "cache")
    path = resolve_model("org/sharded", cache_dir=cache).path
    second = sorted(halves)[1]
    (path / second).unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/sharded", cache_dir=cache)
    message = str(err.value)
    assert f"the download in {path} is unfinished (it lacks {second})" in message
    assert "unset HF_HUB_OFFLINE to finish it" in message and "\n" not in message
    shutil.rmtree(path)  # no snapshot at all: every place searched, as before
    with pytest.raises(ModelNotFoundError, match="not found on disk.*Searched"):
        resolve_model("org/sharded", cache_dir=cache)


def test_a_resume_after_the_branch_moved_names_the_revision_that_finishes_it():
    old, new = {"model_weights": "aa@" + "1" * 40}, {"model_weights": "bb@" + "2" * 40}
    with pytest.raises(FingerprintMismatch) as err:
        check_fingerprint(old, new)
    assert f"now names Hub commit {'2' * 40}" in str(err.value)
    assert f"add --revision {'1' * 40} to finish it" in str(err.value)
    with pytest.raises(FingerprintMismatch) as err:  # a local folder's weights: no commit
        check_fingerprint({"model_weights": "aa"}, {"model_weights": "bb"})
    assert "--revision" not in str(err.value)


def test_every_node_loads_the_commit_the_job_is_pinned_to(fake_hub, repo_folder, tmp_path,
                                                          monkeypatch):
    """Node-local HF caches: the leader's cache says main is commit A (downloaded before the
    branch moved to B). A node whose cache is cold must load A, the commit the job's
    fingerprint records, not download B: before, every rank resolved --model by its branch
    in its own cache, so two nodes of one job could answer with two commits."""
    from batchgen.config import EngineConfig, JobConfig, ModelConfig, StorageConfig
    from batchgen.models.factory import model_folder
    from batchgen.runner.files.job import JobSpec
    from batchgen.runner.leader import prepare
    from job_utils import chat_rows, write_jsonl
    from test_hub import serve_v2

    repo = serve_v2(fake_hub, repo_folder, tmp_path)
    old = repo.commit("v2")[0]  # what main named when the leader's node downloaded it
    leader_cache = tmp_path / "node0"
    monkeypatch.setenv("HF_HUB_CACHE", str(leader_cache))
    resolve_model("org/tiny", revision="v2")
    (leader_cache / "models--org--tiny" / "refs" / "main").write_text(old)
    config = JobConfig(
        storage=StorageConfig(input=str(write_jsonl(tmp_path / "in.jsonl", chat_rows(2))),
                              storage_path=str(tmp_path / "s")),
        engine=EngineConfig(model=ModelConfig(model="org/tiny"))).validate()
    source, paths = prepare.identify(config)
    spec, _ = prepare.prepare(config, prepare.parse(config, source, paths), paths)
    assert spec.model_commit == old
    saved = JobSpec.load(spec.save())
    assert saved.config.engine.model.revision is None  # the flags as given (followers compare)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "node1"))  # another node, cold cache
    folder, _ = model_folder(saved.pinned().config.engine.model)
    assert folder.name == old != repo.sha


def test_a_resume_after_the_branch_moved_is_refused_before_the_download(fake_hub, repo_folder,
                                                                       tmp_path, monkeypatch):
    """On a node whose cache is cold, a resume of a job pinned to commit A after main moved to
    B is refused (exit 3, naming A) before a file of B is fetched: it used to download all of
    B's weights, then refuse. A job that decided nothing yet takes B."""
    from batchgen.config import EngineConfig, JobConfig, ModelConfig, StorageConfig
    from batchgen.io.jobfiles import FingerprintMismatch
    from batchgen.runner.leader import prepare
    from job_utils import chat_rows, write_jsonl
    from test_hub import serve_v2

    repo = serve_v2(fake_hub, repo_folder, tmp_path)
    old = repo.sha
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "node0"))
    config = JobConfig(
        storage=StorageConfig(input=str(write_jsonl(tmp_path / "in.jsonl", chat_rows(2))),
                              storage_path=str(tmp_path / "s")),
        engine=EngineConfig(model=ModelConfig(model="org/tiny"))).validate()
    source, paths = prepare.identify(config)
    prepare.prepare(config, prepare.parse(config, source, paths), paths)
    repo.sha, repo.folder = "c" * 40, repo.revisions["v2"]  # main moved
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "node1"))  # a cold cache
    monkeypatch.setattr(prepare, "decided_something", lambda paths: True)
    before = len(fake_hub.requests)
    assert not prepare.completed_already(config, source, paths)
    with pytest.raises(FingerprintMismatch) as err:
        prepare.prepare(config, prepare.parse(config, source, paths), paths)
    message = str(err.value)
    assert f"now names Hub commit {'c' * 40}" in message and "nothing was downloaded" in message
    assert f"add --revision {old} to finish it" in message
    assert not [p for _, p, _ in fake_hub.requests[before:] if "/resolve/" in p]
    monkeypatch.setattr(prepare, "decided_something", lambda paths: False)
    spec, _ = prepare.prepare(config, prepare.parse(config, source, paths), paths)
    assert spec.model_commit == "c" * 40


def test_a_completed_job_rerun_on_a_cold_cache_downloads_nothing(fake_hub, tmp_path):
    """A job that completed, rerun where the model is not on disk (another node, a cleared
    cache; a scheduler's requeue), after its branch moved on, or offline: the job is pinned to
    the commit it answered with, which fixes its files, so the same command says the job is
    done without a request. It used to download the whole model first, and after the branch
    moved refused (exit 3) "to finish" a finished job; offline, exit 5. Another --revision
    is another request for weights: the full check runs."""
    from job_utils import batchgen, read_jsonl, write_jsonl

    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    rows = [{"custom_id": f"r{i}", "prompt": f"count {i}", "max_tokens": 3} for i in range(2)]
    job = ["run", "--input", write_jsonl(tmp_path / "a.jsonl", rows), "--storage-path",
           tmp_path / "s", "--output", tmp_path / "out.jsonl", "--model", "org/tiny",
           "--device", "cpu"]
    batchgen(*job, "--cache-dir", tmp_path / "warm", env=env, check=True)
    answers = (tmp_path / "out.jsonl").read_bytes()
    repo = fake_hub.repos["org/tiny"]
    recorded = repo.sha
    before = len(fake_hub.requests)
    rerun = batchgen(*job, "--cache-dir", tmp_path / "cold", env=env, check=True)
    assert "already completed" in rerun.stderr
    repo.sha = "c" * 40  # main moved on
    moved = batchgen(*job, "--cache-dir", tmp_path / "cold", env=env, check=True)
    assert "already completed" in moved.stderr
    offline = batchgen(*job, "--cache-dir", tmp_path / "cold",
                       env={**env, "HF_HUB_OFFLINE": "1"}, check=True)
    assert "already completed" in offline.stderr
    pinned = batchgen(*job, "--cache-dir", tmp_path / "cold", "--revision", recorded,
                      env=env, check=True)
    assert "already completed" in pinned.stderr
    assert len(fake_hub.requests) == before  # no request at all
    assert not (tmp_path / "cold" / "models--org--tiny" / "snapshots").exists()
    assert (tmp_path / "out.jsonl").read_bytes() == answers
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2
    other = batchgen(*job, "--cache-dir", tmp_path / "cold", "--revision", "v9", env=env)
    assert other.returncode == 5 and "already completed" not in other.stderr  # no such revision


def test_the_embedded_models_name_as_model_says_to_leave_the_flag_out(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    for given in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(ModelNotFoundError) as err:
            resolve_model(given)
        assert str(err.value).endswith("The embedded default model, SmolLM2-135M-Instruct, "
                                       "needs no --model: leave the flag out.")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("SmolLM2-360M-Instruct")
    assert "embedded default" not in str(err.value)
