"""`batchgen bench --mode embeddings`: the Embedder against transformers' batched forward.

Both run in one process on the same random weights (`hf_twin`: HF's model holds our tensors),
over the same inputs (`--requests` inputs of `--input-len` random tokens): ours runs them in
dense prefill-only steps of at most 4x `--max-prefill-tokens` rows (no KV pool); transformers runs
its base model on `[--peer-batch, input_len]` batches (equal lengths: no padding) and pools the
last token. Both pool the last token and L2-normalise. The Embedder's paged path (`paged=True`:
packed steps, K/V stored into a scratch pool, paged attention) runs the same inputs too. The
report gives the throughputs (input tokens/s), the dense path's ratio to transformers' and the
worst cosine of either path's vectors to transformers'. Each side embeds the inputs once
untimed first (kernels compiled, attention plans built for every step shape), then once timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchgen.bench_models import EMBED_SHAPES
from batchgen.config import ModelConfig, RuntimeConfig, canonical_dtype
from batchgen.models.hf_text import text_only

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclass(frozen=True)
class EmbedBench:
    shape: str = "qwen3-embedding-0.6b"
    """One of EMBED_SHAPES."""
    requests: int = 256
    """Inputs embedded."""
    input_len: int = 512
    """Tokens per input."""
    max_step_tokens: int = 8192
    """Token budget of one packed step of ours."""
    peer_batch: int = 32
    """Inputs per transformers forward."""
    dtype: str = "auto"
    device: str = "auto"
    tiny: bool = False
    """The shape at toy widths (CPU smoke runs)."""

    def validate(self) -> None:
        if self.shape not in EMBED_SHAPES:
            raise ValueError(f"--shape {self.shape!r} has no embeddings mode: give --shape "
                             f"{' or '.join(EMBED_SHAPES)}")
        for name in ("requests", "input_len", "max_step_tokens", "peer_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        ModelConfig(dtype=canonical_dtype(self.dtype)).validate()  # as `run` checks them
        RuntimeConfig(device=self.device).validate()


def hf_config(cfg: EmbedBench):
    text_only()
    from transformers import AutoConfig

    spec = dict(EMBED_SHAPES[cfg.shape], **(TINY if cfg.tiny else {}))
    return AutoConfig.for_model("qwen3", **spec)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def run(cfg: EmbedBench) -> dict:
    from batchgen.bench_models import hf_twin, random_model
    from batchgen.engine.embed import Embedder, Pooling
    from batchgen.parallel import pick_device, require_device
    from batchgen.models.loader import resolve_dtype

    cfg.validate()
    require_device(cfg.device)
    device = pick_device(cfg.device)
    dtype = resolve_dtype(canonical_dtype(cfg.dtype), device)
    config = hf_config(cfg)
    model = random_model(config, dtype, device)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, config.vocab_size, (cfg.requests, cfg.input_len), generator=gen)
    ours_inputs = [tuple(row.tolist()) for row in inputs]

    def embed_timed(paged: bool):  # the paged path's scratch pool is freed on return
        embedder = Embedder(model, Pooling("last", True), cfg.max_step_tokens, paged=paged)
        embedder.embed(ours_inputs)  # warm-up: kernels, attention plans per shape, pool
        return _timed(lambda: embedder.embed(ours_inputs), device)

    paged_vectors, paged_s = embed_timed(True)
    ours, ours_s = embed_timed(False)
    hf = hf_twin(model, config).model
    peer_batch = min(cfg.peer_batch, cfg.requests)

    def hf_embed():
        out = []
        with torch.inference_mode():
            for first in range(0, cfg.requests, peer_batch):
                chunk = inputs[first:first + peer_batch].to(device)
                hidden = hf(chunk).last_hidden_state[:, -1].float()
                out.extend(torch.nn.functional.normalize(hidden, dim=-1).cpu())
        return out

    hf_embed()  # warm-up, as ours: the same inputs once, untimed
    theirs, hf_s = _timed(hf_embed, device)
    cosine = min(float(torch.nn.functional.cosine_similarity(a, b, dim=0))
                 for vectors in (ours, paged_vectors) for a, b in zip(vectors, theirs))
    tokens = cfg.requests * cfg.input_len
    return {"shape": cfg.shape, "tiny": cfg.tiny, "device": str(device), "dtype": str(dtype),
            "requests": cfg.requests, "input_len": cfg.input_len,
            "ours": {"seconds": ours_s, "tokens_per_s": tokens / ours_s},
            "paged": {"seconds": paged_s, "tokens_per_s": tokens / paged_s},
            "hf": {"seconds": hf_s, "tokens_per_s": tokens / hf_s, "batch": peer_batch},
            "speedup": hf_s / ours_s, "min_cosine": cosine}


def format_table(report: dict) -> str:
    return "\n".join([
        f"embeddings bench: {report['shape']}{' (tiny)' if report['tiny'] else ''} on "
        f"{report['device']} ({report['dtype']}), {report['requests']} inputs x "
        f"{report['input_len']} tokens",
        f"  batchgen      {report['ours']['tokens_per_s']:12.0f} tokens/s "
        f"({report['ours']['seconds']:.2f} s)",
        f"  paged path    {report['paged']['tokens_per_s']:12.0f} tokens/s "
        f"({report['paged']['seconds']:.2f} s, KV stored into a scratch pool)",
        f"  transformers  {report['hf']['tokens_per_s']:12.0f} tokens/s "
        f"({report['hf']['seconds']:.2f} s, batch {report['hf']['batch']})",
        f"  speedup {report['speedup']:.2f}x, worst cosine to transformers' vectors "
        f"{report['min_cosine']:.6f}"])
