"""Embeddings lines as vLLM users write them: vLLM's fields that change a vector are read
(`normalize`) or refused, never ignored; the model folder's sentence-transformers files that
bound or describe its inputs (max_seq_length, prompts) are honoured or named in the log."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.engine.embed import Embedder, Pooling, pooling_summary, prompt_note
from batchgen.io.embeddings import EmbeddingRequest
from batchgen.io.intake import IntakeError, intake
from batchgen.io.reader import RawRecord
from batchgen.models.factory import load_model
from batchgen.io.field_hints import unknown_fields
from batchgen.runner.worker.embed_jobs import EmbeddingJobs
from tiny_models import save_tiny_model


class _Tok:
    def __len__(self):
        return 100

    def encode(self, text):
        return [ord(c) % 90 + 3 for c in text] + [2]


def _line(body):
    return RawRecord(3, {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
                         "body": body})


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-fields"), seed=3)
    return load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))


@pytest.mark.parametrize("field, value", [
    ("truncate_prompt_tokens", 8), ("truncate_prompt_tokens", -1),
    ("add_special_tokens", False), ("embed_dtype", "float16"), ("endianness", "big"),
])
def test_vllm_fields_that_would_change_the_vector_are_refused(field, value):
    """vLLM reads these on /v1/embeddings: answering as if they were absent would give
    another vector (untruncated, with the EOS, float32) under the same line."""
    err = intake(_line({"input": "hello", field: value}), _Tok(), 32)
    assert isinstance(err, IntakeError) and err.code == "invalid_request", err
    assert err.param == field and f"drop {field}" in err.message
    assert not unknown_fields({"custom_id": "e1", "url": "/v1/embeddings",
                               "body": {"input": "x", field: value}})


@pytest.mark.parametrize("field, value", [
    ("truncate_prompt_tokens", None), ("add_special_tokens", True),
    ("embed_dtype", "float32"), ("endianness", "little"), ("endianness", "native"),
])
def test_their_values_that_change_nothing_pass(field, value):
    item = intake(_line({"input": "hello", field: value}), _Tok(), 32)
    assert isinstance(item, EmbeddingRequest), item


def test_normalize_is_read_and_kept_through_tokenization():
    item = intake(_line({"input": "hello", "normalize": False}), _Tok(), 32)
    assert isinstance(item, EmbeddingRequest) and item.normalize is False and item.token_ids
    assert intake(_line({"input": "hello"}), _Tok(), 32).normalize is None
    err = intake(_line({"input": "hello", "normalize": "yes"}), _Tok(), 32)
    assert isinstance(err, IntakeError) and err.param == "normalize", err


def test_normalize_overrides_the_folders_choice_per_line(qwen3):
    inputs = [(5, 9, 11, 40), (5, 9, 11, 40), (5, 9, 11, 40)]
    raw = Embedder(qwen3.model, Pooling("mean", False)).embed(inputs[:1])[0]
    assert abs(float(raw.norm()) - 1.0) > 1e-3
    unit = torch.nn.functional.normalize(raw, dim=0)
    got = Embedder(qwen3.model, Pooling("mean", True)).embed(inputs, None, [False, None, True])
    torch.testing.assert_close(got[0], raw)
    torch.testing.assert_close(got[1], unit)
    got = Embedder(qwen3.model, Pooling("mean", False)).embed(inputs, [8, 8, None],
                                                              [True, None, None])
    torch.testing.assert_close(got[0], torch.nn.functional.normalize(raw[:8], dim=0))
    torch.testing.assert_close(got[1], raw[:8])


def _loaded(qwen3, folder):
    """The model of `qwen3` as if loaded from `folder` (its sentence-transformers files)."""
    return SimpleNamespace(model=qwen3.model, hf_config=qwen3.hf_config, folder=folder,
                           name="m")


def test_a_line_asking_for_normalize_false_gets_raw_vectors(qwen3, tmp_path):
    """The worker hands each line's `normalize` to the embedder."""
    jobs = EmbeddingJobs(_loaded(qwen3, tmp_path), "batch_e", 8192)
    ids = ((5, 9, 11, 40),)
    for cid, normalize in (("raw", False), ("unit", None)):
        assert jobs.add(EmbeddingRequest(cid, 1, ids, "float", None, ids, normalize)) is None
    lines = {line["custom_id"]: line for line, _ in jobs.run()}
    norms = {cid: float(torch.tensor(line["response"]["body"]["data"][0]["embedding"]).norm())
             for cid, line in lines.items()}
    assert abs(norms["unit"] - 1.0) < 1e-5 and abs(norms["raw"] - 1.0) > 1e-3


def test_sentence_bert_max_seq_length_bounds_inputs(qwen3, tmp_path):
    """sentence-transformers never feeds more than max_seq_length tokens (vLLM takes it as the
    model's length): a longer input is context_length_exceeded, not a vector of tokens the
    model was never trained on."""
    (tmp_path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 8, "do_lower_case": False}))
    jobs = EmbeddingJobs(_loaded(qwen3, tmp_path), "batch_e", 8192)
    fits = EmbeddingRequest("a", 1, ((5,) * 8,), "float", None, ((5,) * 8,))
    assert jobs.add(fits) is None
    long = replace(fits, custom_id="b", inputs=((5,), (5,) * 9), token_ids=((5,), (5,) * 9))
    err = jobs.add(long)
    assert isinstance(err, IntakeError) and err.code == "context_length_exceeded", err
    assert err.param == "input[1]" and "max_seq_length (sentence_bert_config.json) is 8" in (
        err.message)
    assert len(jobs) == 1


def test_the_pooling_and_its_source_are_logged(qwen3, tmp_path, caplog):
    """A folder without sentence-transformers files is pooled by a default: the log says
    which, and that it is the default."""
    with caplog.at_level(logging.INFO, logger="batchgen.worker"):
        EmbeddingJobs(_loaded(qwen3, tmp_path), "batch_e", 8192).embedder()
    assert ("last-token pooling, L2-normalised (no modules.json: the default of decoder "
            "embedding models)") in caplog.text
    (tmp_path / "modules.json").write_text("[]")
    assert pooling_summary(tmp_path, Pooling("mean", False)) == (
        f"mean pooling, not normalised (from {tmp_path / 'modules.json'})")


def test_prompts_of_config_sentence_transformers_are_named(tmp_path):
    """sentence-transformers adds a default prompt to every text; batchgen (as vLLM) adds
    none: a warning says so. Listed prompts without a default are noted at info."""
    assert prompt_note(tmp_path) is None
    path = tmp_path / "config_sentence_transformers.json"
    path.write_text(json.dumps({"prompts": {"query": "Instruct: find\nQuery:", "document": ""},
                                "default_prompt_name": None}))
    level, note = prompt_note(tmp_path)
    assert level == logging.INFO and "'query'" in note and "'document'" not in note
    path.write_text(json.dumps({"prompts": {"query": "query: ", "document": "passage: "},
                                "default_prompt_name": "document"}))
    level, note = prompt_note(tmp_path)
    assert level == logging.WARNING and "'passage: '" in note
    path.write_text(json.dumps({"prompts": {}, "default_prompt_name": None}))
    assert prompt_note(tmp_path) is None
