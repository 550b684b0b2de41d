"""Unusable or hostile model folders: refused before loading with exit 5 (the documented code
for a bad model), naming the file, tensor or config field; never a traceback nor "re-run the
same command" (a requeueing script would loop)."""

import json
import shutil
import struct

import pytest

from attacks import config_bombs
from batchgen.models import folder_checks
from batchgen.models.folder_checks import check_model_folder, read_header
from batchgen.models.loader import CheckpointError
from job_utils import batchgen, chat_rows, write_jsonl

ROOMY = (1 << 40, 1 << 40)
"""(memory, host memory) of a machine with room for any sane model: a terabyte each."""


def _copy(tiny_chat_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_chat_model, folder)
    return folder


def _no_weights(folder):
    (folder / "model.safetensors").unlink()
    return "no *.safetensors"


def _truncated_file(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return "it is truncated"


def _truncated_header(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    return "its header claims"


def _shape_mismatch(folder):
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += 1000
    (folder / "config.json").write_text(json.dumps(config))
    return "model.embed_tokens.weight"


def _no_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return "has no tokenizer"


def _quantized(method):
    def quantize(folder):
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
        (folder / "config.json").write_text(json.dumps(config))
        return f"quant_method {method!r}"
    return quantize


def _sentencepiece_only(folder):
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"a sentencepiece model")
    return "sentencepiece"


LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32
               + "\nsize 269060552\n")
"""What `git clone` without Git LFS leaves in place of a large file."""


def _lfs_pointer(name):
    def clone_without_lfs(folder):
        (folder / name).write_text(LFS_POINTER)
        return "git lfs pull"
    return clone_without_lfs


def _config_field(field, value, needle):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config[field] = value
        (folder / "config.json").write_text(json.dumps(config))
        return needle
    return edit


def _tokenizer_config_only(folder):
    (folder / "tokenizer.json").unlink()
    return "tokenizer_config.json but no vocabulary"


def _config_bomb(field):
    def bomb(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(config_bombs()[field])
        (folder / "config.json").write_text(json.dumps(config))
        return field
    return bomb


BROKEN = {"no_weights": _no_weights, "truncated_file": _truncated_file,
          "truncated_header": _truncated_header, "shape_mismatch": _shape_mismatch,
          "no_tokenizer": _no_tokenizer, "layers_bomb": _config_bomb("num_hidden_layers"),
          "hidden_bomb": _config_bomb("hidden_size"), "awq": _quantized("awq"),
          "bitsandbytes": _quantized("bitsandbytes"), "sentencepiece": _sentencepiece_only,
          "lfs_weights": _lfs_pointer("model.safetensors"),
          "lfs_tokenizer": _lfs_pointer("tokenizer.json"),
          "unknown_rope": _config_field("rope_parameters", {"rope_type": "superrope",
                                                            "rope_theta": 1e4}, "'superrope'"),
          "unknown_model_type": _config_field("model_type", "smollm",
                                              "set \"model_type\": \"llama\""),
          "tokenizer_config_only": _tokenizer_config_only}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_an_unusable_model_folder_exits_5_naming_what_is_wrong(tmp_path, tiny_chat_model,
                                                               damage):
    folder = _copy(tiny_chat_model, tmp_path)
    needle = BROKEN[damage](folder)
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2, max_tokens=3))
    done = batchgen("run", "--input", inp, "--model", folder, "--storage-path", tmp_path / "s",
                    timeout=120)
    assert done.returncode == 5, done.stderr[-3000:]
    assert needle in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "re-run the same command" not in done.stderr
    assert "loading" not in done.stderr  # refused before any weight was read


def test_the_intact_model_passes_the_checks(tiny_chat_model):
    check_model_folder(tiny_chat_model, *ROOMY)


def test_a_sentencepiece_tokenizer_passes_where_sentencepiece_is_installed(
        tiny_chat_model, tmp_path, monkeypatch):
    folder = _copy(tiny_chat_model, tmp_path)
    _sentencepiece_only(folder)
    monkeypatch.setattr(folder_checks, "sentencepiece_installed", lambda: True)
    check_model_folder(folder, *ROOMY)


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors", "mxfp4", "FP8"])
def test_quantizations_batchgen_reads_pass_the_checks(tiny_chat_model, tmp_path, method):
    folder = _copy(tiny_chat_model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (folder / "config.json").write_text(json.dumps(config))
    check_model_folder(folder, *ROOMY)


def test_a_truncated_file_names_the_tensor_cut_off(tiny_chat_model, tmp_path):
    folder = _copy(tiny_chat_model, tmp_path)
    path = folder / "model.safetensors"
    tensors = read_header(path)
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    path.write_bytes(path.read_bytes()[:8 + length + 16])  # the first bytes of data only
    with pytest.raises(CheckpointError) as err:
        check_model_folder(folder, *ROOMY)
    assert str(path) in str(err.value) and any(repr(name) in str(err.value) for name in tensors)


def test_a_context_bomb_is_refused_by_what_the_host_has(tiny_chat_model, tmp_path):
    folder = _copy(tiny_chat_model, tmp_path)
    _config_bomb("max_position_embeddings")(folder)
    with pytest.raises(CheckpointError, match="max_position_embeddings 30000000"):
        check_model_folder(folder, 64 << 30, 16 << 30)  # a 16 GB host
    check_model_folder(folder, 4 << 40, 2 << 40)  # a 2 TB host has room for its tables


def test_a_config_asking_for_more_than_the_machine_has_is_refused(tiny_chat_model, tmp_path):
    folder = _copy(tiny_chat_model, tmp_path)
    _config_bomb("hidden_size")(folder)
    with pytest.raises(CheckpointError, match="hidden_size 1000000"):
        check_model_folder(folder, 64 << 30, 16 << 30)


def test_config_fields_must_be_positive_integers(tiny_chat_model, tmp_path):
    folder = _copy(tiny_chat_model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = -3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_hidden_layers must be a positive integer"):
        check_model_folder(folder, *ROOMY)


def _with_config(tiny_chat_model, tmp_path, **fields):
    folder = _copy(tiny_chat_model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("fields, where", [
    ({"rope_parameters": {"rope_type": "superrope", "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": None, "rope_scaling": {"type": "superrope", "factor": 2.0}},
     "rope_scaling"),
    ({"rope_parameters": {"full_attention": {"rope_type": "superrope"},
                          "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention")])
def test_an_unknown_rope_type_is_refused_naming_the_supported_ones(tiny_chat_model, tmp_path,
                                                                   fields, where):
    folder = _with_config(tiny_chat_model, tmp_path, **fields)
    with pytest.raises(CheckpointError) as err:
        check_model_folder(folder, *ROOMY)
    message = str(err.value)
    assert f"{where} has rope_type 'superrope'" in message, message
    assert "default, dynamic, linear, llama3" in message and "yarn" in message, message


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                                  {"type": "linear", "factor": 2.0}, {"type": "su"}, {}])
def test_rope_types_batchgen_computes_pass_the_checks(tiny_chat_model, tmp_path, rope):
    check_model_folder(_with_config(tiny_chat_model, tmp_path, rope_scaling=rope,
                                    rope_parameters=None), *ROOMY)


def test_a_model_type_transformers_knows_passes_whatever_the_architecture(tiny_chat_model,
                                                                         tmp_path):
    check_model_folder(_with_config(tiny_chat_model, tmp_path, model_type="mistral"), *ROOMY)


@pytest.mark.parametrize("vocabulary", ["tokenizer.model", "vocab.json"])
def test_tokenizer_config_beside_a_vocabulary_file_passes(tiny_chat_model, tmp_path,
                                                          monkeypatch, vocabulary):
    folder = _copy(tiny_chat_model, tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / vocabulary).write_bytes(b"a vocabulary")
    monkeypatch.setattr(folder_checks, "sentencepiece_installed", lambda: True)
    check_model_folder(folder, *ROOMY)


@pytest.mark.parametrize("heads,kv_heads,tp,ok", [
    (4, 2, 2, True), (4, 2, 4, True), (4, 1, 4, True), (32, 8, 16, True), (4, 2, 3, False),
    (6, 4, 3, False), (32, 8, 6, False)])
def test_the_head_split_is_checked_against_the_tensor_parallel_size(heads, kv_heads, tp, ok):
    config = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if ok:
        folder_checks.check_head_split(config, tp, "config.json")
        return
    with pytest.raises(CheckpointError, match=f"--tensor-parallel-size {tp} cannot split"):
        folder_checks.check_head_split(config, tp, "config.json")


def test_a_tensor_parallel_size_that_cannot_split_the_heads_is_refused_before_launch(
        tmp_path, tiny_chat_model):
    config = json.loads((tiny_chat_model / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tp = heads + 1
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2, max_tokens=3))
    done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                    tmp_path / "s", "--world-size", tp, "--tensor-parallel-size", tp,
                    timeout=120)
    assert done.returncode == 5, done.stderr[-3000:]
    assert (f"num_attention_heads {heads}, num_key_value_heads {kv_heads}): choose one of"
            in done.stderr), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "worker" not in done.stderr.lower()


def test_a_yarn_context_too_long_for_the_hosts_rotary_tables_is_refused(tiny_chat_model,
                                                                          tmp_path):
    """YaRN's context is original_max_position_embeddings x factor: a factor that asks for
    rotary tables past the host's memory is refused naming both, like max_position_embeddings."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 1e6,
            "original_max_position_embeddings": 131072}
    folder = _with_config(tiny_chat_model, tmp_path, rope_scaling=rope, rope_parameters=None)
    with pytest.raises(CheckpointError, match="original_max_position_embeddings x factor"):
        check_model_folder(folder, *ROOMY)
