"""load_model: from --model / --cache-dir / --converted-ckpt-dir to a ready model + tokenizer."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from batchgen.config import ModelConfig
from batchgen.models.convert import (check_manifest, converted_for_gguf, embedded_gguf,
                                     rank_shard, read_manifest)
from batchgen.models.loader import (EMBEDDED_NAME, MANIFEST, CheckpointError, build_model,
                                    fp8_experts_up_front, load_hf_config, meta_model,
                                    read_safetensors, resolve_dtype, resolve_model)
from batchgen.models.hf_text import text_only
from batchgen.models.weight_stream import stream_to_device
from batchgen.parallel import TensorParallel

log = logging.getLogger("batchgen.models")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    tokenizer: object | None
    eos_token_ids: tuple[int, ...]
    folder: Path
    name: str
    dtype: torch.dtype
    max_context: int


def model_folder(cfg: ModelConfig, world_size: int = 1,
                 tp_size: int | None = None) -> tuple[Path, str]:
    """The folder weights are read from (converting GGUF first) and the model's display name.
    `tp_size` None: not known yet, a converted folder's TP size is checked at load time."""
    converted = Path(cfg.converted_ckpt_dir).expanduser() if cfg.converted_ckpt_dir else None
    if converted is not None and (converted / MANIFEST).is_file():
        check_manifest(read_manifest(converted), converted, world_size, cfg.dtype, tp_size)
        return converted, cfg.model or EMBEDDED_NAME
    if cfg.model is None:
        return converted_for_gguf(embedded_gguf(), cfg.converted_ckpt_dir), EMBEDDED_NAME
    source = resolve_model(cfg.model, cfg.cache_dir, cfg.revision)
    if source.kind == "gguf":
        return converted_for_gguf(source.path, cfg.converted_ckpt_dir), cfg.model
    if source.kind == "converted":
        check_manifest(read_manifest(source.path), source.path, world_size, cfg.dtype, tp_size)
    return source.path, cfg.model


def generation_config(folder: Path) -> dict:
    """A model folder's generation_config.json (its stop tokens and sampling defaults); {}
    without one, CheckpointError if it is unreadable."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        data = json.loads(gen.read_text())
        problem = None if isinstance(data, dict) else "not a JSON object"
    except (OSError, ValueError) as err:
        problem = err
    if problem is not None:
        raise CheckpointError(f"cannot read {gen} ({problem}): it says where answers end and how "
                              "lines are sampled by default; restore the model's "
                              "generation_config.json (or delete it to use config.json's "
                              "eos_token_id and OpenAI's sampling defaults)")
    return data


def eos_token_ids(folder: Path, hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    add(generation_config(folder).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def load_tokenizer(folder: Path):
    """The folder's tokenizer as transformers loads it; for a GGUF's conversion, the generic
    fast tokenizer over its tokenizer.json (see below)."""
    text_only()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((folder / f).is_file() for f in names):
        return None
    try:
        if (folder / "tokenizer.json").is_file() and _converted_from_gguf(folder):
            # tokenizer.json holds the vocabulary, merges and pre-tokenizer the GGUF defined.
            # AutoTokenizer would pick the model type's class (Qwen2Tokenizer for a qwen2
            # file), which rebuilds its own text splitting: wrong for a file made with another.
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                             trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - tokenizers and transformers raise many types
        # A rerun reads the same files: a model error (exit 5), not a worker crash.
        raise CheckpointError(f"cannot load the tokenizer of {folder} ({type(err).__name__}: "
                              f"{err}); restore the model's tokenizer files (tokenizer.json, "
                              "tokenizer_config.json)") from err


def _converted_from_gguf(folder: Path) -> bool:
    try:
        source = read_manifest(folder).get("source", "")
    except CheckpointError:  # no manifest: a model folder as published
        return False
    return isinstance(source, str) and source.lower().endswith(".gguf")


def load_model(cfg: ModelConfig, device: torch.device, world_size: int = 1,
               tp: TensorParallel | None = None,
               before_weights: Callable[[object, torch.dtype], None] | None = None
               ) -> LoadedModel:
    """The job's model, tokenizer and generation settings. `before_weights(hf_config,
    dtype)` runs once the config is read, while the checkpoint's reads go on (start-up's
    precompile pass on a stand-in of the model)."""
    start = time.perf_counter()
    tp = tp or TensorParallel()
    folder, name = model_folder(cfg, world_size, tp.size)
    # Said here, once: memory sizing resolves the folder too, before the load.
    log.info("loading %s from %s", name, folder)
    shard = rank_shard(folder, tp)  # converted per TP rank: read only ours, slice nothing
    # The reads (and on CUDA the pinned staging) start before the config is read: reading it
    # imports transformers, ~1-2 s of CPU the readers overlap.
    weights = stream_to_device(read_safetensors(folder, [shard] if shard else None), device)
    try:
        hf_config = load_hf_config(folder)
        # Before the weights are placed: a damaged tokenizer is named in seconds, not after
        # a whole checkpoint was read.
        tokenizer = load_tokenizer(folder)
        dtype = resolve_dtype(cfg.dtype, device)
        if before_weights is not None:
            before_weights(hf_config, dtype)
        model = build_model(hf_config, weights, dtype, device, cfg, tp,
                            presharded=shard is not None)
    finally:
        weights.close()
    model.max_context = capped_context(model.max_context, cfg.max_model_len)
    if not getattr(model, "generates", True):
        # An embedding model's checkpoint (architectures: Qwen3Model, ...) is as expected; one
        # that says it generates (...ForCausalLM) has lost its LM head.
        causal = any(str(a).endswith("ForCausalLM")
                     for a in getattr(hf_config, "architectures", None) or ())
        log.log(logging.WARNING if causal else logging.INFO,
                "%s has no lm_head.weight and its config.json's tie_word_embeddings is false: "
                "it loads as an embedding model, and its chat and completions lines are error "
                "lines (a model that generates needs its lm_head.weight restored)", folder)
    vocab = getattr(hf_config, "vocab_size", None)
    if tokenizer is not None and isinstance(vocab, int) and len(tokenizer) > vocab:
        log.warning("%s: the tokenizer has %d tokens but config.json's vocab_size is %d: "
                    "lines whose text tokenizes to an id past the model's embeddings are error "
                    "lines; check that the tokenizer belongs to these weights", folder,
                    len(tokenizer), vocab)
    log.info("model %s ready on %s in %.1fs (%s)", name, device, time.perf_counter() - start, dtype)
    return LoadedModel(model, hf_config, tokenizer, eos_token_ids(folder, hf_config, tokenizer),
                       folder, name, dtype, model.max_context)


def capped_context(model_context: int, max_model_len: int | None) -> int:
    """The context requests get: --max-model-len when set (memory, CUDA graph tables and
    intake are planned for it), never above the model's own."""
    if max_model_len is None:
        return model_context
    if max_model_len > model_context:
        log.warning("--max-model-len %d is above the model's context (%d tokens): %d is used",
                    max_model_len, model_context, model_context)
    return min(model_context, max_model_len)


def weight_bytes(cfg: ModelConfig, device: torch.device, world_size: int = 1) -> int:
    """Bytes of the whole model's weights at the dtype it would load in (sizes TP): an FP8
    checkpoint's projections and experts kept FP8 at one byte a parameter."""
    folder, _ = model_folder(cfg, world_size)
    hf_config = load_hf_config(folder)
    size = resolve_dtype(cfg.dtype, device).itemsize
    from batchgen.models.fp8_dense import deferred_projections  # with the model classes

    model = meta_model(hf_config, cfg)
    fp8_experts_up_front(model, hf_config, device, cfg)
    fp8 = {id(m.weight) for _, m in deferred_projections(model, hf_config, device, cfg)}
    return sum(p.numel() * (1 if id(p) in fp8 or p.element_size() == 1 else size)
               for p in model.parameters())
