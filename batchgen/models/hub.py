"""Download a model from the Hugging Face Hub into the HF cache layout, once per node.

What is fetched: safetensors weights, config, tokenizer, generation and sentence-transformers
files only (ALLOWED); pickled formats (`*.bin`, `*.pt`, ...) never are. The repo's file metadata
(sizes) comes from `huggingface_hub` (`HfApi.model_info`, which also classifies 401/403/404);
the files are written as `{cache}/models--org--name/snapshots/{commit}/{file}` and `refs/{rev}`
names the commit, so the loader and transformers find them like any cached model.

Files are fetched with HTTP Range requests (hub_fetch.py): a download killed mid-file
continues where it stopped (the bytes so far sit in `{file}.incomplete`), and a connection cut
mid-file is taken up again with a Range request (RETRIES times) before the run gives up. A
snapshot folder holding INCOMPLETE is being downloaded and is never loaded. One process per
cache folder downloads (a file lock under `{cache}/.locks/`, where huggingface_hub keeps its
own, so a repo the Hub refuses leaves no folder behind); the others wait for it and then find
the files on disk.

Progress: a tqdm bar on a terminal; where stderr is a file or a pipe (Slurm, nohup), a log line
every 30 s and at the end (bytes so far, share, rate): hub_progress.py.

Environment: HF_ENDPOINT (the Hub's address), HF_TOKEN (or a saved `hf auth login`),
HF_HUB_OFFLINE=1 (nothing is downloaded; `offline()`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from pathlib import Path

from batchgen.models.hub_fetch import (CACHE_ERRNOS, CutDownload, HubError,  # noqa: F401
                                       RepoFile, cache_fault, endpoint, fetch_retrying,
                                       token)
from batchgen.models.hub_progress import LoggedProgress, progress  # noqa: F401

log = logging.getLogger("batchgen.hub")
ALLOWED = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
           "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
           "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
           "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
           "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
           "*_Pooling/config.json", "*_Dense/config.json", "*_Dense/model.safetensors")
"""Repo files fetched (fnmatch patterns over the path in the repo)."""
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".h5", ".msgpack", ".joblib")
INCOMPLETE = ".batchgen-incomplete"
"""Marker file inside a snapshot folder while its download is unfinished."""
HUB_ID = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."
class CommitMoved(Exception):
    """The revision to download names another commit than the one a resumed job is pinned to
    (its branch moved): raised before any file is fetched, for the caller to refuse the resume
    (a download of the other commit's weights would only be refused after it)."""

    def __init__(self, repo: str, revision: str, commit: str, pinned: str):
        super().__init__(f"{repo}@{revision} now names commit {commit}, not {pinned}")
        self.repo, self.revision, self.commit, self.pinned = repo, revision, commit, pinned


def is_hub_id(model: str) -> bool:
    """`org/name` as the Hub spells repo ids (a local path never reaches here if it exists)."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and all(set(p) <= set(HUB_ID) for p in parts)
            and not any(p.startswith(".") for p in parts))


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def default_cache() -> Path:
    """The HF cache as huggingface_hub (and transformers, `hf download`) find it: HF_HUB_CACHE,
    else the legacy HUGGINGFACE_HUB_CACHE, else `hub/` under HF_HOME, else under
    `$XDG_CACHE_HOME/huggingface` (`~/.cache/huggingface`). Read at each call (not at import,
    as huggingface_hub.constants does), so a test or a wrapper may set them late."""
    env = os.environ
    xdg = env.get("XDG_CACHE_HOME") or "~/.cache"
    hf_home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    cache = (env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
             or os.path.join(hf_home, "hub"))
    return Path(os.path.expandvars(cache)).expanduser()


def repo_folder(root: Path, repo: str) -> Path:
    return root / ("models--" + repo.replace("/", "--"))


def cached_snapshot(root: Path, repo: str, revision: str | None) -> Path | None:
    """The complete snapshot of `repo` at `revision` (a branch, tag or commit; default: main)
    under the HF cache `root`, or None. Without a revision and without refs (a cache filled by
    commit), the only snapshot. Complete: config.json and safetensors weights, none still
    downloading (a snapshot where another tool fetched only the config is not one)."""
    return next((p for p in _snapshot_candidates(root, repo, revision) if _complete(p)), None)


def unfinished_snapshot(root: Path, repo: str,
                        revision: str | None) -> tuple[Path, list[str]] | None:
    """(the snapshot `cached_snapshot` would take, the files it lacks) where that snapshot is
    there but not complete (a download stopped part way); else None."""
    for path in _snapshot_candidates(root, repo, revision):
        if path.is_dir() and not _complete(path):
            return path, lacking(path)
    return None


def _snapshot_candidates(root: Path, repo: str, revision: str | None) -> list[Path]:
    folder = repo_folder(root, repo)
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return []
    rev = revision or "main"
    ref = folder / "refs" / rev
    candidates = [snapshots / ref.read_text().strip()] if ref.is_file() else []
    candidates.append(snapshots / rev)
    refs = folder / "refs"
    if revision is None and not (refs.is_dir() and any(refs.iterdir())):
        found = [p for p in snapshots.iterdir() if p.is_dir()]
        candidates += found if len(found) == 1 else []
    return candidates


def lacking(snapshot: Path) -> list[str]:
    """The files an incomplete snapshot still needs (`_complete`), the partly fetched ones
    among them."""
    names = ["config.json"]
    if (snapshot / INDEX).is_file():
        try:
            names += index_shards(snapshot / INDEX)
        except INDEX_ERRORS:
            pass
    elif not any(snapshot.glob("*.safetensors")):
        names.append("*.safetensors")
    names += [p.name.removesuffix(".incomplete") for p in snapshot.glob("*.incomplete")]
    return [n for n in dict.fromkeys(names) if not (snapshot / n).is_file()]


def _complete(snapshot: Path) -> bool:
    """config.json and the weights: every shard the safetensors index names (a download
    another tool left between shards is not complete), else some *.safetensors."""
    if not snapshot.is_dir() or (snapshot / INCOMPLETE).exists() \
            or not (snapshot / "config.json").is_file():
        return False
    if (snapshot / INDEX).is_file():
        try:
            shards = index_shards(snapshot / INDEX)
            return bool(shards) and all((snapshot / name).is_file() for name in shards)
        except INDEX_ERRORS:
            return True  # the loader names the damaged index
    return any(snapshot.glob("*.safetensors"))


def commit_of(folder: Path) -> str | None:
    """The commit a HF-cache snapshot folder holds, None for any other folder."""
    name = folder.name
    if folder.parent.name == "snapshots" and len(name) == 40 and \
            all(c in "0123456789abcdef" for c in name):
        return name
    return None


def wanted(path: str) -> bool:
    """Whether a repo file is fetched: ALLOWED, never pickled, and weights only at the top
    level or in a sentence-transformers module folder (not `original/`, `onnx/`, ...)."""
    if path.lower().endswith(PICKLED):
        return False
    if "/" in path and not fnmatch.fnmatchcase(path, "*_Pooling/*") \
            and not fnmatch.fnmatchcase(path, "*_Dense/*"):
        return False
    return any(fnmatch.fnmatchcase(path, p) for p in ALLOWED)


def select(paths: list[RepoFile]) -> list[RepoFile]:
    """The wanted files; Mistral's `consolidated*.safetensors` (the same weights in its own
    layout) only when the repo has no other top-level weights; without an index, a top-level
    `model.safetensors` alone (the loader reads nothing else: `loader.checkpoint_files`)."""
    files = [f for f in paths if wanted(f.path)]
    top = {f.path for f in files if f.path.endswith(".safetensors") and "/" not in f.path}
    hf_weights = any(not p.startswith("consolidated") for p in top)
    only_model = INDEX not in {f.path for f in files} and "model.safetensors" in top
    return [f for f in files if not (hf_weights and f.path.startswith("consolidated"))
            and not (only_model and f.path in top and f.path != "model.safetensors")]


def download(repo: str, revision: str | None, root: Path, pinned: str | None = None) -> Path:
    """Fetch `repo` at `revision` into the HF cache `root` (see module docstring); the snapshot
    folder. Raises HubError; CommitMoved when `pinned` is given and `revision` names another
    commit (nothing fetched)."""
    try:
        return _download(repo, revision, root, pinned)
    except OSError as err:  # the cache folder cannot take it (not the job's files, not the Hub)
        if not cache_fault(err):
            raise
        raise HubError(f"cannot download {repo} into the model cache {root}: {err.strerror} "
                       f"({err.filename or repo_folder(root, repo)}): "
                       f"{CACHE_ERRNOS[err.errno]}, or point --cache-dir (or HF_HUB_CACHE) at a "
                       "writable folder with room for the model; a rerun continues the "
                       "download") from None


def _download(repo: str, revision: str | None, root: Path, pinned: str | None) -> Path:
    from filelock import FileLock, Timeout

    folder = repo_folder(root, repo)
    locks = root / ".locks" / folder.name
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / "batchgen-download.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # another process (another rank of this node) is downloading
        log.info("another process is downloading %s into %s: waiting for it", repo, root)
        lock.acquire()
    try:
        found = cached_snapshot(root, repo, revision)  # downloaded while we waited
        if found is not None:
            return found
        return _download_locked(repo, revision or "main", root, folder, pinned)
    finally:
        lock.release()


def _download_locked(repo: str, revision: str, root: Path, folder: Path,
                     pinned: str | None) -> Path:
    commit, every = repo_files(repo, revision)
    if pinned and commit != pinned:
        raise CommitMoved(repo, revision, commit, pinned)
    files = select(every)
    if not any(f.path.endswith(".safetensors") and "/" not in f.path for f in files):
        raise HubError(no_weights(repo, revision, every))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    marker = snapshot / INCOMPLETE
    marker.touch()
    try:
        _fetch_snapshot(repo, revision, commit, files, snapshot)
    except CutDownload:
        raise  # its bytes so far stay for the next run
    except HubError:
        _drop_untouched(snapshot)
        raise
    _write_ref(folder, revision, commit)
    marker.unlink()
    return snapshot


def _fetch_snapshot(repo: str, revision: str, commit: str, files: list[RepoFile],
                    snapshot: Path) -> None:
    before = sum(_have(snapshot, f) for f in files)  # the index is fetched next
    files = indexed_weights_only(repo, commit, files, snapshot)
    check_space(snapshot, files)
    total, have = sum(f.size for f in files), sum(_have(snapshot, f) for f in files)
    log.info("downloading %s@%s (commit %s): %d files, %.2f GB into %s%s", repo, revision,
             commit, len(files), total / 1e9, snapshot,
             f" ({have / 1e9:.2f} GB of it already there: continued)" if before else "")
    with progress(total, have) as bar:
        for f in files:
            fetch_retrying(repo, commit, f, snapshot, bar)


def _drop_untouched(snapshot: Path) -> None:
    """Remove a snapshot folder that holds nothing but INCOMPLETE (a gated repo whose files
    the Hub refused, too little disk space), and its repo folder when that is left empty:
    an offline run would otherwise read it as a download stopped part way, to be finished by
    running online, and `hf cache` would list it."""
    if any(p.name != INCOMPLETE for p in snapshot.iterdir()):
        return  # a download under way: the next run continues it
    (snapshot / INCOMPLETE).unlink(missing_ok=True)
    for folder in (snapshot, snapshot.parent, snapshot.parent.parent):
        try:
            folder.rmdir()
        except OSError:
            return  # not empty: another revision, refs


INDEX = "model.safetensors.index.json"
INDEX_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)
"""What reading a damaged or foreign index raises (`index_shards`)."""


def index_shards(index: Path) -> list[str]:
    """The shard files a safetensors index names, sorted; raises one of INDEX_ERRORS when it
    is unreadable or not an index."""
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def indexed_weights_only(repo: str, commit: str, files: list[RepoFile],
                         snapshot: Path) -> list[RepoFile]:
    """`files` less the top-level weights that the repo's safetensors index does not name:
    the snapshot then holds the index's shards, which the loader reads, and another copy of
    the weights beside them (a merged `model.safetensors`, a quantized variant) is never
    fetched.
    The index itself is fetched first; without one (or unreadable) `files` are unchanged."""
    index = next((f for f in files if f.path == INDEX), None)
    if index is None:
        return files
    from tqdm.auto import tqdm

    fetch_retrying(repo, commit, index, snapshot, tqdm(total=index.size, disable=True))
    try:
        shards = set(index_shards(snapshot / INDEX))
    except INDEX_ERRORS:
        return files
    if not shards:
        return files
    return [f for f in files if "/" in f.path or not f.path.endswith(".safetensors")
            or f.path in shards]


def no_weights(repo: str, revision: str, files: list[RepoFile]) -> str:
    """Why a repo without top-level safetensors weights is not downloaded, and what to do. A
    GGUF repo's files load when given as a path, one file of them: which one is the user's
    choice (a quantization), so none is fetched."""
    ggufs = [f.path for f in files if f.path.lower().endswith(".gguf")]
    if ggufs:
        return (f"{repo}@{revision} holds GGUF files ({', '.join(ggufs[:3])}"
                f"{', ...' if len(ggufs) > 3 else ''}), not *.safetensors weights, and batchgen "
                "downloads only safetensors: download the .gguf file you want (`hf download "
                f"{repo} {ggufs[0]} --local-dir DIR`) and give its path to --model, or choose "
                "the safetensors repo it was made from")
    return (f"{repo}@{revision} has no *.safetensors weights (batchgen never loads pickled "
            "*.bin/*.pt files): convert the repo to safetensors or choose another repo")


def repo_files(repo: str, revision: str) -> tuple[str, list[RepoFile]]:
    """(commit sha, every file of the repo with its size) from the Hub's file metadata."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=token() or False)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except Exception as err:  # noqa: BLE001 - huggingface_hub's HTTP errors, connection errors
        raise HubError(explain(err, repo, revision)) from None
    return info.sha, [RepoFile(s.rfilename, int(s.size or 0)) for s in info.siblings or []]


def explain(err: Exception, repo: str, revision: str) -> str:
    """One line saying why `repo` cannot be fetched and what fixes it."""
    from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError

    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(err, RevisionNotFoundError):
        return (f"{repo} has no revision {revision!r} on {endpoint()}: give an existing branch, "
                "tag or commit to --revision")
    if isinstance(err, GatedRepoError):
        return (f"{repo} is gated on {endpoint()} ({status}): accept its licence on the repo's "
                "page, then set HF_TOKEN to a token of that account")
    if status == 404:
        return (f"model {repo!r} not found on {endpoint()} (404): check the spelling of --model, "
                "or point --model at a local folder")
    if status in (401, 403):
        said = "private or unknown" if status == 401 else "not readable with this token"
        return (f"{repo} is {said} on {endpoint()} ({status}): set HF_TOKEN to a token allowed "
                "to read it (or check the spelling of --model)")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"cannot reach {endpoint()} to download {repo}: {first}. Check the network (or "
            "HF_ENDPOINT), or download the model elsewhere and pass its folder to --model")


def _have(snapshot: Path, f: RepoFile) -> int:
    """Bytes of `f` already on disk (whole or partial)."""
    done = snapshot / f.path
    if done.is_file():
        return f.size
    partial = snapshot / (f.path + ".incomplete")
    return partial.stat().st_size if partial.is_file() else 0


def check_space(snapshot: Path, files: list[RepoFile]) -> None:
    need = sum(f.size - _have(snapshot, f) for f in files)
    free = shutil.disk_usage(snapshot).free
    if need > free:
        raise HubError(f"not enough disk space to download the model: {need / 1e9:.2f} GB "
                       f"needed, {free / 1e9:.2f} GB free under {snapshot.parent.parent}: free "
                       "space or point --cache-dir (or HF_HUB_CACHE) at a larger disk")


def _write_ref(folder: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = folder / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)
