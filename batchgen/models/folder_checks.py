"""Check a model folder before anything is loaded: a folder that cannot work (no weights, a
truncated file or header, tensors that do not match config.json, a config asking for more
memory than the machine has, no tokenizer) is refused with CheckpointError (exit 5) naming the
file, the tensor or the config field, instead of failing inside the load after minutes.

Only headers are read: a few KiB per safetensors file, whatever its size.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import struct
from pathlib import Path
from types import SimpleNamespace

from batchgen.models.hf_text import text_only
from batchgen.models.loader import CheckpointError, checkpoint_files
from batchgen.models.registry import (MODEL_TYPES, REFUSED_TYPES, check_quant_method,
                                      model_type_of, supported_architecture, yarn_positions)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json", "tiktoken.model")
"""Files a tokenizer reads its vocabulary from (transformers' names for them): beside
tokenizer_config.json, which only configures one, the folder needs one of them."""
ROPE_ALIASES = {"su": "longrope"}
"""Old rope_type names transformers renames on load (Phi-3's first releases)."""
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header's size."""
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
               "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
               "BOOL": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75}
MIN_WEIGHT_BYTES = 0.5
"""Fewest bytes a weight takes (4-bit formats): the config's lower bound never overestimates."""
ROPE_PEAK_FACTOR = 3
"""Peak host memory of building the cos/sin tables, as a multiple of the tables."""
HOST_SHARE = 0.125
"""Share of the host's memory the rotary tables may take at their peak (a 1M-token context of
128-dim heads peaks at 3 GB)."""
log = logging.getLogger("batchgen.model")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
LFS_POINTER = b"version https://git-lfs"
"""How a Git LFS pointer file begins: what `git clone` without Git LFS leaves of a large file."""


def check_model_folder(folder: Path, memory_bytes: int, host_bytes: int,
                       tensor_parallel: int = 1) -> None:
    """Everything below, in order, after the architecture and the quantization
    (UnsupportedModelError); raises CheckpointError. `memory_bytes`: what the weights may use on
    this machine (host memory plus every visible device's); `host_bytes`: host memory alone;
    `tensor_parallel`: the ranks each layer's heads are split over (--tensor-parallel-size)."""
    folder = Path(folder)
    top = _top_config(folder)
    arch = supported_architecture(list(top.get("architectures") or []), top.get("model_type"))
    check_model_type(top.get("model_type"), arch, folder / "config.json")
    note_custom_code(top, arch, folder / "config.json")
    config = _text_part(top)
    check_rope_types(config, folder / "config.json")
    check_head_split(config, tensor_parallel, folder / "config.json")
    check_layer_shapes(config, folder / "config.json")
    if arch == "Gemma3ForCausalLM":  # what Gemma 3's config may ask that is not computed
        from batchgen.models.gemma3 import check_gemma_config

        check_gemma_config(SimpleNamespace(**config))
    quant = config.get("quantization_config") or top.get("quantization_config")
    if isinstance(quant, dict):
        check_quant_method(str(quant.get("quant_method") or ""))
    check_tokenizer(folder)
    headers = read_headers(folder)
    check_config_bounds(config, headers, memory_bytes, host_bytes, folder)


def note_custom_code(config: dict, arch: str, where: Path) -> None:
    """Say in the log that a config's custom modeling code (`auto_map`, which transformers
    runs with trust_remote_code) is not run: batchgen runs its own `arch`. Code that changes
    the model (bidirectional attention in some embedding models) would give other results."""
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        named = ", ".join(sorted({str(v[0] if isinstance(v, list) and v else v)
                                  for v in auto_map.values()}))[:200]
        log.warning("%s names custom modeling code (auto_map: %s), which batchgen does not "
                    "run: it runs its own %s. Where that code differs from the architecture "
                    "(some embedding models attend bidirectionally there), answers and vectors "
                    "are not the model's", where, named, arch)


def _text_part(config: dict) -> dict:
    """The text model's part of a config.json (all of it for a text model)."""
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def _top_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}; restore the model's config.json") \
            from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object; restore the model's config.json")
    return config


def check_model_type(model_type, arch: str, where: Path) -> None:
    """CheckpointError for a model_type transformers does not know beside an architecture
    batchgen runs: transformers reads config.json by its model_type, and would stop the worker
    advising an upgrade, where the fix is the model_type (a missing one: transformers guesses
    it from the folder's name, left to it)."""
    if not isinstance(model_type, str) or model_type in MODEL_TYPES or model_type in REFUSED_TYPES:
        return
    text_only()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    expected = model_type_of(arch)
    raise CheckpointError(f"{where}: model_type {model_type!r} is not one transformers knows, "
                          f"so it cannot read the config; the weights are {arch} "
                          f"(architectures): set \"model_type\": \"{expected}\" in config.json")


def check_head_split(config: dict, tensor_parallel: int, where: Path) -> None:
    """CheckpointError when --tensor-parallel-size cannot split the attention heads: each rank
    takes an equal share of the query heads, and of the KV heads unless each KV head is
    replicated on a whole number of ranks. Refused here, naming the sizes that work, instead of
    in every worker after the launch."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if tensor_parallel <= 1 or not isinstance(heads, int) or heads < 1:
        return
    kv_heads = kv_heads if isinstance(kv_heads, int) and kv_heads >= 1 else heads
    kv_ok = kv_heads % tensor_parallel == 0 or tensor_parallel % kv_heads == 0
    if heads % tensor_parallel == 0 and kv_ok:
        return
    sizes = [s for s in range(1, heads + 1) if heads % s == 0
             and (kv_heads % s == 0 or s % kv_heads == 0)]
    raise CheckpointError(f"--tensor-parallel-size {tensor_parallel} cannot split the model's "
                          f"attention heads ({where}: num_attention_heads {heads}, "
                          f"num_key_value_heads {kv_heads}): choose one of "
                          f"{', '.join(map(str, sizes))}")


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
"""The config fields that give a mixture-of-experts model's number of routed experts."""


def check_layer_shapes(config: dict, where: Path) -> None:
    """CheckpointError for head, layer-type and expert counts no model can be built from,
    naming the fields, before a worker is launched (a worker stopped on them with a torch
    error, and a top-k over fewer experts than it takes failed every forward)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    hidden, layers = config.get("hidden_size"), config.get("num_hidden_layers")
    if _positive(heads) and _positive(kv_heads) and heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}: each KV head serves a whole "
                              "number of query heads; restore the model's config.json")
    if _positive(heads) and _positive(hidden) and hidden % heads and not config.get("head_dim"):
        raise CheckpointError(f"{where}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} and no head_dim is given: set "
                              "head_dim to the model's per-head size")
    types = config.get("layer_types")
    if isinstance(types, list) and _positive(layers) and len(types) != layers:
        raise CheckpointError(f"{where}: layer_types lists {len(types)} layers but "
                              f"num_hidden_layers is {layers}: give one type per layer")
    per_token = config.get("num_experts_per_tok")
    for field in EXPERT_COUNTS:
        experts = config.get(field)
        if _positive(experts) and _positive(per_token) and per_token > experts:
            raise CheckpointError(f"{where}: num_experts_per_tok {per_token} is more than "
                                  f"{field} {experts}: a token is routed to at most every "
                                  "expert; restore the model's config.json")


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_rope_types(config: dict, where: Path) -> None:
    """CheckpointError for a rope_type the model code does not compute (a worker would stop on
    it while building the model), naming those it does."""
    for field, params in _ropes(config):
        kind = str(params.get("rope_type", params.get("type", "default")))
        kind = ROPE_ALIASES.get(kind, kind)
        if kind == "default":
            continue
        supported = supported_rope_types()
        if kind not in supported:
            raise CheckpointError(f"{where}: {field} has rope_type {kind!r}, which batchgen does "
                                  f"not compute (it takes {', '.join(supported)}): correct "
                                  "rope_type to the one the model was trained with (its model "
                                  "card or original config.json names it)")


def _ropes(config: dict) -> list[tuple[str, dict]]:
    """(field, settings) of each rope a config describes, read as `layers.rope_parameters`
    reads them: rope_parameters (transformers 5.x; one per layer kind where nested), else
    rope_scaling ("type" for an older config's "rope_type", "default" without either)."""
    field = "rope_parameters" if isinstance(config.get("rope_parameters"), dict) \
        and config["rope_parameters"] else "rope_scaling"
    params = config.get(field)
    if not isinstance(params, dict):
        return []
    nested = {f"{field}.{k}": v for k, v in params.items() if isinstance(v, dict)}
    return list((nested or {field: params}).items())


def supported_rope_types() -> list[str]:
    """The rope types `layers.rope_inv_freq` computes: default, and transformers' table."""
    text_only()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return sorted({"default", *ROPE_INIT_FUNCTIONS})


def _has_vocabulary(folder: Path) -> bool:
    """Whether the folder holds a vocabulary file: one of VOCABULARY_FILES, or a file named
    like one of the other formats tokenizers read (`*.model`, `*.tiktoken`, `*.spm`,
    `vocab*`: e.g. qwen.tiktoken)."""
    if any((folder / name).is_file() for name in VOCABULARY_FILES):
        return True
    return any(path.is_file() and (path.suffix in (".model", ".tiktoken", ".spm")
                                   or path.name.startswith("vocab"))
               for path in folder.iterdir())


def check_tokenizer(folder: Path) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                              "copy the model's tokenizer files into the folder")
    if not _has_vocabulary(folder):
        raise CheckpointError(f"{folder} has tokenizer_config.json but no vocabulary (none of "
                              f"{', '.join(VOCABULARY_FILES)}): copy the model's tokenizer.json "
                              "into the folder")
    for name in TOKENIZER_FILES:
        check_not_lfs_pointer(folder / name)
    if (not (folder / "tokenizer.json").is_file() and (folder / "tokenizer.model").is_file()
            and not sentencepiece_installed()):
        raise CheckpointError(f"{folder} has tokenizer.model but no tokenizer.json, and reading "
                              "tokenizer.model takes the sentencepiece package, which is not "
                              "installed: copy the model's tokenizer.json into the folder, or "
                              "`pip install sentencepiece`")


def check_not_lfs_pointer(path: Path) -> None:
    """CheckpointError when `path` is a Git LFS pointer in place of the file it names."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(LFS_POINTER))
    except OSError:
        return  # absent or unreadable: the checks and the load that read it name it
    if head == LFS_POINTER:
        raise CheckpointError(f"{path} is a Git LFS pointer, not the file itself: the model was "
                              "cloned without Git LFS. Run `git lfs install && git lfs pull` in "
                              f"{path.parent}, or download the model with `hf download`")


def sentencepiece_installed() -> bool:
    return importlib.util.find_spec("sentencepiece") is not None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files the loader reads (`loader.checkpoint_files`)."""
    return [folder / name for name in checkpoint_files(folder)]


def read_headers(folder: Path) -> dict[str, tuple[Path, list[int], str]]:
    """tensor name -> (file, shape, dtype) over every weight file, each header checked."""
    tensors: dict[str, tuple[Path, list[int], str]] = {}
    for path in weight_files(folder):
        for name, (shape, dtype) in read_header(path).items():
            tensors[name] = (path, shape, dtype)
    return tensors


def read_header(path: Path) -> dict[str, tuple[list[int], str]]:
    """A safetensors file's tensors (name -> (shape, dtype)), checked against the file's size:
    a truncated file or header is named here."""
    check_not_lfs_pointer(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"it is {size} bytes, too short for a safetensors header")
        length = struct.unpack("<Q", head)[0]
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise _corrupt(path, f"its header claims {length} bytes but the file holds "
                                 f"{size - 8} after the length")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise _corrupt(path, f"its header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape, dtype = _check_entry(path, name, entry, data_bytes)
        tensors[name] = (shape, dtype)
    return tensors


def _check_entry(path: Path, name: str, entry, data_bytes: int) -> tuple[list[int], str]:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = (dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
              and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise _corrupt(path, f"tensor {name!r} has an unreadable header entry {entry!r}")
    if end > data_bytes:
        raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data but the file "
                             f"holds {data_bytes}: it is truncated")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != math.ceil(expected):
        raise _corrupt(path, f"tensor {name!r} ({dtype} {shape}) needs {math.ceil(expected)} "
                             f"bytes but its header gives it {end - begin}")
    return list(shape), dtype


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a usable safetensors file: {why}. Re-download or "
                           "re-convert it")


def _int_field(config: dict, name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")
    return value


def check_config_bounds(config: dict, headers: dict, memory_bytes: int, host_bytes: int,
                        folder: Path) -> None:
    """Refuse a config.json that does not describe the checkpoint or asks for more memory than
    the machine has, naming the field, before anything is allocated."""
    where = folder / "config.json"
    layers = _int_field(config, "num_hidden_layers")
    hidden = _int_field(config, "hidden_size")
    vocab = _int_field(config, "vocab_size")
    heads = _int_field(config, "num_attention_heads")
    held = {int(m.group(1)) for name in headers for m in [_LAYER.search(name)] if m}
    if held and layers > max(held) + 1:
        raise CheckpointError(f"{where}: num_hidden_layers is {layers} but the checkpoint holds "
                              f"layers 0 to {max(held)}: the config does not describe these "
                              "weights; restore the model's config.json")
    # attention's query and output projections alone: at least 2 x hidden^2 per layer
    weights = (2 * layers * hidden * hidden + vocab * hidden) * MIN_WEIGHT_BYTES
    if weights > memory_bytes:
        raise CheckpointError(
            f"{where}: num_hidden_layers {layers} x hidden_size {hidden} (vocab_size {vocab}) "
            f"need at least {weights / 1e9:.1f} GB of weights, more than this machine's "
            f"{memory_bytes / 1e9:.1f} GB of host and device memory")
    _check_rope_tables(config, int(config.get("head_dim") or hidden // heads), host_bytes,
                       where)
    _check_shapes(config, headers, vocab, hidden)


def _check_rope_tables(config: dict, head_dim: int, host_bytes: int, where: Path) -> None:
    """The float32 cos/sin tables of the model's context (max_position_embeddings, or YaRN's
    original_max_position_embeddings x factor where longer) within HOST_SHARE of the host."""
    positions = _int_field(config, "max_position_embeddings", 32768)
    stretched = max([0, *(yarn_positions(params) for _, params in _ropes(config))])
    context = (f"max_position_embeddings {positions}" if positions >= stretched else
               f"YaRN's original_max_position_embeddings x factor ({stretched} positions)")
    peak = max(positions, stretched) * head_dim * 4 * 2 * ROPE_PEAK_FACTOR
    if peak > host_bytes * HOST_SHARE:
        raise CheckpointError(
            f"{where}: {context} needs {peak / 1e9:.1f} GB of host memory for its rotary "
            f"tables, more than {HOST_SHARE:.0%} of this host's {host_bytes / 1e9:.1f} GB: "
            "lower it to the context the model was trained for")


def _check_shapes(config: dict, headers: dict, vocab: int, hidden: int) -> None:
    """The tensors whose shape config.json fixes: embeddings, lm_head and the norms."""
    expected = {"embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
                "norm.weight": [hidden]}
    for name, (path, shape, dtype) in headers.items():
        for suffix, want in expected.items():
            if (name == suffix or name.endswith("." + suffix)) and not _LAYER.search(name) \
                    and DTYPE_BYTES[dtype] >= 1 and shape != want:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {shape} but config.json (vocab_size "
                    f"{vocab}, hidden_size {hidden}) makes it {want}: the weights and the "
                    "config belong to different models")


def machine_memory() -> tuple[int, int]:
    """(host + every GPU's memory, host memory) in bytes, without creating a CUDA context in
    this process (NVML; where it is missing, a generous MAX_DEVICE_BYTES per visible device)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host + _device_memory(), host


MAX_DEVICE_BYTES = 512 << 30
"""More memory than any one accelerator has: the bound used when NVML cannot tell."""


def _device_memory() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return sum(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                       for i in range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library, no driver, no pynvml: count instead
        import torch

        return torch.cuda.device_count() * MAX_DEVICE_BYTES
