"""Hub downloads against a Hub served on loopback (fake_hub.py): download, resume after a kill,
one download per node, errors, offline. No test touches the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.models import hub, hub_fetch
from batchgen.models.loader import ModelNotFoundError, resolve_model, weights_signature
from fake_hub import FakeHub
from job_utils import batchgen, read_jsonl, write_jsonl

WEIGHTS = "model.safetensors"


def _fetched(server: FakeHub) -> list[str]:
    return [path for method, path, _ in server.requests if method == "GET" and "/resolve/" in path]


def test_download_fetches_safetensors_config_tokenizer_only(fake_hub, repo_folder, tmp_path):
    source = resolve_model("org/tiny", cache_dir=str(tmp_path / "cache"))
    sha = fake_hub.repos["org/tiny"].sha
    assert source.path == tmp_path / "cache" / "models--org--tiny" / "snapshots" / sha
    names = sorted(p.name for p in source.path.iterdir())
    assert WEIGHTS in names and "config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith((".bin", ".pt", ".incomplete")) for n in names)
    assert not any(p.endswith((".bin", ".pt")) for p in _fetched(fake_hub))
    assert (source.path / WEIGHTS).read_bytes() == (repo_folder / WEIGHTS).read_bytes()
    assert weights_signature(source.path).endswith("@" + sha)  # the resume fingerprint pins it
    before = len(fake_hub.requests)
    assert resolve_model("org/tiny", cache_dir=str(tmp_path / "cache")).path == source.path
    assert len(fake_hub.requests) == before  # on disk: no request


def test_run_downloads_answers_and_a_second_run_makes_no_request(fake_hub, tmp_path):
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    rows = [{"custom_id": f"r{i}", "prompt": f"count {i}", "max_tokens": 3} for i in range(2)]
    args = ["--model", "org/tiny", "--cache-dir", tmp_path / "cache", "--device", "cpu"]
    first = write_jsonl(tmp_path / "a.jsonl", rows)
    proc = batchgen("run", "--input", first, "--storage-path", tmp_path / "s1",
                    "--output", tmp_path / "a.out.jsonl", *args, env=env, check=True)
    assert len(read_jsonl(tmp_path / "a.out.jsonl")) == 2
    assert "HTTP Request:" not in proc.stderr  # the HTTP client's lines stay out of the log
    assert _fetched(fake_hub)
    batch = next((tmp_path / "s1" / "batches").glob("*.json"))
    sha = fake_hub.repos["org/tiny"].sha
    assert json.loads(batch.read_text())["fingerprint"]["model_weights"].endswith("@" + sha)
    before = len(fake_hub.requests)
    second = write_jsonl(tmp_path / "b.jsonl", rows[::-1] + [{"custom_id": "x", "prompt": "y"}])
    batchgen("run", "--input", second, "--storage-path", tmp_path / "s2",
             "--output", tmp_path / "b.out.jsonl", *args, env=env, check=True)
    assert len(read_jsonl(tmp_path / "b.out.jsonl")) == 3
    assert len(fake_hub.requests) == before


def _download_process(cache: Path, url: str) -> subprocess.Popen:
    code = ("import sys; from batchgen.models.loader import resolve_model; "
            "print(resolve_model('org/tiny', sys.argv[1]).path)")
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0",
           "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, str(cache)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_killed_download_continues_where_it_stopped_and_others_wait(fake_hub, repo_folder,
                                                                    tmp_path):
    size = (repo_folder / WEIGHTS).stat().st_size
    cut = size // 2
    fake_hub.stall_after[WEIGHTS] = cut
    cache = tmp_path / "cache"
    sha = fake_hub.repos["org/tiny"].sha
    partial = cache / "models--org--tiny" / "snapshots" / sha / (WEIGHTS + ".incomplete")
    first = _download_process(cache, fake_hub.url)
    _wait(lambda: partial.is_file() and partial.stat().st_size == cut)
    # A second process (another rank of the node) waits for the lock: no request of its own.
    second = _download_process(cache, fake_hub.url)
    time.sleep(3.0)
    seen = len(fake_hub.requests)
    assert second.poll() is None
    first.kill()
    first.wait()
    assert hub.cached_snapshot(cache, "org/tiny", None) is None  # half-downloaded: not a model
    fake_hub.release()
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert Path(out.strip()).name == sha
    ranges = [r for m, p, r in fake_hub.requests[seen:] if p.endswith(WEIGHTS) and m == "GET"]
    assert ranges == [f"bytes={cut}-"]  # continued, not started over
    done = partial.with_name(WEIGHTS)
    assert done.read_bytes() == (repo_folder / WEIGHTS).read_bytes()
    assert not partial.exists()


def test_unknown_repo_is_one_line_404(fake_hub, tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/absent", cache_dir=str(tmp_path))
    message = str(err.value)
    assert "404" in message and "org/absent" in message and "\n" not in message


def test_private_repo_without_token_is_exit_5_one_line(fake_hub, repo_folder, tmp_path):
    fake_hub.add("org/private", repo_folder, private_token="secret")
    rows = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "x"}])
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    proc = batchgen("run", "--input", rows, "--model", "org/private", "--cache-dir",
                    tmp_path / "cache", "--storage-path", tmp_path / "s", env=env)
    assert proc.returncode == 5
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "401" in errors[0] and "HF_TOKEN" in errors[0]
    assert not _fetched(fake_hub)
    # With the token the same repo downloads, a token read from a file (its newline) too.
    os.environ["HF_TOKEN"] = " secret\n"
    try:
        assert resolve_model("org/private", str(tmp_path / "cache")).path.is_dir()
    finally:
        del os.environ["HF_TOKEN"]


def test_gated_repo_says_accept_the_licence(fake_hub, repo_folder, tmp_path, monkeypatch):
    # As on the real Hub: the repo's info is public, its files need a granted token.
    fake_hub.add("org/gated", repo_folder, gated=True, granted_token="granted")
    cache = str(tmp_path / "cache")
    for token, said in ((None, "needs a token (401)"),
                        ("not-granted", "needs access granted to this token's account (403)")):
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(ModelNotFoundError) as err:
            resolve_model("org/gated", cache_dir=cache)
        message = str(err.value)
        assert f"org/gated is gated on {fake_hub.url} and {said}" in message
        assert "accept its licence" in message and "HF_TOKEN" in message
        assert "run again" not in message  # running again changes nothing
    monkeypatch.setenv("HF_TOKEN", "granted")
    path = resolve_model("org/gated", cache_dir=cache).path
    assert (path / WEIGHTS).read_bytes() == (repo_folder / WEIGHTS).read_bytes()


def serve_v2(fake_hub, repo_folder, tmp_path):
    """Give org/tiny a revision v2 whose config.json differs (rms_norm_eps 1e-3); the repo."""
    other = tmp_path / "v2"
    shutil.copytree(repo_folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    repo = fake_hub.repos["org/tiny"]
    repo.revisions["v2"] = other
    return repo


def test_revision_fetches_that_commit_and_an_unknown_one_is_named(fake_hub, repo_folder,
                                                                  tmp_path):
    repo = serve_v2(fake_hub, repo_folder, tmp_path)
    cache = tmp_path / "cache"
    main = resolve_model("org/tiny", cache_dir=str(cache)).path
    v2 = resolve_model("org/tiny", cache_dir=str(cache), revision="v2").path
    sha = repo.commit("v2")[0]
    assert v2.name == sha and main.name == repo.sha
    assert (cache / "models--org--tiny" / "refs" / "v2").read_text().strip() == sha
    assert json.loads((v2 / "config.json").read_text())["rms_norm_eps"] == 1e-3
    assert json.loads((main / "config.json").read_text())["rms_norm_eps"] != 1e-3
    with pytest.raises(ModelNotFoundError, match="org/tiny has no revision 'nope'.*--revision"):
        resolve_model("org/tiny", cache_dir=str(cache), revision="nope")


def test_without_a_revision_main_is_used_not_another_cached_one(fake_hub, repo_folder,
                                                                   tmp_path):
    """A cache holding only another revision (v2, named by its ref) does not stand in for main:
    main is downloaded."""
    repo = serve_v2(fake_hub, repo_folder, tmp_path)
    cache = str(tmp_path / "cache")
    v2 = resolve_model("org/tiny", cache_dir=cache, revision="v2").path
    main = resolve_model("org/tiny", cache_dir=cache).path
    assert main.name == repo.sha != v2.name
    assert json.loads((main / "config.json").read_text())["rms_norm_eps"] != 1e-3


def test_a_snapshot_another_tool_left_partial_is_completed(fake_hub, tmp_path):
    """A snapshot folder holding only config.json (what transformers' AutoConfig leaves) is not
    a model: the rest is downloaded into it."""
    repo = fake_hub.repos["org/tiny"]
    folder = tmp_path / "cache" / "models--org--tiny"
    (folder / "snapshots" / repo.sha).mkdir(parents=True)
    shutil.copy(repo.folder / "config.json", folder / "snapshots" / repo.sha / "config.json")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(repo.sha)
    path = resolve_model("org/tiny", cache_dir=str(tmp_path / "cache")).path
    assert path == folder / "snapshots" / repo.sha and (path / WEIGHTS).is_file()
    assert any(p.endswith(WEIGHTS) for p in _fetched(fake_hub))


def test_offline_uses_the_warm_cache_and_names_every_place_when_cold(fake_hub, tmp_path,
                                                                     monkeypatch):
    cache = str(tmp_path / "cache")
    fake_hub.repos["org/tiny"].revisions["v1"] = fake_hub.repos["org/tiny"].folder
    path = resolve_model("org/tiny", cache_dir=cache, revision="v1").path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake_hub.requests)
    assert resolve_model("org/tiny", cache_dir=cache, revision="v1").path == path
    assert len(fake_hub.requests) == before
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/tiny", cache_dir=cache, revision="v2")
    assert "HF_HUB_OFFLINE" in str(err.value) and cache in str(err.value)
    assert "at revision 'v2'" in str(err.value)
    assert len(fake_hub.requests) == before


@pytest.mark.parametrize("env, where", [
    ({"XDG_CACHE_HOME": "xdg"}, "xdg/huggingface/hub"),
    ({"XDG_CACHE_HOME": "xdg", "HF_HOME": "home"}, "home/hub"),
    ({"HUGGINGFACE_HUB_CACHE": "legacy", "HF_HOME": "home"}, "legacy"),
    ({"HF_HUB_CACHE": "hub", "HUGGINGFACE_HUB_CACHE": "legacy"}, "hub"),
])
def test_the_default_cache_is_where_huggingface_hub_puts_models(tmp_path, monkeypatch, env,
                                                                where):
    """A model `hf download` (or transformers) fetched is found there, also offline, and a
    download goes there: not to ~/.cache when XDG_CACHE_HOME moved the HF cache."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    assert hub.default_cache() == tmp_path / where
    probe = ("import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)")
    theirs = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True, env={**os.environ}).stdout.strip()
    assert Path(theirs) == hub.default_cache()


def test_not_enough_disk_space_fails_before_the_first_byte(fake_hub, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(ModelNotFoundError, match="not enough disk space"):
        resolve_model("org/tiny", cache_dir=str(tmp_path))
    assert not _fetched(fake_hub)


def test_a_repo_without_safetensors_is_refused(fake_hub, tmp_path):
    """Pickled weights only; a sentence-transformers Dense module's safetensors beside them are
    not the model's weights."""
    folder = tmp_path / "pickled"
    (folder / "2_Dense").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"x")
    (folder / "2_Dense" / "model.safetensors").write_bytes(b"x")
    fake_hub.add("org/pickled", folder)
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        resolve_model("org/pickled", cache_dir=str(tmp_path / "cache"))
    assert not _fetched(fake_hub)


def test_a_gguf_repo_names_the_file_to_download_and_give_as_a_path(fake_hub, tmp_path):
    """A GGUF-only repo (one file per quantization): batchgen loads a .gguf given as a path,
    so the refusal says that, naming a file, instead of "never loads pickled files"."""
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "README.md").write_text("x")
    for quant in ("Q4_K_M", "Q8_0"):
        (folder / f"tiny-{quant}.gguf").write_bytes(b"GGUF")
    fake_hub.add("org/tiny-GGUF", folder)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/tiny-GGUF", cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    assert "holds GGUF files (tiny-Q4_K_M.gguf, tiny-Q8_0.gguf)" in message
    assert "hf download org/tiny-GGUF tiny-Q4_K_M.gguf --local-dir DIR" in message
    assert "pickled" not in message and "\n" not in message
    assert not _fetched(fake_hub)


def _sharded_repo(tiny_chat_model, folder: Path) -> dict[str, list[str]]:
    """`folder`: the tiny model with its weights in two shards and an index; shard -> names."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_chat_model / name, folder)
    tensors = load_file(str(tiny_chat_model / WEIGHTS))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in halves.items() for n in part}}))
    return halves


def test_weights_the_index_does_not_name_are_not_downloaded(fake_hub, tiny_chat_model, tmp_path,
                                                            caplog):
    """A sharded repo with another copy of its weights beside the shards (a merged or a
    quantized file the index does not name): only the index's shards are fetched, as the loader
    reads only those (and transformers fetches only those). A first download is not called a
    continued one (the index, fetched first, was counted as bytes already there)."""
    folder = tmp_path / "sharded"
    halves = _sharded_repo(tiny_chat_model, folder)
    shutil.copy(tiny_chat_model / WEIGHTS, folder / "model-merged.safetensors")
    fake_hub.add("org/sharded", folder)
    with caplog.at_level("INFO"):
        source = resolve_model("org/sharded", cache_dir=str(tmp_path / "cache"))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("downloading")]
    assert len(said) == 1 and "continued" not in said[0], said
    fetched = [p.rsplit("/", 1)[-1] for p in _fetched(fake_hub)]
    assert "model-merged.safetensors" not in fetched
    assert set(halves) <= set(fetched)
    assert not (source.path / "model-merged.safetensors").exists()
    assert sorted(p.name for p in source.path.glob("*.safetensors")) == sorted(halves)


def test_a_snapshot_left_between_shards_is_completed(fake_hub, tiny_chat_model, tmp_path):
    """A cached snapshot holding the index and only its first shard (what a download by another
    tool, killed between shards, leaves) is not a model: the missing shard is downloaded, and
    only it (the loader would otherwise refuse the folder on every run)."""
    repo = tmp_path / "sharded"
    halves = _sharded_repo(tiny_chat_model, repo)
    sha = fake_hub.add("org/sharded", repo).sha
    folder = tmp_path / "cache" / "models--org--sharded"
    snapshot = folder / "snapshots" / sha
    snapshot.mkdir(parents=True)
    first, second = sorted(halves)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", hub.INDEX, first):
        shutil.copy(repo / name, snapshot)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(sha)
    assert resolve_model("org/sharded", cache_dir=str(tmp_path / "cache")).path == snapshot
    assert (snapshot / second).read_bytes() == (repo / second).read_bytes()
    assert [p.rsplit("/", 1)[-1] for p in _fetched(fake_hub)] == [second]


@pytest.mark.parametrize("fault, said", [
    ("mkdir", "Read-only file system"),  # a shared, read-only HF cache
    ("write", "No space left on device"),  # the disk filled up during the download
])
def test_a_cache_that_cannot_take_the_download_is_named(fake_hub, tmp_path, monkeypatch, fault,
                                                        said):
    """The model cache, not the job's files nor the network, is named with its fix (exit 5 as
    a ModelNotFoundError): an OSError here used to read as "could not write the job's files"
    (exit 6), or as a cut download to run again."""
    import errno as errnos

    cache = tmp_path / "cache"
    if fault == "mkdir":
        mkdir = Path.mkdir

        def refuse(self, *args, **kw):
            if self.is_relative_to(cache):
                raise OSError(errnos.EROFS, os.strerror(errnos.EROFS), str(self))
            return mkdir(self, *args, **kw)
        monkeypatch.setattr(Path, "mkdir", refuse)
    else:
        class Full:
            def __init__(self, *args):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def write(self, data):
                raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC))
        monkeypatch.setattr(hub_fetch, "open", Full, raising=False)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/tiny", cache_dir=str(cache))
    message = str(err.value)
    assert f"cannot download org/tiny into the model cache {cache}: {said}" in message
    assert "--cache-dir" in message and "\n" not in message


def test_only_top_level_weights_and_no_duplicate_mistral_layout():
    files = [hub.RepoFile(p, 1) for p in (
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "consolidated.safetensors", "original/params.json",
        "original/model.safetensors", "onnx/model.onnx", "pytorch_model.bin", "README.md",
        "tokenizer.json", "tokenizer.model", "1_Pooling/config.json", "modules.json",
        "2_Dense/model.safetensors", "2_Dense/pytorch_model.bin")]
    assert [f.path for f in hub.select(files)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer.model",
        "1_Pooling/config.json", "modules.json", "2_Dense/model.safetensors"]
    assert [f.path for f in hub.select([hub.RepoFile("consolidated.safetensors", 1)])] == [
        "consolidated.safetensors"]
    # No index: model.safetensors is the model; an adapter beside it is not fetched.
    assert [f.path for f in hub.select([hub.RepoFile(p, 1) for p in (
        "model.safetensors", "adapter_model.safetensors", "config.json")])] == [
        "model.safetensors", "config.json"]


def test_redirects_to_another_host_drop_the_token():
    import urllib.request

    handler = hub_fetch._SameHostAuth()
    req = urllib.request.Request("http://hub.example/a", headers={"Authorization": "Bearer t",
                                                                    "Range": "bytes=5-"})
    other = handler.redirect_request(req, None, 302, "Found", {}, "http://cdn.example/blob")
    assert other.get_header("Authorization") is None and other.get_header("Range") == "bytes=5-"
    same = handler.redirect_request(req, None, 302, "Found", {}, "http://hub.example/b")
    assert same.get_header("Authorization") == "Bearer t"


def test_a_resume_is_pinned_to_the_commit(tmp_path):
    """The same files under another commit sign differently, so a resume after the branch
    moved is refused (the fingerprint's model_weights); a plain folder signs without one."""
    signatures = []
    for sha in ("a" * 40, "b" * 40):
        snapshot = tmp_path / "models--org--x" / "snapshots" / sha
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        signatures.append(weights_signature(snapshot))
    assert signatures[0].endswith("@" + "a" * 40) and signatures[1].endswith("@" + "b" * 40)
    assert signatures[0].split("@")[0] == signatures[1].split("@")[0]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert weights_signature(plain) == signatures[0].split("@")[0]


def test_a_download_logs_its_progress_where_stderr_is_not_a_terminal(fake_hub, tmp_path,
                                                                      caplog):
    """Under Slurm or nohup stderr is a file: progress comes as log lines, not a tqdm bar."""
    import logging

    with caplog.at_level(logging.INFO, logger="batchgen.hub"):
        resolve_model("org/tiny", cache_dir=str(tmp_path / "cache"))
        lines = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("download:")]
        assert lines and "(100%)" in lines[-1] and "MB/s" in lines[-1]
        progress = hub.LoggedProgress(total=10, initial=0, every_s=0.0)
        progress.update(4)  # past its interval: a line now
        assert "0.00 of 0.00 GB (40%)" in caplog.records[-1].getMessage()
        slow = hub.LoggedProgress(total=int(2e9), initial=0, every_s=1e9)
        slow.started -= 100  # 100 s for 30 MB: 0.3 MB/s, not "0 MB/s"; the rest takes hours
        slow.update(int(30e6))
        slow._say()
        said = caplog.records[-1].getMessage()
        assert "0.3 MB/s, about 1 h 49 min left" in said, said


def test_a_revision_with_a_local_folder_is_named_as_ignored(tiny_chat_model, caplog, tmp_path):
    """--revision picks a Hub commit; with --model naming a local folder it cannot apply,
    and the job's log says so, once, instead of letting the user believe that commit
    answered."""
    from batchgen.config import EngineConfig, JobConfig, ModelConfig, StorageConfig
    from batchgen.runner.leader import prepare

    source = resolve_model(str(tiny_chat_model), revision="v2")
    assert source.path == Path(tiny_chat_model) and source.revision_ignored
    assert not resolve_model(str(tiny_chat_model)).revision_ignored
    config = JobConfig(
        storage=StorageConfig(input=str(tmp_path / "in.jsonl"), storage_path=str(tmp_path)),
        engine=EngineConfig(model=ModelConfig(model=str(tiny_chat_model), revision="v2")))
    with caplog.at_level("WARNING", logger="batchgen.job"):
        prepare.model_weights(config, quiet=True)
        assert "ignored" not in caplog.text
        prepare.model_weights(config)
    assert caplog.text.count("--revision v2 is ignored") == 1


def test_a_network_error_is_never_blamed_on_the_cache(tmp_path):
    """A TLS failure's errno is 1 (EPERM's): it is a cut download, not a cache folder this
    user may not write. An index naming no shard is no complete snapshot."""
    import errno
    import ssl

    assert not hub.cache_fault(ssl.SSLError(1, "decryption failed or bad record mac"))
    assert not hub.cache_fault(ConnectionResetError(errno.EPERM, "reset"))
    assert hub.cache_fault(OSError(errno.EROFS, "Read-only file system"))
    assert hub.cache_fault(PermissionError(errno.EACCES, "Permission denied"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / hub.INDEX).write_text('{"weight_map": {}}')
    assert not hub._complete(tmp_path)
