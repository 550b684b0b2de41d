"""Embeddings lines in a worker: queued at intake, embedded by the `Embedder` (prefill only:
inputs ordered by length into dense steps, no KV kept) a bounded share per worker step
(RUN_STEPS embedder steps' tokens), so their results are written as they are made, each under
its own custom_id, and a stop or a kill loses at most one share."""

from __future__ import annotations

import logging

import numpy as np

from batchgen.engine.embed import (Embedder, max_seq_length, pooling_summary, prompt_note,
                                   read_pooling)
from batchgen.io.embeddings import (EmbeddingLineError, EmbeddingRequest, check_dimensions,
                                    check_length)
from batchgen.io.intake import IntakeError
from batchgen.io.results import embedding_line, failure_line


log = logging.getLogger("batchgen.worker")

RUN_STEPS = 8
"""Embedder steps' worth of tokens embedded per worker step (the rest stays queued)."""


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
        """Embed the oldest queued lines, about RUN_STEPS embedder steps of tokens (at least
        one line): (result line, prompt tokens) per line, in queue order."""
        if not self.queue:
            return []
        budget, taken, tokens = RUN_STEPS * self.max_step_tokens, 0, 0
        for item in self.queue:
            if taken and tokens + item.prompt_tokens > budget:
                break
            tokens += item.prompt_tokens
            taken += 1
        queue, self.queue = self.queue[:taken], self.queue[taken:]
        inputs = [ids for item in queue for ids in item.token_ids]
        dims = [item.dimensions for item in queue for _ in item.token_ids]
        norms = [item.normalize for item in queue for _ in item.token_ids]
        vectors = iter(v.numpy() for v in self.embedder().embed(inputs, dims, norms))
        return [self._line(item, [next(vectors) for _ in item.token_ids]) for item in queue]

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
