"""A GGUF's conversion cache: keyed by content (never a stale conversion, a renamed file reuses
its own), and files that cannot be converted or cached refused clearly before any dequantizing."""

import os
import shutil

import numpy as np
import pytest

from batchgen.models import convert
from batchgen.models.loader import MANIFEST, CheckpointError
from batchgen.models.registry import UnsupportedModelError


def write_tiny_gguf(path, arch="llama", seed=0, tokenizer: dict | None = None):
    """A 1-layer GGUF (byte-level vocabulary of 64 tokens, or the `tokenizer` fields given;
    hidden size 32) with the metadata transformers' GGUF loader reads."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden = 32
    vocab = len(tokenizer["tokenizer.ggml.tokens"]) if tokenizer else 64
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(hidden // 2)
    writer.add_value_length(hidden // 2)
    if tokenizer:
        writer.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
        writer.add_tokenizer_pre(tokenizer["tokenizer.ggml.pre"])
        writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
        writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
        writer.add_token_merges(tokenizer["tokenizer.ggml.merges"])
        writer.add_bos_token_id(tokenizer["tokenizer.ggml.bos_token_id"])
        writer.add_eos_token_id(tokenizer["tokenizer.ggml.eos_token_id"])
        writer.add_chat_template(tokenizer["tokenizer.chat_template"])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
        writer.add_token_merges([])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden),
              "blk.0.attn_v.weight": (hidden, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (64, hidden), "blk.0.ffn_up.weight": (64, hidden),
              "blk.0.ffn_down.weight": (hidden, 64)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_replaced_gguf_with_its_old_size_and_mtime_gets_a_new_key(tmp_path, monkeypatch):
    """cp -p, rsync -t, touch -r or an archive's stamps give a replacement the old file's
    mtime; with the same size it must still not reuse the old file's conversion."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"A" * 4096)
    old = path.stat()
    first = convert.source_key(path)
    replacement = tmp_path / "other.gguf"
    replacement.write_bytes(b"B" * 4096)
    os.replace(replacement, path)  # as `mv` or a download's rename puts it there
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert path.stat().st_size == old.st_size and path.stat().st_mtime_ns == old.st_mtime_ns
    assert convert.source_key(path) != first
    path.write_bytes(b"C" * 4096)  # rewritten in place (same inode), mtime set back
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert convert.source_key(path) == convert._content_key(path)


def test_a_renamed_gguf_reuses_its_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    first = tmp_path / "SmolLM2-Q4_0.gguf"
    first.write_bytes(b"gguf content" * 100)
    done = convert.default_cache_root() / f"SmolLM2-Q4_0-{convert.source_key(first)}"
    done.mkdir(parents=True)
    (done / MANIFEST).write_text("{}")
    renamed = tmp_path / "elsewhere" / "my-model.gguf"
    renamed.parent.mkdir()
    shutil.copy(first, renamed)

    def no_conversion(gguf, out_dir):
        raise AssertionError(f"converted {gguf} again into {out_dir}")

    monkeypatch.setattr(convert, "convert_gguf", no_conversion)
    assert convert.converted_for_gguf(renamed, None) == done


def test_a_float32_conversion_loads_at_a_lower_dtype(tmp_path):
    """Every GGUF conversion is float32: `--dtype bfloat16 --converted-ckpt-dir D` must accept
    the folder the same command converted into D (a lower-dtype folder stays refused for a
    higher --dtype: test_convert)."""
    manifest = {"format": convert.FORMAT, "version": convert.FORMAT_VERSION, "dtype": "float32",
                "world_size": 1, "tensor_parallel_size": 1}
    for dtype in ("bfloat16", "float16", "float32", "auto", None):
        convert.check_manifest(manifest, tmp_path, 1, dtype, 1)
    with pytest.raises(CheckpointError, match="--dtype float32"):
        convert.check_manifest({**manifest, "dtype": "bfloat16"}, tmp_path, 1, "float32", 1)


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "empty"])
def test_a_damaged_gguf_is_a_checkpoint_error(tmp_path, monkeypatch, damage):
    """exit 5 naming the file, not a traceback from transformers' reader."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) * 2 // 3], "not_gguf": b"<html>404</html>",
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="cannot convert .*model.gguf"):
        convert.converted_for_gguf(path, None)
    assert not [p for p in convert.default_cache_root().iterdir() if p.is_dir()]


def test_a_gguf_of_an_architecture_batchgen_does_not_run_is_refused_before_converting(
        tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "model.gguf", arch="gemma2")
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM"):
        convert.converted_for_gguf(path, None)
    assert not [p for p in convert.default_cache_root().iterdir() if p.is_dir()]


def test_an_unwritable_conversion_cache_is_a_clear_error(tmp_path, monkeypatch):
    """A BATCHGEN_CACHE this user may not write (here: under a file) is exit 5 naming the
    setting to change, not a traceback."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "a-file" / "cache"))
    path = write_tiny_gguf(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match="cannot write a converted model.*BATCHGEN_CACHE"):
        convert.converted_for_gguf(path, None)


def _tokenizer_fields_of_the_embedded_gguf() -> dict:
    import gguf

    reader = gguf.GGUFReader(str(convert.embedded_gguf()))
    return {key: reader.fields[key].contents() for key in (
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.chat_template")}


def test_a_converted_gguf_tokenizes_as_the_file_defines(tmp_path, monkeypatch):
    """A Qwen2 GGUF whose tokenizer uses another pre-tokenizer (here SmolLM2's): the converted
    folder's tokenizer must split text as transformers' GGUF loader does, not as the
    Qwen2Tokenizer class would rebuild it (newlines and runs of spaces differed)."""
    from transformers import AutoTokenizer

    from batchgen.models.factory import load_tokenizer

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "model.gguf", arch="qwen2",
                           tokenizer=_tokenizer_fields_of_the_embedded_gguf())
    folder = convert.converted_for_gguf(path, None)
    ours = load_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("line1\nline2\n\n  indented", "a\r\nb", "  multiple   spaces\t\ttabs",
                 "Don't you're I'll 1234567"):
        assert ours.encode(text) == theirs.encode(text), text
    messages = [{"role": "user", "content": "Hi\n\nthere"}]
    assert (ours.apply_chat_template(messages, tokenize=False)
            == theirs.apply_chat_template(messages, tokenize=False))
    assert ours.eos_token_id == theirs.eos_token_id
