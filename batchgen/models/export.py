"""`batchgen convert`: load any supported model (factory.load_model) and write it in our
converted layout (convert.py describes the layout), whole or one shard per tensor-parallel rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from batchgen.models.convert import (conversion_folder, save_weights, shard_name, write_converted,
                                     write_metadata)
from batchgen.models.factory import load_model
from batchgen.models.loader import CheckpointError
from batchgen.parallel import ParallelError, TensorParallel

log = logging.getLogger("batchgen.convert")


def convert_model(cfg, output: Path, world_size: int = 1, tensor_parallel_size: int = 1) -> Path:
    """`batchgen convert`: load any supported model and write it in our layout.

    At tensor-parallel size 1 every rank reads the same full weights. At T > 1 the model is
    built once per TP rank (slicing needs only the rank and size, no process group) and each
    rank's state dict is written on its own, so memory holds one rank's share at a time. The
    manifest records world and TP size so a folder made for another layout is refused."""
    output = Path(output)
    if world_size < 1 or tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise CheckpointError(f"--tensor-parallel-size {tensor_parallel_size} must divide "
                              f"--world-size {world_size} (both >= 1)")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"--output {output} exists and is not an empty folder: choose a "
                              "new folder")
    # Host-offloaded experts are not parameters, so a state dict would miss them.
    cfg = replace(cfg, enable_ep_with_offloading=False, ep_offloading_ratio=0.0)
    with conversion_folder(output.parent) as tmp:
        if tensor_parallel_size == 1:
            loaded = _load_for_conversion(cfg, None)
            write_converted(tmp, loaded.hf_config, loaded.tokenizer, _weights(loaded.model),
                            source=str(loaded.folder), dtype=_dtype_name(loaded),
                            world_size=world_size)
        else:
            _write_rank_shards(cfg, tmp, world_size, tensor_parallel_size)
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    return output


def _write_rank_shards(cfg, folder: Path, world_size: int, size: int) -> None:
    files = []
    for rank in range(size):
        try:
            loaded = _load_for_conversion(cfg, TensorParallel(size=size, rank=rank))
        except ParallelError as err:  # a user error (the CLI reports CheckpointError cleanly)
            raise CheckpointError(f"cannot convert for tensor-parallel size {size}: {err}") from err
        files.append(shard_name(rank, size))
        save_weights(folder / files[-1], loaded.hf_config, _weights(loaded.model))
        log.info("wrote tensor-parallel rank %d of %d: %s", rank, size, files[-1])
        meta = (loaded.hf_config, loaded.tokenizer, str(loaded.folder), _dtype_name(loaded))
        del loaded  # one rank's weights in memory at a time
    hf_config, tokenizer, source, dtype = meta
    write_metadata(folder, hf_config, tokenizer, files, source=source, dtype=dtype,
                   world_size=world_size, tensor_parallel_size=size)


def _weights(model) -> dict:
    """The tensors a converted folder holds: a model without an LM head (an embedding model's
    bare decoder stack) is written without one, so it loads as such again."""
    tensors = model.state_dict()
    if not model.generates:
        tensors.pop("lm_head.weight", None)
    return tensors


def _load_for_conversion(cfg, tp: TensorParallel | None):
    return load_model(cfg, torch.device("cpu"), tp=tp)


def _dtype_name(loaded) -> str:
    return str(loaded.dtype).removeprefix("torch.")
