"""Embeddings: prefill-only forwards of a decoder model, pooled per input.

`Embedder` orders the inputs it is given by length and groups them into dense steps: inputs of
similar length right-padded to the longest, at most `max_step_tokens` rows with the padding.
It runs the model's own layers up to the final norm (not the LM head) on a dense ForwardBatch,
whose attention is causal SDPA over each input's own rows: no KV pool, no pages, nothing
stored or kept. Then it pools each input's real rows: last token, mean, first token (cls) or
max, cuts to `dimensions` and L2 normalises, as the model folder's sentence-transformers files
say (`read_pooling`). Vectors come back in the order of the inputs.

Models whose attention keeps a latent KV (MLA) take the paged path instead: inputs packed
without padding, K/V stored into a scratch pool that the next step overwrites.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.core import PAGE_SIZE
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool

STEP_TOKENS_PER_PREFILL_TOKEN = 4
"""An embedding step takes this many times `--max-prefill-tokens` tokens: it keeps no KV, so
its memory is its activations only, and larger steps amortise the per-layer launches (~400 a
step: at 8,192 tokens per step a Qwen3-Embedding-0.6B-shaped model leaves an H200 waiting on
them; at 32,768 the GPU stays busy)."""


def step_tokens(max_prefill_tokens: int) -> int:
    """Tokens per embedding step for a job whose prefill budget is `max_prefill_tokens`."""
    return STEP_TOKENS_PER_PREFILL_TOKEN * max_prefill_tokens


POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
"""sentence-transformers' Pooling config keys -> our pooling modes."""
POOLING_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max"}
"""The same modes as the one string a Pooling config may give instead (`pooling_mode`)."""


class EmbeddingModelError(ValueError):
    """The model folder (its sentence-transformers files, its config) asks for what batchgen
    cannot do."""


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"
    """last, mean, cls or max."""
    normalize: bool = True
    """L2-normalise each vector (after cutting it to `dimensions`)."""
    dimensions: tuple[int, ...] | None = None
    """The sizes a Matryoshka model was trained to be cut to (None: any size)."""


def read_pooling(folder: Path | None, hf_config) -> Pooling:
    """The pooling of a model folder: sentence-transformers' modules.json (a Pooling module and
    its config.json, a Normalize module). Without modules.json: last-token pooling and L2
    normalisation, what decoder embedding models (Qwen3-Embedding, e5-mistral) use. A config
    asking for bidirectional attention (`is_causal: false`) is refused: attention here is
    causal, and its vectors would silently differ from the model's."""
    if getattr(hf_config, "is_causal", True) is False:
        raise EmbeddingModelError("config.json sets is_causal: false (bidirectional attention, "
                                  "as some embedding models are trained): batchgen's attention "
                                  "is causal, so its vectors would not be this model's")
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    dimensions = tuple(int(d) for d in sizes) if sizes else None
    modules_file = folder / "modules.json" if folder is not None else None
    if modules_file is None or not modules_file.is_file():
        return Pooling("last", True, dimensions)
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EmbeddingModelError(f"{modules_file} is not a list of modules (JSON objects): "
                                  "restore the model's sentence-transformers files")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    unsupported = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unsupported:
        raise EmbeddingModelError(f"{modules_file} uses sentence-transformers modules "
                                  f"{', '.join(unsupported)}, which batchgen does not run "
                                  "(it runs Transformer, Pooling and Normalize)")
    if "Pooling" not in kinds:
        raise EmbeddingModelError(f"{modules_file} lists no Pooling module, so "
                                  "sentence-transformers makes no vector of a text from it: "
                                  "restore the model's sentence-transformers files")
    pooling_file = folder / str(kinds["Pooling"].get("path", "")) / "config.json"
    config = _read_json(pooling_file)
    if not isinstance(config, dict):
        raise EmbeddingModelError(f"{pooling_file} is not a JSON object: restore the "
                                  "model's sentence-transformers files")
    return Pooling(_pooling_mode(config, pooling_file), "Normalize" in kinds, dimensions)


def _pooling_mode(config: dict, path: Path) -> str:
    """The one pooling mode a Pooling config.json asks for: one true `pooling_mode_*` key, or
    the string `pooling_mode` (which sentence-transformers also reads)."""
    named = config.get("pooling_mode")
    if isinstance(named, str):
        chosen = [POOLING_NAMES.get(named, named)]
    else:
        chosen = [POOLING_MODES.get(k, k) for k, v in config.items()
                  if k.startswith("pooling_mode_") and v]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES.values():
        raise EmbeddingModelError(f"{path} asks for pooling {chosen}: batchgen pools one way, "
                                  f"of {', '.join(POOLING_NAMES)}")
    return chosen[0]


def max_seq_length(folder: Path | None) -> int | None:
    """sentence-transformers' input bound (`max_seq_length` in sentence_bert_config.json):
    longer texts were never seen in training (sentence-transformers truncates them; vLLM takes
    it as the model's length and refuses them). None when the folder sets none."""
    path = folder / "sentence_bert_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    config = _read_json(path)
    limit = config.get("max_seq_length") if isinstance(config, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def pooling_summary(folder: Path | None, pooling: Pooling) -> str:
    """How `pooling` pools, and where it was read (for the job's log)."""
    how = {"last": "last-token", "mean": "mean", "cls": "first-token (cls)", "max": "max"}
    said = f"{how[pooling.mode]} pooling, " + ("L2-normalised" if pooling.normalize
                                               else "not normalised")
    if folder is None or not (folder / "modules.json").is_file():
        return said + " (no modules.json: the default of decoder embedding models)"
    return said + f" (from {folder / 'modules.json'})"


def prompt_note(folder: Path | None) -> tuple[int, str] | None:
    """(log level, message): what a user of sentence-transformers should know about the
    folder's prompts (config_sentence_transformers.json): none is added to inputs, a default
    prompt (which sentence-transformers adds to every text: a warning) included; None when the
    folder names none."""
    path = folder / "config_sentence_transformers.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # sentence-transformers' own file; nothing batchgen runs reads it
    prompts = config.get("prompts") if isinstance(config, dict) else None
    prompts = {k: v for k, v in prompts.items() if v} if isinstance(prompts, dict) else {}
    default = config.get("default_prompt_name") if isinstance(config, dict) else None
    if default in prompts:
        return logging.WARNING, (
            f"{path} names the default prompt {default!r} ({prompts[default]!r}), which "
            "sentence-transformers puts before every text it encodes: batchgen does not (nor "
            "does vLLM); write it at the start of each input to get those vectors")
    if prompts:
        return logging.INFO, (
            f"{path} lists prompts ({', '.join(map(repr, prompts))}): batchgen adds none to "
            "inputs; write the one a text needs (e.g. a query's instruction) at the start of "
            "its input")
    return None


def _read_json(path: Path):
    """A sentence-transformers file's JSON; EmbeddingModelError naming it if it is missing or
    unreadable (the model folder is at fault, not the request)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EmbeddingModelError(f"cannot read {path} ({err}): restore the model's "
                                  "sentence-transformers files") from None


class Embedder:
    """Embeds token-id sequences with `model` (a PagedCausalLM); see the module docstring.
    `paged=True` runs the paged path even where the dense one could (a reference for tests)."""

    def __init__(self, model: torch.nn.Module, pooling: Pooling, max_step_tokens: int = 8192,
                 paged: bool = False):
        self.model = model
        self.pooling = pooling
        self.max_step_tokens = max_step_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # K and V per token is the layout `paged_attention` serves, and it honours dense
        # batches; a latent KV (MLA: one vector per token) runs its own attention, which pages.
        self.dense = not paged and tuple(model.kv_token_shape)[0] == 2
        self.layout = KVLayout(model.config.num_hidden_layers, tuple(model.kv_token_shape),
                               self.dtype, self.dtype)
        self.width = model.config.hidden_size
        self._pool: KVPool | None = None

    def embed(self, inputs: list[tuple[int, ...]], dimensions: list[int | None] | None = None,
              normalize: list[bool | None] | None = None) -> list[torch.Tensor]:
        """One float32 vector (on the CPU) per input, in the order of `inputs`;
        `dimensions[i]` cuts vector i, `normalize[i]` (None: the pooling's) L2-normalises it."""
        dimensions = dimensions or [None] * len(inputs)
        normalize = normalize or [None] * len(inputs)
        out: list[torch.Tensor | None] = [None] * len(inputs)
        step = self._dense_step if self.dense else self._paged_step
        # Each step's pooled rows are copied out without waiting (into pinned memory on CUDA),
        # so the next step is built and launched while this one runs; one wait at the end.
        pending = [(group, step([inputs[i] for i in group]).to("cpu", non_blocking=True))
                   for group in self._steps(inputs)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for group, pooled in pending:
            for i, row in zip(group, pooled):
                out[i] = self._finish(row, dimensions[i], normalize[i])
        return out

    def _steps(self, inputs) -> list[list[int]]:
        """Indices of `inputs` by step. Dense steps take inputs shortest first, so each step
        holds inputs of similar length, as many as fit `max_step_tokens` padded to the
        longest; paged steps pack inputs in order, `max_step_tokens` tokens with no padding.
        An input over the budget is a step of its own."""
        order = (sorted(range(len(inputs)), key=lambda i: len(inputs[i])) if self.dense
                 else list(range(len(inputs))))
        steps: list[list[int]] = []
        group: list[int] = []
        tokens = 0
        for i in order:
            n = len(inputs[i])
            cost = (len(group) + 1) * n if self.dense else tokens + n
            if group and cost > self.max_step_tokens:
                steps.append(group)
                group, tokens = [], 0
            group.append(i)
            tokens += n
        if group:
            steps.append(group)
        return steps

    @torch.inference_mode()
    def _dense_step(self, group: list[tuple[int, ...]]) -> torch.Tensor:
        """Right-padded [B, L] rows through `dense_attention`: no pool, no pages."""
        batch = ForwardBatch.build_dense([list(ids) for ids in group], self.device)
        hidden = self._hidden(batch)
        rows = hidden.reshape(batch.dense.seqs, batch.dense.length, -1)
        mode = self.pooling.mode
        if mode == "last":
            return hidden[batch.logits_indices].float()
        if mode == "cls":
            return rows[:, 0].float()
        lengths = torch.tensor(batch.q_lens, device=hidden.device)
        real = torch.arange(batch.dense.length, device=hidden.device)[None] < lengths[:, None]
        if mode == "mean":
            return (rows.float() * real[..., None]).sum(1) / lengths[:, None]
        return rows.float().masked_fill(~real[..., None], float("-inf")).amax(1)

    def _scratch(self, pages: int) -> KVPool:
        if self._pool is None or self._pool.num_pages < pages:
            self._pool = None  # free the old one first
            self._pool = KVPool(self.layout, pages, self.device)
        return self._pool

    @torch.inference_mode()
    def _paged_step(self, group: list[tuple[int, ...]]) -> torch.Tensor:
        """Packed rows, K/V stored into a scratch pool that the next step overwrites."""
        counts = [-(-len(ids) // PAGE_SIZE) for ids in group]
        pool = self._scratch(sum(counts))
        tables, next_page = [], 0
        for n in counts:
            tables.append(list(range(next_page, next_page + n)))
            next_page += n
        batch = ForwardBatch.build([list(ids) for ids in group], [0] * len(group), tables,
                                   [False] * len(group), pool, self.device)
        return self._pool_rows(self._hidden(batch).float(), [len(ids) for ids in group])

    def _hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The final norm's output of every row: the model's segments but the LM head."""
        hidden = None
        for segment in self.model.segments()[:-1]:
            hidden = segment(hidden, batch)
        return hidden

    def _pool_rows(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        ends = torch.tensor(lengths, device=hidden.device).cumsum(0)
        starts = ends - torch.tensor(lengths, device=hidden.device)
        mode = self.pooling.mode
        if mode == "last":
            return hidden[ends - 1]
        if mode == "cls":
            return hidden[starts]
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                        torch.tensor(lengths, device=hidden.device))
        if mode == "mean":
            sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
            sums.index_add_(0, owner, hidden)
            return sums / torch.tensor(lengths, device=hidden.device)[:, None]
        return torch.stack([hidden[s:e].amax(0) for s, e in zip(starts.tolist(), ends.tolist())])

    def _finish(self, vector: torch.Tensor, dims: int | None,
                normalize: bool | None) -> torch.Tensor:
        if dims is not None:
            vector = vector[:dims]
        if self.pooling.normalize if normalize is None else normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector
