"""Embedding jobs: /v1/embeddings lines parsed and answered as OpenAI does, pooling read from
sentence-transformers files, vectors equal to transformers' on a tiny random Qwen3, and a job
file of embeddings lines that runs and resumes like any job."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.engine.embed import Embedder, EmbeddingModelError, Pooling, read_pooling
from batchgen.io.embeddings import (EmbeddingLineError, EmbeddingRequest, check_dimensions,
                                    embeddings_body)
from batchgen.io.intake import IntakeError, intake, parse_record
from batchgen.io.reader import RawRecord
from batchgen.models.factory import load_model
from tiny_models import save_tiny_model


def embedding_line(body, custom_id="e1"):
    return RawRecord(3, {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                         "body": body})


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-embed"), seed=3)


@pytest.fixture(scope="module")
def qwen3(qwen3_folder):
    return load_model(ModelConfig(model=str(qwen3_folder), dtype="float32"), torch.device("cpu"))


def _hf_embeddings(folder, inputs, pooling="last"):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in inputs:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0),
                      "max": hidden.amax(0)}[pooling]
            out.append(torch.nn.functional.normalize(vector, dim=0))
    return out


@pytest.mark.parametrize("max_step_tokens", [8192, 40])  # one packed step; several steps
def test_last_token_pooling_matches_transformers(qwen3, qwen3_folder, max_step_tokens):
    rng = np.random.default_rng(0)
    inputs = [tuple(int(t) for t in rng.integers(3, 500, n)) for n in (1, 7, 64, 65, 130, 33)]
    embedder = Embedder(qwen3.model, Pooling("last", True), max_step_tokens)
    ours = embedder.embed(inputs)
    for a, b in zip(ours, _hf_embeddings(qwen3_folder, inputs)):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.9999
        assert abs(float(a.norm()) - 1.0) < 1e-5


LENGTHS = (65, 1, 130, 7, 64, 33, 2, 90)
"""Mixed lengths, not in length order: steps regroup them, vectors must come back in order."""


@pytest.mark.parametrize("mode", ["last", "mean", "cls", "max"])
@pytest.mark.parametrize("max_step_tokens", [8192, 200])  # one dense step; several
def test_dense_steps_pool_like_the_paged_path_and_transformers(qwen3, qwen3_folder, mode,
                                                               max_step_tokens):
    rng = np.random.default_rng(1)
    inputs = [tuple(int(t) for t in rng.integers(3, 500, n)) for n in LENGTHS]
    dense = Embedder(qwen3.model, Pooling(mode, False), max_step_tokens)
    ours = dense.embed(inputs)
    assert dense.dense and dense._pool is None  # no KV pool was ever made
    paged = Embedder(qwen3.model, Pooling(mode, False), max_step_tokens, paged=True)
    for a, b in zip(ours, paged.embed(inputs)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    hf = _hf_embeddings(qwen3_folder, inputs, mode)
    for a, b in zip(ours, hf):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.9999


def test_dense_steps_group_inputs_of_similar_length_under_the_budget(qwen3):
    inputs = [(5,) * n for n in (100, 3, 50, 4, 98, 300)]
    steps = Embedder(qwen3.model, Pooling("last", True), 200)._steps(inputs)
    assert steps == [[1, 3, 2], [4, 0], [5]]  # shortest first; 300 alone, over the budget
    paged = Embedder(qwen3.model, Pooling("last", True), 200, paged=True)._steps(inputs)
    assert paged == [[0, 1, 2, 3], [4], [5]]  # packed in order, no padding counted


def test_latent_kv_models_embed_through_the_paged_path(tmp_path):
    from test_deepseek import save_tiny

    hf = save_tiny(tmp_path, seed=2)
    model = load_model(ModelConfig(model=str(tmp_path), dtype="float32"),
                       torch.device("cpu")).model
    embedder = Embedder(model, Pooling("last", True))
    assert not embedder.dense
    inputs = [(5, 9, 11, 40), tuple(range(3, 80)), (7,)]
    with torch.inference_mode():
        for got, ids in zip(embedder.embed(inputs), inputs):
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
            expected = torch.nn.functional.normalize(hidden, dim=0)
            assert torch.nn.functional.cosine_similarity(got, expected, dim=0) >= 0.9999


def test_mean_pooling_and_matryoshka_cut(qwen3, qwen3_folder):
    inputs = [(5, 9, 11, 40), (7,) * 70]
    ours = Embedder(qwen3.model, Pooling("mean", True)).embed(inputs, [None, 16])
    theirs = _hf_embeddings(qwen3_folder, inputs, "mean")
    assert torch.nn.functional.cosine_similarity(ours[0], theirs[0], dim=0) >= 0.9999
    assert ours[1].shape == (16,) and abs(float(ours[1].norm()) - 1.0) < 1e-5
    full = Embedder(qwen3.model, Pooling("mean", False)).embed(inputs[1:])[0]
    cut = torch.nn.functional.normalize(full[:16], dim=0)
    assert torch.allclose(ours[1], cut, atol=1e-6)


def test_pooling_is_read_from_sentence_transformers_files(tmp_path, qwen3):
    cfg = qwen3.hf_config
    assert read_pooling(tmp_path, cfg) == Pooling("last", True, None)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False, "pooling_mode_cls_token": False}))
    assert read_pooling(tmp_path, cfg) == Pooling("mean", False, None)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling(tmp_path, cfg).normalize
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(EmbeddingModelError, match="pooling"):
        read_pooling(tmp_path, cfg)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(  # the one-string form
        {"word_embedding_dimension": 64, "pooling_mode": "lasttoken"}))
    assert read_pooling(tmp_path, cfg) == Pooling("last", True, None)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode": "weightedmean"}))
    with pytest.raises(EmbeddingModelError, match=r"pooling \['weightedmean'\]: batchgen "
                                                  "pools one way, of lasttoken, mean, cls, max"):
        read_pooling(tmp_path, cfg)
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EmbeddingModelError, match="Dense"):
        read_pooling(tmp_path, cfg)
    (tmp_path / "modules.json").write_text(json.dumps([modules[0], modules[2]]))
    with pytest.raises(EmbeddingModelError, match="lists no Pooling module"):  # Normalize only
        read_pooling(tmp_path, cfg)


@pytest.mark.parametrize("modules, pooling_config, named", [
    ([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], None,
     "1_Pooling/config.json"),
    ({"0": {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}}, "{}",
     "modules.json"),
    ('[{"type": ', None, "modules.json"),
    ([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], "[true]",
     "1_Pooling/config.json"),
])
def test_unreadable_sentence_transformers_files_are_model_errors(tmp_path, modules,
                                                                 pooling_config, named):
    """A missing or malformed modules.json / Pooling config is the model folder's fault: an
    EmbeddingModelError naming the file (the line's error `unsupported_model`), never an
    OSError or AttributeError that crashes the worker on every run."""
    from types import SimpleNamespace

    text = modules if isinstance(modules, str) else json.dumps(modules)
    (tmp_path / "modules.json").write_text(text)
    if pooling_config is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(pooling_config)
    with pytest.raises(EmbeddingModelError, match=named):
        read_pooling(tmp_path, SimpleNamespace())


class _Tok:
    def __len__(self):
        return 100

    def encode(self, text):
        return [ord(c) % 90 + 3 for c in text] + [2]


@pytest.mark.parametrize("value, expected", [
    ("hi", [[3 + ord("h") % 90, 3 + ord("i") % 90, 2]]),
    (["a", "b"], [[3 + ord("a") % 90, 2], [3 + ord("b") % 90, 2]]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_input_shapes(value, expected):
    item = intake(embedding_line({"input": value}), _Tok(), 32)
    assert isinstance(item, EmbeddingRequest), item
    assert [list(t) for t in item.token_ids] == expected
    assert item.prompt_tokens == sum(map(len, expected))


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [1, "a"]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": [[500]]}, "input"),
    ({"input": "x" * 40}, "input"), ({"input": "x", "stream": True}, "stream"),
])
def test_bad_embedding_lines_name_the_field(body, param):
    item = intake(embedding_line(body), _Tok(), 32)
    assert isinstance(item, IntakeError) and item.param == param, item


@pytest.mark.parametrize("value, says", [
    (["a", ""], "input[1] is ''"), (["a", [5, 6]], "mixes strings and token-id lists"),
    ([[5], []], "input[1] is []"), ([-1, 5], "input[0] is token id -1"),
    ([5, 2.5], "input[1] is token id 2.5"), ([[5], "b"], "mixes"),
    ([5, None, 7], "input[1] is None: input is a list of token ids"),  # not input[0], a good id
    ([5, "a"], "input[1] is 'a'"), ([5, [6]], "input[1] is [6]"),
])
def test_a_bad_input_item_is_named(value, says):
    """OpenAI's input is a string, strings, token ids or token-id lists: a mix, or a bad
    item, is refused naming the item."""
    err = intake(embedding_line({"input": value}), _Tok(), 32)
    assert isinstance(err, IntakeError) and err.param == "input" and says in err.message, err


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": "9" * 100_000}, "dimensions"),
    ({"input": "x", "encoding_format": "f" * 100_000}, "encoding_format"),
    ({"input": "x", "normalize": "t" * 100_000}, "normalize"),
    ({"input": ["ok", [0.5] * 100_000]}, "input"),
])
def test_a_long_bad_value_is_quoted_in_part(body, param):
    """The message quotes a bad value as refused fields' messages do, in part: a field of
    100,000 characters made an error line (and a `batchgen validate` line) as long."""
    err = intake(embedding_line(body), _Tok(), 32)
    assert isinstance(err, IntakeError) and err.param == param, err
    assert len(err.message) < 300, err.message[:300]


def test_dimensions_past_the_model_quote_a_huge_number_in_part():
    item = parse_record(embedding_line({"input": "x", "dimensions": 1e300}))
    with pytest.raises(EmbeddingLineError, match="at most 64") as err:
        check_dimensions(item, 64)
    assert len(str(err.value)) < 200


class _CountingTok(_Tok):
    def __init__(self):
        self.chars = 0

    def encode(self, text):
        self.chars += len(text)
        return super().encode(text)


@pytest.mark.parametrize("value, param", [("x" * (32 * 128 + 1), "input"),
                                          (["a", "x" * (32 * 128 + 1)], "input[1]")])
def test_a_text_no_context_could_hold_is_refused_without_tokenizing(value, param):
    """As a prompt is: tokenizing costs ~100 bytes of memory per character, so an input over
    128 characters per token of the context (an 8 MiB line: ~1 GB) is never tokenized."""
    tokenizer = _CountingTok()
    err = intake(embedding_line({"input": value}), tokenizer, 32)
    assert isinstance(err, IntakeError) and err.code == "context_length_exceeded", err
    assert err.param == param and "without tokenizing" in err.message
    assert tokenizer.chars < 10


@pytest.mark.parametrize("data, says", [
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"inputs": "x"}},
     "has 'inputs': rename it to input"),  # Hugging Face TEI's name
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"texts": ["x"]}},
     "has 'texts': rename it to input"),  # Cohere's
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"Input": "x"}},
     "has 'Input': rename it to input"),
    ({"custom_id": "e", "inputs": ["x"]}, "has 'inputs': rename it to input"),  # a plain line
])
def test_an_input_under_another_name_is_named_with_the_rename(data, says):
    """Other embedding APIs call the field `inputs` or `texts`: "needs input" alone leaves the
    user to find what is wrong with a line that visibly holds its texts."""
    err = parse_record(RawRecord(4, data))
    assert isinstance(err, IntakeError) and says in err.message, err
    plain = parse_record(RawRecord(5, {"custom_id": "e", "method": "POST",
                                       "url": "/v1/embeddings", "body": {"model": "m"}}))
    assert plain.message == "line 5: an embeddings line needs input"


@pytest.mark.parametrize("data, says", [
    ({"custom_id": "q", "text": "Why?"}, "; this one has 'text': rename it to prompt"),
    ({"Question": "Why?", "answer": "-"}, "; this one has 'Question': rename it to prompt"),
    ({"conversations": [{"from": "human", "value": "hi"}]},
     "; this one has 'conversations': rename it to messages (a list of {role, content} "
     "objects)"),
])
def test_a_plain_line_with_its_prompt_under_another_name_is_told_the_rename(data, says):
    err = parse_record(RawRecord(2, data))
    assert isinstance(err, IntakeError) and err.message.endswith(says), err
    assert err.code == "invalid_messages"
    bare = parse_record(RawRecord(3, {"custom_id": "q", "answer": "-"}))
    assert bare.message.endswith("or input (embeddings)")


def test_plain_lines_with_input_are_embeddings():
    item = parse_record(RawRecord(1, {"custom_id": "p", "input": "hello"}))
    assert isinstance(item, EmbeddingRequest) and item.inputs == ("hello",)


def test_dimensions_are_checked_against_the_model():
    item = EmbeddingRequest("c", 1, ("x",), "float", 32)
    check_dimensions(item, 64)
    with pytest.raises(EmbeddingLineError, match="at most 64"):
        check_dimensions(EmbeddingRequest("c", 1, ("x",), "float", 65), 64)
    with pytest.raises(EmbeddingLineError, match="one of"):
        check_dimensions(item, 64, (16, 64))


def test_embeddings_object_float_and_base64():
    request = EmbeddingRequest("c", 1, ("a", "b"), "base64", None, ((1, 2), (3,)))
    vectors = [np.array([0.5, -1.25], dtype=np.float32), np.array([2.0, 3.0], np.float32)]
    body = embeddings_body(request, vectors, "org/emb")
    assert body["object"] == "list" and body["model"] == "org/emb"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert raw.tolist() == [0.5, -1.25]
    floats = embeddings_body(EmbeddingRequest("c", 1, ("a",), "float", None, ((1,),)),
                             vectors[:1], "m")
    assert floats["data"][0]["embedding"] == [0.5, -1.25]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    """A tiny random Qwen3 with SmolLM2's real tokenizer: a job-ready embedding model."""
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    folder = save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-job"), seed=5,
                             vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(folder))
    return folder, tokenizer


def _job_rows():
    texts = ["the sea", "a mountain at dawn", "bread", "rain on a tin roof", "owls", "snow"]
    rows = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "m", "input": text}} for i, text in enumerate(texts)]
    rows.append({"custom_id": "many", "method": "POST", "url": "/v1/embeddings",
                 "body": {"input": texts[:3], "encoding_format": "base64"}})
    rows.append({"custom_id": "ids", "method": "POST", "url": "/v1/embeddings",
                 "body": {"input": [[5, 6, 7], [8]], "dimensions": 16}})
    rows.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4}})
    rows.append({"custom_id": "cmpl", "model": "gpt-3.5-turbo-instruct", "prompt": "Once",
                 "max_tokens": 3})
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                 "body": {"input": "x", "dimensions": 4096}})
    return texts, rows


def test_mixed_job_file_answers_embeddings_like_transformers_and_resumes(embed_model, tmp_path):
    from job_utils import batchgen, read_jsonl, write_jsonl

    folder, tokenizer = embed_model
    texts, rows = _job_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    storage, out = tmp_path / "s", tmp_path / "out.jsonl"
    args = ["run", "--input", inp, "--storage-path", storage, "--model", folder,
            "--output", out, "--dtype", "float32", "--device", "cpu"]
    batchgen(*args, check=True)
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    errors = read_jsonl(out.with_name("out.errors.jsonl"))
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["body"]["error"]["param"] == "dimensions"
    assert results["chat"]["response"]["body"]["object"] == "chat.completion"
    assert results["cmpl"]["response"]["body"]["object"] == "text_completion"
    # Every answer names the model that answered, not the one a line asked for.
    assert {results[c]["response"]["body"]["model"] for c in ("chat", "cmpl")} == {str(folder)}
    ids = [tokenizer.encode(t) for t in texts]
    expected = _hf_embeddings(folder, ids)
    for i, vector in enumerate(expected):
        body = results[f"e{i}"]["response"]["body"]
        assert body["object"] == "list" and body["model"] == str(folder)
        assert body["usage"] == {"prompt_tokens": len(ids[i]), "total_tokens": len(ids[i])}
        got = torch.tensor(body["data"][0]["embedding"])
        assert torch.nn.functional.cosine_similarity(got, vector, dim=0) >= 0.9999
    many = results["many"]["response"]["body"]["data"]
    assert [d["index"] for d in many] == [0, 1, 2]
    for d, vector in zip(many, expected):
        got = torch.from_numpy(np.frombuffer(base64.b64decode(d["embedding"]), "<f4").copy())
        assert torch.nn.functional.cosine_similarity(got, vector, dim=0) >= 0.9999
    assert [len(d["embedding"]) for d in results["ids"]["response"]["body"]["data"]] == [16, 16]

    # Killed after two results were saved: the rerun keeps them and computes only the rest.
    incremental = next((storage / "incremental").glob("*.jsonl"))
    kept = b"".join(incremental.read_bytes().splitlines(keepends=True)[:2])
    incremental.write_bytes(kept)
    batch_id = incremental.name.split(".")[0]
    record = storage / "batches" / f"{batch_id}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "in_progress"}))
    first = out.read_bytes()
    out.unlink()
    batchgen(*args, check=True)
    assert incremental.read_bytes().startswith(kept)
    assert len(incremental.read_bytes().splitlines()) == len(rows)
    assert out.read_bytes() == first


def test_an_embeddings_only_job_sizes_no_kv_pool_for_its_lines(embed_model, tmp_path):
    """Embeddings keep no KV: a job of embeddings lines only takes one request's pages (the
    host pool is pinned on a GPU node; sized for every line, it took up to 90% of host memory
    for nothing), whatever its number of lines."""
    import re

    from job_utils import batchgen, write_jsonl

    folder, _ = embed_model
    rows = [{"custom_id": f"e{i}", "input": f"text {i}"} for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    proc = batchgen("run", "--input", inp, "--output", tmp_path / "out.jsonl", "--model", folder,
                    "--dtype", "float32", "--device", "cpu", check=True)
    pools = re.search(r"KV pools: device (\d+) pages .* host (\d+) pages", proc.stderr)
    assert pools, proc.stderr[-2000:]
    context_pages = 1024 // 64  # one request of the model's whole context
    assert [int(n) for n in pools.groups()] == [context_pages, context_pages]


def test_bench_embeddings_mode_runs_tiny_on_cpu_and_agrees_with_transformers():
    from batchgen.bench_embed import EmbedBench, format_table, run

    report = run(EmbedBench(requests=6, input_len=20, max_step_tokens=50, peer_batch=4,
                            device="cpu", tiny=True))
    assert report["min_cosine"] >= 0.9999
    assert report["ours"]["tokens_per_s"] > 0 and report["hf"]["tokens_per_s"] > 0
    assert report["paged"]["tokens_per_s"] > 0 and "paged path" in format_table(report)
    assert report["speedup"] == pytest.approx(report["hf"]["seconds"] / report["ours"]["seconds"])
    assert "speedup" in format_table(report)
    with pytest.raises(ValueError, match="qwen3-embedding-0.6b"):
        run(EmbedBench(shape="llama3-8b", tiny=True))


def test_bench_cli_mode_is_checked():
    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--mode", "rerank"])
    assert result.exit_code == 2 and "generate or embeddings" in result.output


def test_dense_steps_of_a_model_with_windows_and_sinks_match_transformers(tmp_path):
    """gpt-oss: sliding-window layers, attention sinks and MoE over padded rows, with inputs
    longer than the window grouped with short ones."""
    from transformers import GptOssForCausalLM

    from test_gpt_oss import WINDOW, load_ours, randomize_biases, tiny_config

    torch.manual_seed(0)
    hf = GptOssForCausalLM(tiny_config()).float().eval()
    randomize_biases(hf, torch.Generator().manual_seed(1))
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    embedder = Embedder(load_ours(tmp_path), Pooling("mean", False), 4 * WINDOW * 3)
    assert embedder.dense
    gen = torch.Generator().manual_seed(4)
    inputs = [tuple(torch.randint(3, 500, (n,), generator=gen).tolist())
              for n in (WINDOW + 9, 3, 3 * WINDOW, 17, 1)]
    with torch.inference_mode():
        for got, ids in zip(embedder.embed(inputs), inputs):
            expected = hf.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
            assert torch.nn.functional.cosine_similarity(got, expected, dim=0) >= 0.9999


def _save_bare_stack(family: str, folder, vocab_size: int = 512, architecture: str | None = None):
    """A decoder stack saved without its LM head (AutoModel), as embedding models ship:
    tensors named `layers.0...` with no `model.` prefix; `architecture` rewrites config.json's
    (Qwen3-Embedding says Qwen3ForCausalLM over such tensors)."""
    from transformers import AutoModel

    from tiny_models import tiny_config

    config = tiny_config(family)
    config.vocab_size = vocab_size
    torch.manual_seed(4)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(
        str(folder), safe_serialization=True)
    if architecture:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()),
                                    "architectures": [architecture]}))
    return folder


@pytest.mark.parametrize("family, architecture, generates", [
    ("qwen2", None, True),                    # Qwen2Model, tied: its head is the embedding
    ("qwen3", "Qwen3ForCausalLM", False),     # Qwen3-Embedding's way: bare tensors, untied
    ("mistral", None, False),                 # MistralModel (e5-mistral): no head at all
])
def test_bare_decoder_stacks_embed_like_transformers(tmp_path, family, architecture, generates):
    folder = _save_bare_stack(family, tmp_path, architecture=architecture)
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    assert loaded.model.generates is generates
    rng = np.random.default_rng(2)
    inputs = [tuple(int(t) for t in rng.integers(3, 500, n)) for n in (1, 9, 70)]
    ours = Embedder(loaded.model, Pooling("last", True), 8192).embed(inputs)
    for a, b in zip(ours, _hf_embeddings(folder, inputs)):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.9999


def test_a_model_without_a_head_answers_embeddings_and_refuses_generation(tmp_path):
    from job_utils import batchgen, read_jsonl, write_jsonl
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    folder = _save_bare_stack("mistral", tmp_path / "model", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(folder))
    rows = [{"custom_id": "e", "url": "/v1/embeddings", "method": "POST",
             "body": {"input": "the sea"}},
            {"custom_id": "chat", "url": "/v1/chat/completions", "method": "POST",
             "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}]
    out = tmp_path / "out.jsonl"
    batchgen("run", "--input", write_jsonl(tmp_path / "in.jsonl", rows), "--storage-path",
             tmp_path / "s", "--model", folder, "--output", out, "--dtype", "float32",
             check=True)
    expected = _hf_embeddings(folder, [tokenizer.encode("the sea")])[0]
    got = torch.tensor(read_jsonl(out)[0]["response"]["body"]["data"][0]["embedding"])
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) >= 0.9999
    [error] = read_jsonl(out.with_name("out.errors.jsonl"))
    body = error["response"]["body"]["error"]
    assert error["custom_id"] == "chat" and body["code"] == "unsupported_model"
    assert "/v1/embeddings lines only" in body["message"] and body["param"] == "model"


def test_a_converted_model_without_a_head_stays_without_one(tmp_path):
    from batchgen.models.export import convert_model

    source = _save_bare_stack("mistral", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source), dtype="float32"), tmp_path / "conv")
    vectors = []
    for cfg in (ModelConfig(model=str(source), dtype="float32"),
                ModelConfig(converted_ckpt_dir=str(out), dtype="float32")):
        loaded = load_model(cfg, torch.device("cpu"))
        assert not loaded.model.generates
        vectors.append(Embedder(loaded.model, Pooling("last", True), 8192).embed([(5, 6, 7)]))
    torch.testing.assert_close(vectors[0], vectors[1])


def test_a_config_asking_for_bidirectional_attention_is_refused(tmp_path):
    from batchgen.models.loader import load_hf_config

    folder = _save_bare_stack("qwen3", tmp_path)
    assert read_pooling(folder, load_hf_config(folder)) == Pooling("last", True, None)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "is_causal": False}))
    with pytest.raises(EmbeddingModelError, match="is_causal: false"):
        read_pooling(folder, load_hf_config(folder))


def test_a_worker_embeds_a_bounded_share_of_its_queue_per_step(qwen3):
    """Queued embeddings lines are embedded about RUN_STEPS embedder steps of tokens at a time
    (at least one line), oldest first, so results are written as they are made and a stop
    loses at most one share; the vectors are those of one run over everything."""
    from batchgen.io.embeddings import tokenize_embedding
    from batchgen.io.intake import parse_record
    from batchgen.runner.worker.embed_jobs import RUN_STEPS, EmbeddingJobs

    def job(step_tokens):
        jobs = EmbeddingJobs(qwen3, "batch_e", step_tokens)
        for i in range(10):
            parsed = parse_record(RawRecord(i + 1, {"custom_id": f"e{i}",
                                                    "input": [list(range(3, 33 + i))]}))
            assert jobs.add(tokenize_embedding(parsed, None, 512, vocab=500)) is None
        return jobs

    small = job(16)
    shares = []
    while len(small):
        shares.append(small.run())
    assert [len(s) for s in shares] == [4, 3, 3]  # 128 tokens a share: 30 + 31 + 32 + 33, ...
    assert RUN_STEPS * 16 == 128
    lines = [line for share in shares for line, _ in share]
    assert [line["custom_id"] for line in lines] == [f"e{i}" for i in range(10)]
    whole = [line for line, _ in job(8192).run()]
    for got, want in zip(lines, whole):
        torch.testing.assert_close(torch.tensor(got["response"]["body"]["data"][0]["embedding"]),
                                   torch.tensor(want["response"]["body"]["data"][0]["embedding"]),
                                   rtol=0, atol=1e-5)
    one = EmbeddingJobs(qwen3, "batch_e", 1)  # a line over the share is a share of its own
    one.queue = job(8192).queue[:2]
    assert len(one.run()) == 1 and len(one) == 1


def test_a_share_is_sized_by_the_speed_of_the_last(qwen3, monkeypatch):
    """A share is about SHARE_SECONDS of work at the last share's speed: on a slow device
    (a laptop's CPU) results are written and a stop is answered within seconds, where a
    GPU-sized share (8 x 4 x --max-prefill-tokens) took minutes; a fast one grows to that
    size, at most 8x a step."""
    from batchgen.io.embeddings import tokenize_embedding
    from batchgen.io.intake import parse_record
    from batchgen.runner.worker import embed_jobs

    jobs = embed_jobs.EmbeddingJobs(qwen3, "batch_e", 8192)
    assert jobs.share_tokens == embed_jobs.FIRST_SHARE_TOKENS["cpu"] == 512  # qwen3: on the CPU
    for i in range(6):
        parsed = parse_record(RawRecord(i + 1, {"custom_id": f"e{i}", "input": [[5] * 40]}))
        assert jobs.add(tokenize_embedding(parsed, None, 512, vocab=500)) is None
    clock = iter([0.0, 100.0])  # the first share (all 6 lines, 240 tokens) takes 100 s
    monkeypatch.setattr(embed_jobs, "perf_counter", lambda: next(clock))
    assert len(jobs.run()) == 6
    assert jobs.share_tokens == int(240 / 100 * embed_jobs.SHARE_SECONDS)  # 4 tokens
    jobs._next_share(4096, 409.6)  # 10 tokens a second: 20 tokens, under one line
    jobs.queue = [tokenize_embedding(parse_record(RawRecord(9, {"custom_id": f"f{i}",
                                                                "input": [[5] * 30]})),
                                     None, 512, vocab=500) for i in range(3)]
    monkeypatch.setattr(embed_jobs, "perf_counter", lambda: 0.0)
    assert len(jobs.run()) == 1 and len(jobs) == 2  # at least one line a share
    jobs._next_share(4096, 0.001)
    assert jobs.share_tokens == 8 * 4096  # a fast device: 8x the last share
    jobs._next_share(8 * 4096, 0.001)
    assert jobs.share_tokens == embed_jobs.RUN_STEPS * 8192  # and no more than RUN_STEPS steps


def test_a_vector_that_is_not_finite_is_a_failure_line_not_nulls(qwen3, monkeypatch):
    """A model whose hidden states overflow (float16 past 65,504) pools NaN or inf: JSON has
    neither, and the line was written as status 200 with `null` values. It is a failure line
    naming the input and the fix; the other lines of the share are answered as usual."""
    from batchgen.io.embeddings import tokenize_embedding
    from batchgen.io.intake import parse_record
    from batchgen.io.results import dumps, is_success
    from batchgen.runner.worker.embed_jobs import EmbeddingJobs

    jobs = EmbeddingJobs(qwen3, "batch_e", 8192)
    for i, value in enumerate([[5, 6, 7], [[8, 9], [10, 11, 12]]]):
        parsed = parse_record(RawRecord(i + 1, {"custom_id": f"e{i}", "input": value}))
        assert jobs.add(tokenize_embedding(parsed, None, 512, vocab=500)) is None
    embedder = jobs.embedder()
    real = embedder.embed

    def overflowing(inputs, *args):
        vectors = real(inputs, *args)
        vectors[2][3] = float("nan")  # e1's second input
        return vectors

    monkeypatch.setattr(embedder, "embed", overflowing)
    (good, good_tokens), (bad, bad_tokens) = jobs.run()
    assert is_success(good) and good_tokens == 3
    written = json.loads(dumps(good))["response"]["body"]["data"][0]["embedding"]
    assert all(isinstance(x, float) for x in written)
    assert bad["response"] is None and bad_tokens == 0 and not is_success(bad)
    assert bad["custom_id"] == "e1" and bad["error"]["code"] == "non_finite_embedding"
    assert "input[1]" in bad["error"]["message"] and "float32" in bad["error"]["message"]


def test_the_pooling_files_are_part_of_the_resume_fingerprint(tmp_path):
    """Editing 1_Pooling/config.json changes what an embedding job answers: the weights
    signature (the job's fingerprint) changes with it, so a resume refuses the edited model
    instead of mixing vectors of two poolings. Other folders (onnx/, .cache/) do not count."""
    from batchgen.models.loader import weights_signature

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    plain = weights_signature(tmp_path)
    for other in ("onnx", ".cache"):
        (tmp_path / other).mkdir()
        (tmp_path / other / "config.json").write_text('{"x": 1}')
    assert weights_signature(tmp_path) == plain
    (tmp_path / "1_Pooling").mkdir()
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text('{"pooling_mode_lasttoken": true}')
    last = weights_signature(tmp_path)
    pooling.write_text('{"pooling_mode_mean_tokens": true}')
    assert len({plain, last, weights_signature(tmp_path)}) == 3


def test_a_refused_pooling_is_logged_once_and_each_line_says_it(tmp_path, caplog):
    """A model folder whose pooling batchgen cannot run: each embeddings line is the error
    unsupported_model, and the job's log says it once (it said nothing)."""
    from types import SimpleNamespace

    from batchgen.io.embeddings import tokenize_embedding
    from batchgen.runner.worker.embed_jobs import EmbeddingJobs

    (tmp_path / "modules.json").write_text('[{"type": ')
    loaded = SimpleNamespace(folder=tmp_path, hf_config=SimpleNamespace(),
                             model=torch.nn.Linear(1, 1))
    jobs = EmbeddingJobs(loaded, "batch_e", 64)
    with caplog.at_level("ERROR", logger="batchgen.worker"):
        for i in range(3):
            parsed = parse_record(RawRecord(i + 1, {"custom_id": f"e{i}", "input": [5, 6]}))
            err = jobs.add(tokenize_embedding(parsed, None, 512, vocab=500))
            assert isinstance(err, IntakeError) and err.code == "unsupported_model", err
            assert "modules.json" in err.message
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "cannot answer embeddings lines" in logged[0], logged
    assert len(jobs) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_dense_steps_on_cuda_match_transformers(qwen3_folder, mode):
    """The CUDA kernels of a dense step (q/k norms and RoPE in one pass, SDPA) give
    transformers' vectors."""
    model = load_model(ModelConfig(model=str(qwen3_folder), dtype="float32"),
                       torch.device("cuda")).model
    rng = np.random.default_rng(2)
    inputs = [tuple(int(t) for t in rng.integers(3, 500, n)) for n in LENGTHS]
    ours = Embedder(model, Pooling(mode, True), 200).embed(inputs)
    for a, b in zip(ours, _hf_embeddings(qwen3_folder, inputs, mode)):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.9999
