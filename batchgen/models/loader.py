"""Find a model on disk (or download it from the Hub) and load it into our own model classes.

Sources, in the order tried: a local folder or .gguf file; under --cache-dir (the folder itself,
`models--org--name/snapshots/REV/`, `org/name`, `name`); the default HF hub cache; then, for a
Hub id (org/name) unless HF_HUB_OFFLINE is set, a download into --cache-dir or the HF cache
(hub.py). A folder `org/name` under the working directory that holds no model (a job's output
folder named after its model) does not stop a download; `./org/name` is never a Hub id.
Weights are read with safetensors only (never pickle) and `trust_remote_code` is never set.
"""

from __future__ import annotations

import hashlib
import logging
import re
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from batchgen.models import hub
from batchgen.models.errors import CheckpointError, ModelNotFoundError  # noqa: F401 (re-exported)
from batchgen.models.hf_text import text_only
from batchgen.models.registry import check_quant_method, model_class
from batchgen.models.weight_stream import StreamedWeights, stream_to_device
from batchgen.parallel import TensorParallel

log = logging.getLogger("batchgen.loader")
MANIFEST = "batchgen_manifest.json"


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """Model folder (config.json + safetensors) or a .gguf file."""
    kind: str
    """'hf', 'gguf' or 'converted'."""
    name: str
    revision_ignored: bool = False
    """--revision was given but --model named a local folder or file (no Hub snapshot): the
    job's supervisor says so once (prepare.model_weights)."""


def _hub_snapshots(root: Path, name: str, revision: str | None = None) -> list[Path]:
    found = hub.cached_snapshot(root, name, revision)
    return [found] if found is not None else []


def is_gguf(path: Path) -> bool:
    """`path` is named as a GGUF file (`.gguf`, in any case: `model.GGUF` too)."""
    return path.suffix.lower() == ".gguf"


def gguf_files(folder: Path) -> list[Path]:
    """The GGUF files directly in `folder`, by name."""
    return sorted(p for p in folder.iterdir() if is_gguf(p) and p.is_file())


def _classify(path: Path, name: str) -> ModelSource | None:
    if path.is_file() and is_gguf(path):
        return ModelSource(path, "gguf", name)
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return ModelSource(path, "converted", name)
        if (path / "config.json").is_file():
            return ModelSource(path, "hf", name)
        ggufs = gguf_files(path)
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", name)
    return None


def not_a_model_message(model: str, given: Path) -> str:
    """Why an existing path given as --model holds no model, and what to give instead: a folder
    of several .gguf files (a GGUF repo's quantizations) names them and the path of one."""
    ggufs = gguf_files(given) if given.is_dir() else []
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs[:5]) + (", ..." if len(ggufs) > 5 else "")
        return (f"--model {model!r} is a folder of {len(ggufs)} .gguf files ({names}): give "
                f"the path of the one to load, e.g. --model {ggufs[0]}")
    kind = "a folder without config.json" if given.is_dir() else "a file that is not .gguf"
    return (f"--model {model!r} is {kind}: give a folder holding config.json and "
            "*.safetensors, a folder made by `batchgen convert`, or a .gguf file")


def is_path_like(model: str) -> bool:
    """`model` is spelled as a filesystem path (`./my-model`, `../m`, `/abs/m`, `~/m`), never as a
    Hub id: it is looked for at that path (and by its last name under --cache-dir) only."""
    return model in (".", "..") or model.startswith(("/", "./", "../", "~"))


def search_places(model: str, cache_dir: str | None = None) -> list[Path]:
    """Every place `model` is looked for, in order (hub caches as their snapshots folder)."""
    hub_name = "models--" + model.replace("/", "--")
    places = [Path(model).expanduser()]
    if is_path_like(model):  # a path has no Hub cache layout
        if cache_dir:
            places.append(Path(cache_dir).expanduser() / Path(model).name)
        return list(dict.fromkeys(places))
    if cache_dir:
        root = Path(cache_dir).expanduser()
        places += [root, root / hub_name / "snapshots", root / model, root / model.split("/")[-1]]
    return list(dict.fromkeys([*places, hub.default_cache() / hub_name / "snapshots"]))


EMBEDDED_NAME = "SmolLM2-135M-Instruct"
"""The model a job runs without --model (the GGUF file the package carries)."""


def model_not_found_message(model: str, places: list[Path], revision: str | None = None) -> str:
    """What a user reads when --model is nowhere and is not downloaded: every place searched,
    why nothing was downloaded, and how to fix it."""
    searched = "\n  ".join(str(p) for p in places)
    if is_path_like(model):
        return (f"model {model!r} not found: no such file or folder "
                f"({Path(model).expanduser().absolute()})"
                + ("" if len(places) < 2 else f", nor {places[1]}") + ". Give the path of a model "
                "folder (config.json + *.safetensors), of a folder written by `batchgen convert`, "
                "or of a .gguf file.")
    hub_name = "models--" + model.replace("/", "--")
    why = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if hub.offline()
           else "not a Hub id (org/name), so nothing is downloaded")
    what = f"model {model!r}" + (f" at revision {revision!r}" if revision else "")
    if Path(model).expanduser().exists():
        what += f" (./{model} is a folder without config.json)"
    unfinished = _unfinished(model, places, revision)
    if unfinished and hub.offline():
        return (f"{what}: the download in {unfinished[0]} is unfinished (it lacks "
                f"{', '.join(unfinished[1][:3]) or 'nothing but its end'}) and HF_HUB_OFFLINE "
                "is set, so nothing is downloaded: unset HF_HUB_OFFLINE to finish it, or point "
                "--model at a complete local folder")
    embedded = (f" The embedded default model, {EMBEDDED_NAME}, needs no --model: leave the "
                "flag out." if model.split("/")[-1].lower() == EMBEDDED_NAME.lower() else "")
    return (f"{what} not found on disk ({why}). Searched:\n  {searched}\n"
            f"Point --model at a local folder or .gguf file, or --cache-dir at a folder holding "
            f"{model.split('/')[-1]}/ or {hub_name}/snapshots/<rev>/"
            + (", or unset HF_HUB_OFFLINE to download it." if hub.offline() else ".") + embedded)


def _unfinished(model: str, places: list[Path],
                revision: str | None) -> tuple[Path, list[str]] | None:
    """A download of Hub id `model` that stopped part way in one of the HF caches searched
    (`hub.unfinished_snapshot`), or None."""
    if not hub.is_hub_id(model):
        return None
    roots = [p.parent.parent for p in places if p.name == "snapshots"]
    found = (hub.unfinished_snapshot(root, model, revision) for root in roots)
    return next((f for f in found if f is not None), None)


HUB_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
"""A repo page's address given without its scheme starts with one of these."""


def hub_id_meant(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) that a --model not spelled as a Hub id means: a repo page's
    address (`https://huggingface.co/org/name`, `.../tree/REV`, also without `https://`),
    `hf://org/name`, `org/name/`, ` org/name`, or a revision written into the id
    (`org/name@REV`, `org/name:REV`, as other tools spell it). None when it means none (a
    plain id, a path)."""
    text = model.strip()
    url = urllib.parse.urlsplit(text)
    path = {"http": url.path, "https": url.path, "hf": url.netloc + url.path}.get(url.scheme, text)
    parts = [p for p in path.split("/") if p]
    parts = parts[1:] if parts[:1] and parts[0].lower() in HUB_HOSTS else parts
    parts = parts[1:] if parts[:1] == ["models"] else parts
    revision = parts[3] if len(parts) > 3 and parts[2] in ("tree", "blob", "commit") else None
    if len(parts) == 2 and revision is None:
        name, sep, suffix = parts[1].replace(":", "@", 1).partition("@")
        if sep and name and suffix:
            parts, revision = [parts[0], name], suffix
    repo = "/".join(parts[:2])
    if repo == model or not hub.is_hub_id(repo) or (len(parts) > 2 and revision is None):
        return None
    return repo, revision


def find_on_disk(model: str, cache_dir: str | None = None,
                 revision: str | None = None) -> ModelSource | None:
    """`model` where it already is on disk (the path itself, --cache-dir, the HF cache), as
    `resolve_model` takes it; None where that would download it."""
    candidates = [Path(model).expanduser()]
    snapshots: list[Path] = []
    if cache_dir:
        root = Path(cache_dir).expanduser()
        snapshots = _hub_snapshots(root, model, revision)
        candidates += [root, *snapshots, root / model, root / model.split("/")[-1]]
    default = _hub_snapshots(hub.default_cache(), model, revision)
    candidates += default
    snapshots += default
    for path in candidates:
        found = _classify(path, model)
        if found is not None:
            return replace(found, revision_ignored=bool(revision) and path not in snapshots)
    return None


def resolve_model(model: str, cache_dir: str | None = None, revision: str | None = None,
                  pinned: str | None = None) -> ModelSource:
    """Locate `model` on disk, or download a Hub id (org/name) not found there into --cache-dir
    (default: the HF cache); the error lists every place searched. `pinned`: the commit a
    resumed job started with; a download of another commit raises hub.CommitMoved before its
    first file."""
    found = find_on_disk(model, cache_dir, revision)
    if found is not None:
        return found
    hint = cache_repo_hint(model)
    if hint is not None:
        raise ModelNotFoundError(hint)
    given = Path(model).expanduser()
    if given.exists() and (is_path_like(model) or not hub.is_hub_id(model)):
        raise ModelNotFoundError(not_a_model_message(model, given))
    if hub.is_hub_id(model) and not hub.offline():
        return _download(model, cache_dir, revision, pinned)
    meant = None if is_path_like(model) else hub_id_meant(model)
    if meant is not None:
        raise ModelNotFoundError(
            f"--model {model!r} is not a Hub repo id: give --model {meant[0]}"
            + (f" --revision {meant[1]}" if meant[1] else "") + " (org/name, as the repo's "
            "page names it), or the path of a local folder")
    raise ModelNotFoundError(model_not_found_message(model, search_places(model, cache_dir),
                                                     revision))


def cache_repo_hint(model: str) -> str | None:
    """What to give instead of a --model naming an HF cache's repo folder
    (`.../models--org--name`) or its `snapshots` folder, which hold the model one or two levels
    further down (`snapshots/<commit>/`); None when it names neither."""
    given = Path(model).expanduser()
    repo_dir = given.parent if given.name == "snapshots" else given
    if not repo_dir.name.startswith("models--") or not (repo_dir / "snapshots").is_dir():
        return None
    repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
    root = repo_dir.parent
    by_id = f"--model {repo}" + ("" if root.resolve() == hub.default_cache().resolve()
                                 else f" --cache-dir {root}")
    what = f"--model {model!r} is the Hugging Face cache folder of {repo}, not a model folder"
    snapshot = hub.cached_snapshot(root, repo, None)
    if snapshot is None:
        return (f"{what}, and none of its snapshots is a complete download (config.json and "
                f"*.safetensors): give {by_id} to finish the download, or a complete model "
                "folder")
    return f"{what}: give its snapshot folder (--model {snapshot}) or the repo id ({by_id})"


def _download(model: str, cache_dir: str | None, revision: str | None,
              pinned: str | None = None) -> ModelSource:
    """Hub id `model` downloaded into --cache-dir (default: the HF cache). A folder of that
    name in the working directory holding no model is named, not taken."""
    root = Path(cache_dir).expanduser() if cache_dir else hub.default_cache()
    shadow = Path(model).is_dir()
    try:
        path = hub.download(model, revision, root, pinned)
    except hub.HubError as err:
        note = (f" (./{model} here is a folder without config.json, so the Hub was asked)"
                if shadow else "")
        raise ModelNotFoundError(str(err) + note) from None
    if shadow:
        log.warning("./%s is a folder without config.json, not a model: %s is the Hub's %s "
                    "(give ./%s to mean a local folder)", model, path, model, model)
    return ModelSource(path, "hf", model)


SIGNED_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json", ".jinja")
"""Files whose content decides the answers (a chat template among them): weights_signature."""
SAMPLES_PER_FILE, SAMPLE_BYTES = 8, 64 << 10
MODULE_FOLDER = re.compile(r"\d+_\w+")
"""A sentence-transformers module's folder (1_Pooling, 2_Normalize, 2_Dense)."""


def weights_signature(path: Path) -> str:
    """A cheap content signature of a model file or folder: each weight/config file's name,
    size and eight 64 KiB samples spread over it (plus its last bytes). Replacing the weights
    behind an unchanged path changes it; copying the model elsewhere does not. A few hundred
    KiB read per file, whatever its size. A Hub snapshot's commit is appended ("@sha"), so a
    resume is pinned to the commit its job started with."""
    files = [path] if path.is_file() else _signed_files(path)
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        name = file.name if path.is_file() else file.relative_to(path).as_posix()
        digest.update(f"{name}:{size};".encode())
        offsets = {i * size // SAMPLES_PER_FILE for i in range(SAMPLES_PER_FILE)}
        offsets.add(max(0, size - SAMPLE_BYTES))
        with open(file, "rb") as f:
            for offset in sorted(offsets):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    commit = hub.commit_of(path if path.is_dir() else path.parent)
    return digest.hexdigest() + (f"@{commit}" if commit else "")


def _signed_files(folder: Path) -> list[Path]:
    """A folder's weight and config files, and those of its sentence-transformers module
    folders (`1_Pooling/config.json`: the pooling an embedding job answers with)."""
    modules = [d for d in folder.iterdir() if d.is_dir() and MODULE_FOLDER.fullmatch(d.name)]
    return sorted(p for d in [folder, *modules] for p in d.iterdir()
                  if p.is_file() and p.name.endswith(SIGNED_SUFFIXES))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def checkpoint_files(folder: Path) -> list[str]:
    """The safetensors files of a folder that hold its model, as transformers picks them:
    `model.safetensors` alone (an adapter or another copy beside it is not the model, nor is a
    stale index that re-saving a sharded model in one file leaves behind); else the index's
    shards; else every *.safetensors. CheckpointError when there is none, or the index is
    unreadable or names a missing shard."""
    index = folder / hub.INDEX
    if (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    elif index.is_file():
        try:
            names = hub.index_shards(index)
        except hub.INDEX_ERRORS as err:
            raise CheckpointError(f"cannot read {index}: {err!r}; restore it from the model's "
                                  "source") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names {', '.join(missing[:3])}, missing from "
                                  f"{folder}: the download or copy is incomplete")
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"no *.safetensors in {folder} (batchgen loads safetensors only; "
                              "convert .bin or .pt weights with transformers' save_pretrained)")
    return names


def read_safetensors(folder: Path, files: list[str] | None = None):
    """Yield (name, tensor) from `files` of a folder (default: `checkpoint_files`)."""
    from safetensors import safe_open

    if files is not None:
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{folder} lacks {', '.join(missing)}: the conversion was "
                                  "interrupted or the folder was copied partially")
    else:
        files = checkpoint_files(folder)
    for file in files:
        try:
            with safe_open(str(folder / file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types and OSError
            raise CheckpointError(f"cannot read {folder / file}: {err}. The file is corrupt or "
                                  "truncated: re-download or re-convert it.") from err


def load_hf_config(folder: Path):
    text_only()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False,
                                            local_files_only=True)
    except Exception as err:
        why = err.args[0] if isinstance(err, KeyError) and err.args else err  # unquoted
        raise CheckpointError(f"cannot read {folder / 'config.json'}: {why}; correct it, or "
                              "restore the model's own config.json") from err
    if getattr(config, "tie_word_embeddings", False) and _tied_pair_differs(folder):
        log.warning("%s ties lm_head to the embedding in config.json but its checkpoint holds "
                    "both with different values: keeping them apart, as transformers does",
                    folder)
        config.tie_word_embeddings = False
    return config


TIED_PAIR = ("model.embed_tokens.weight", "lm_head.weight")


def _tied_pair_differs(folder: Path) -> bool:
    """Whether the checkpoint holds both tensors of TIED_PAIR with different values (only
    headers are read unless it holds both)."""
    from safetensors import safe_open

    found = {}
    try:
        files = checkpoint_files(folder)
    except CheckpointError:
        return False  # the weight load names the problem
    for file in files:
        try:
            with safe_open(str(folder / file), framework="pt") as f:
                names = set(f.keys())
                found.update((n, f.get_tensor(n)) for n in TIED_PAIR if n in names)
        except Exception:  # noqa: BLE001 - the weight load names unreadable files
            return False
    return len(found) == 2 and not torch.equal(*found.values())


def build_model(hf_config, weights, dtype: torch.dtype, device: torch.device,
                options=None, tp: TensorParallel | None = None,
                presharded: bool = False) -> torch.nn.Module:
    """Instantiate on the meta device, materialise on `device`, load `weights` by name.

    `options` is the job's ModelConfig (expert offloading, pre-dequantization) or None; `tp`
    this rank's tensor-parallel group (each rank keeps only its slice of the weights).
    `presharded`: `weights` are already this rank's slice (`batchgen convert
    --tensor-parallel-size`), so the model copies them as they are. `weights` already streamed
    (stream_to_device, started before the config was read) are taken as they come."""
    model = materialize(meta_model(hf_config, options, tp).to(dtype), device, hf_config, options)
    if not isinstance(weights, StreamedWeights):
        weights = stream_to_device(weights, device)
    try:
        if presharded:  # only TP-capable models take the switch (meta_model checked that)
            model.load_weights(weights, presharded=True)
        else:
            model.load_weights(weights)
    except CheckpointError:
        raise
    except (KeyError, ValueError) as err:
        # A tensor with no place in the model, of another shape, or missing: the checkpoint
        # and config.json describe different models. A rerun cannot help: exit 5, not a crash.
        why = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise CheckpointError(f"{why}: the checkpoint does not match config.json "
                              f"({type(model).__name__}); restore the model's config.json or "
                              "weights") from err
    return model.eval()


def materialize(model: torch.nn.Module, device: torch.device, hf_config=None,
                options=None) -> torch.nn.Module:
    """Give a meta model uninitialised storage on `device`, in the dtypes it already has (cast
    on meta first: allocating float32 and casting after would need twice the memory). With
    the model's `hf_config`, a block-scaled FP8 checkpoint's experts get FP8 storage and the
    projections an FP8 checkpoint replaces (fp8_dense.deferred_projections) none: their
    weights stay on meta until the FP8 ones arrive (or a dense one: llama.py's `_copy`)."""
    deferred = []
    if hf_config is not None:
        from batchgen.models.fp8_dense import deferred_projections

        fp8_experts_up_front(model, hf_config, device, options)
        deferred = [(module, module.weight) for _, module in
                    deferred_projections(model, hf_config, device, options)]
        for module, _ in deferred:
            del module.weight  # kept on meta: to_empty would allocate it in the model dtype
    model = model.to_empty(device=device).requires_grad_(False)
    for module, weight in deferred:
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives every parameter its own storage
    for module in model.modules():  # buffers (rope tables) are computed, not loaded
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


def fp8_experts_up_front(model: torch.nn.Module, hf_config, device: torch.device,
                         options=None) -> None:
    """On a meta model: where a block-scaled FP8 checkpoint stays FP8 (CUDA, no
    --pre-dequantize-weights), its routed experts are held as e4m3 from the start
    (`RoutedExperts.expect_fp8`). Materialised in the model dtype and switched as the weights
    arrive, they would need twice the FP8 experts' memory first: DeepSeek-V3's 671 B parameters
    are ~160 GB a GPU at TP 8 in bf16, more than an H200 holds."""
    from batchgen.models.fp8 import quantization_config
    from batchgen.models.fp8_dense import keeps_fp8
    from batchgen.models.moe import RoutedExperts

    block = quantization_config(hf_config).get("weight_block_size")
    if not block or not keeps_fp8(hf_config, device, options):
        return
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.expect_fp8((int(block[0]), int(block[1])))


def meta_model(hf_config, options=None, tp: TensorParallel | None = None) -> torch.nn.Module:
    """The model's modules with shapes but no storage (free: sizes it before loading)."""
    from batchgen.models.fp8 import quant_method  # loaded with the model classes, not at start

    cls = model_class(hf_config)
    check_quant_method(quant_method(hf_config))
    extra = {}
    if tp is not None and tp.size > 1:
        if not getattr(cls, "supports_tensor_parallel", False):
            raise CheckpointError(f"{cls.__name__} has no tensor-parallel implementation: run it "
                                  "with --tensor-parallel-size 1 (data parallel)")
        extra["tp"] = tp
    with torch.device("meta"):
        return cls(hf_config, options, **extra)
