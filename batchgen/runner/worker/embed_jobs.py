"""Embeddings lines in a worker: queued at intake, embedded by the `Embedder` (prefill only:
inputs ordered by length into dense steps, no KV kept) a bounded share per worker step, so
their results are written as they are made, each under its own custom_id, and a stop or a kill
loses at most one share. A share is about SHARE_SECONDS of work at the speed the last one ran
(at most RUN_STEPS embedder steps' tokens): a fraction of a second's worth on a GPU, a few
thousand tokens on a laptop's CPU, where a fixed GPU-sized share would take minutes."""

from __future__ import annotations

import logging
from time import perf_counter

import numpy as np

from batchgen.engine.embed import (Embedder, max_seq_length, pooling_summary, prompt_note,
                                   read_pooling)
from batchgen.io.embeddings import (EmbeddingLineError, EmbeddingRequest, check_dimensions,
                                    check_length)
from batchgen.io.intake import IntakeError
from batchgen.io.results import embedding_line, failure_line


log = logging.getLogger("batchgen.worker")

RUN_STEPS = 8
"""At most this many embedder steps' worth of tokens are embedded per worker step (the rest
stays queued)."""
SHARE_SECONDS = 2.0
"""A share's tokens are the last share's speed times this (never more than RUN_STEPS steps'
tokens, never growing more than SHARE_GROWTH times at once)."""
FIRST_SHARE_TOKENS = {"cuda": 4096, "cpu": 512}
"""The first share's tokens by device type, before any speed is known (a CPU embeds a small
model's 4,096 tokens in tens of seconds: a stop would wait for them)."""
SHARE_GROWTH = 8
"""How much larger than the last one a share may be: the first share's speed includes its
warm-up, so shares grow to a fast device's full size over a few steps."""


class EmbeddingJobs:
    """The embeddings lines queued at intake and not embedded yet. The Embedder (and its
    pooling, read from the model folder) is built on the first line, so generation-only jobs
    never read sentence-transformers files."""

    def __init__(self, loaded, batch_id: str, max_step_tokens: int):
        self.loaded, self.batch_id, self.max_step_tokens = loaded, batch_id, max_step_tokens
        self.queue: list[EmbeddingRequest] = []
        self._embedder: Embedder | None = None
        self._max_tokens: int | None = None
        """sentence_bert_config.json's max_seq_length, read with the pooling."""
        self._refusal_logged = False
        """Whether the model folder's refused pooling was logged (once; each line says it)."""
        device = next(loaded.model.parameters()).device.type
        first = FIRST_SHARE_TOKENS.get(device, FIRST_SHARE_TOKENS["cuda"])
        self.share_tokens = min(first, RUN_STEPS * max_step_tokens)
        """Tokens the next share takes (at least one line)."""

    def __len__(self) -> int:
        return len(self.queue)

    def embedder(self) -> Embedder:
        if self._embedder is None:
            folder = self.loaded.folder
            pooling = read_pooling(folder, self.loaded.hf_config)
            self._max_tokens = max_seq_length(folder)
            self._embedder = Embedder(self.loaded.model, pooling, self.max_step_tokens)
            log.info("embeddings: %s", pooling_summary(folder, pooling))
            note = prompt_note(folder)
            if note:
                log.log(note[0], "embeddings: %s", note[1])
        return self._embedder

    def add(self, item: EmbeddingRequest) -> IntakeError | None:
        """Queue `item`; an IntakeError when the model cannot answer it as asked."""
        try:
            embedder = self.embedder()
            check_dimensions(item, embedder.width, embedder.pooling.dimensions)
            check_length(item, self._max_tokens, "sentence_bert_config.json")
        except EmbeddingLineError as bad:
            return IntakeError(item.custom_id, item.line, bad.code, f"line {item.line}: {bad}",
                               bad.param)
        except ValueError as bad:  # EmbeddingModelError: the model folder's pooling
            if not self._refusal_logged:
                self._refusal_logged = True
                log.error("embeddings: this model cannot answer embeddings lines (%s): each "
                          "is an unsupported_model error line", bad)
            return IntakeError(item.custom_id, item.line, "unsupported_model",
                               f"line {item.line}: {bad}", "model")
        self.queue.append(item)
        return None

    def run(self) -> list[tuple[dict, int]]:
        """Embed the oldest queued lines, about `share_tokens` tokens (at least one line):
        (result line, prompt tokens) per line, in queue order."""
        if not self.queue:
            return []
        taken, tokens = 0, 0
        for item in self.queue:
            if taken and tokens + item.prompt_tokens > self.share_tokens:
                break
            tokens += item.prompt_tokens
            taken += 1
        queue, self.queue = self.queue[:taken], self.queue[taken:]
        inputs = [ids for item in queue for ids in item.token_ids]
        dims = [item.dimensions for item in queue for _ in item.token_ids]
        norms = [item.normalize for item in queue for _ in item.token_ids]
        embedder = self.embedder()
        started = perf_counter()
        vectors = embedder.embed(inputs, dims, norms)  # returns once the device is done
        self._next_share(tokens, perf_counter() - started)
        vectors = iter(v.numpy() for v in vectors)
        return [self._line(item, [next(vectors) for _ in item.token_ids]) for item in queue]

    def _next_share(self, tokens: int, seconds: float) -> None:
        """Size the next share from this one's speed (see SHARE_SECONDS)."""
        at_speed = tokens / max(seconds, 1e-6) * SHARE_SECONDS
        largest = min(RUN_STEPS * self.max_step_tokens, SHARE_GROWTH * max(tokens, 1))
        self.share_tokens = max(1, int(min(at_speed, largest)))

    def _line(self, item: EmbeddingRequest, vectors: list[np.ndarray]) -> tuple[dict, int]:
        """(result line, prompt tokens) of one embedded line: its embeddings object, or a
        failure line when a vector is not finite (JSON has no NaN: it would be written as null
        under status 200); a failed line counts no tokens."""
        bad = next((i for i, v in enumerate(vectors) if not np.isfinite(v).all()), None)
        if bad is None:
            return (embedding_line(self.batch_id, item, vectors, self.loaded.name),
                    item.prompt_tokens)
        where = "input" if len(vectors) == 1 else f"input[{bad}]"
        dtype = str(self.embedder().dtype).removeprefix("torch.")
        fix = ("float16 overflows past 65,504: run the file as a new job (--batch-id) with "
               "--dtype bfloat16 or float32" if dtype == "float16"
               else "check the model's weights for NaN or infinite values")
        return failure_line(self.batch_id, item.custom_id, item.line, "non_finite_embedding",
                            f"line {item.line}: the vector of {where} holds NaN or infinite "
                            f"values (the model's hidden states in {dtype}); {fix}"), 0
