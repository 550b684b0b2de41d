"""Helpers shared by engine-level tests."""

from __future__ import annotations

from pathlib import Path

import torch

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig, SchedulerConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.engine import Engine
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KV_DTYPES, KVLayout, KVPool
from batchgen.models.loader import build_model, load_hf_config, read_safetensors


def load_ours(folder: Path, dtype=torch.float32, device="cpu"):
    cfg = load_hf_config(folder)
    return build_model(cfg, read_safetensors(folder), dtype, torch.device(device))


def make_engine(model, tokenizer=None, eos=(), device_gb=0.05, host_gb=0.1, kv_dtype="auto",
                **sched) -> Engine:
    cfg = EngineConfig(model=ModelConfig(kv_dtype=kv_dtype),
                       memory=MemoryConfig(gpu_kv_cache_size=device_gb, host_kv_cache_size=host_gb),
                       scheduler=SchedulerConfig(**sched)).validate()
    return Engine(model, cfg, tokenizer, eos)


def greedy_requests(prompts: list[list[int]], max_tokens: int, **kw) -> list[Request]:
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
            for i, p in enumerate(prompts)]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int, use_cache: bool = True) -> list[int]:
    """HF greedy continuation with EOS ignored (as our ignore_eos=True); `use_cache=False`: each
    token from a whole forward, the model's own numbers where HF's cache departs from them."""
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=0, use_cache=use_cache)
    return out[0, len(prompt):].tolist()


def page_bytes(model, kv_dtype: str = "auto") -> int:
    """Bytes of one KV page of `model` (fp8 scales included)."""
    dtype = next(model.parameters()).dtype
    stored = dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype]
    return KVLayout(model.config.num_hidden_layers, tuple(model.kv_token_shape), stored,
                    dtype).bytes_per_page


def make_engine_pages(model, device_pages: int, host_pages: int, tokenizer=None, eos=(),
                      kv_dtype: str = "auto", **sched) -> Engine:
    """An engine whose pools hold exactly the given numbers of pages."""
    size = page_bytes(model, kv_dtype)
    return make_engine(model, tokenizer, eos, device_gb=(device_pages + 0.5) * size / 1e9,
                       host_gb=(host_pages + 0.5) * size / 1e9, kv_dtype=kv_dtype, **sched)


def assert_last_logits_match(ours, hf, prompt):
    """One prefill of `prompt` (up to 8 pages) in both models: last-position logits agree."""
    layout = KVLayout(ours.config.num_hidden_layers, ours.kv_token_shape,
                      torch.float32, torch.float32)
    pool = KVPool(layout, 8, "cpu")
    batch = ForwardBatch.build([prompt], [0], [list(range(8))], [True], pool, torch.device("cpu"))
    with torch.inference_mode():
        ours_logits = ours(batch)[0]
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours_logits, hf_logits, rtol=1e-4, atol=1e-4)
