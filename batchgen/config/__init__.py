"""One frozen job configuration, validated once.

Every field carries a docstring (the string under it); the CLI turns those into `--help` text and
docs/flags.md is generated from them, so the help, the docs and the code cannot drift apart.
Field names map to flags one-to-one: `host_kv_cache_size` <-> `--host-kv-cache-size`.

`base.py` holds the shared pieces, `engine.py` the engine's settings (`EngineConfig`) and
`job.py` the job's around them (`JobConfig`); everything is imported from `batchgen.config`.
"""

from batchgen.config.base import (
    DTYPE_ALIASES, DTYPE_CHOICES, GENERATION_CONFIGS, GPU_ARCH_CHOICES, KV_DTYPE_ALIASES,
    REASONING_FIELD_CHOICES, ConfigError, canonical_dtype, canonical_kv_dtype, field_docs,
    read_chat_template)
from batchgen.config.engine import (
    EAGER_DECODE_BATCH, EngineConfig, MemoryConfig, ModelConfig, RuntimeConfig,
    SchedulerConfig)
from batchgen.config.job import (
    MIN_LINE_BYTES, DistConfig, JobConfig, OutputConfig, StorageConfig, WatchdogConfig,
    cache_root, default_storage_path)

__all__ = [
    "DTYPE_ALIASES", "DTYPE_CHOICES", "GENERATION_CONFIGS", "GPU_ARCH_CHOICES",
    "KV_DTYPE_ALIASES", "REASONING_FIELD_CHOICES", "ConfigError", "canonical_dtype",
    "canonical_kv_dtype", "field_docs", "read_chat_template", "EAGER_DECODE_BATCH",
    "EngineConfig", "MemoryConfig", "ModelConfig", "RuntimeConfig", "SchedulerConfig",
    "MIN_LINE_BYTES", "DistConfig", "JobConfig", "OutputConfig", "StorageConfig",
    "WatchdogConfig", "cache_root", "default_storage_path"]
