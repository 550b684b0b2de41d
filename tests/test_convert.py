"""batchgen convert -> run from the converted folder gives the same tokens as the source."""

import os

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.models.export import convert_model
from batchgen.models.factory import load_model
from batchgen.models.loader import MANIFEST, CheckpointError
from engine_utils import greedy_requests, make_engine
from tiny_models import save_tiny_model


@pytest.mark.parametrize("family", ["llama_tied", "qwen3", "mixtral", "phi3", "granite"])
def test_convert_roundtrip_same_tokens(tmp_path, family):
    source = save_tiny_model(family, tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv")
    assert (out / "batchgen_manifest.json").is_file()
    prompts = [[5, 6, 7, 8], list(range(10, 90))]
    tokens = []
    for cfg in (ModelConfig(model=str(source)), ModelConfig(converted_ckpt_dir=str(out))):
        model = load_model(cfg, torch.device("cpu")).model
        results = make_engine(model).generate(greedy_requests(prompts, 20, ignore_eos=True))
        tokens.append([r.completions[0].token_ids for r in results])
    assert tokens[0] == tokens[1]


def test_a_converted_folder_keeps_the_stop_tokens_and_the_pooling(tmp_path):
    """generation_config.json's extra EOS ids and sentence-transformers' pooling files decide
    answers beside the weights: a converted folder carries them."""
    import json

    source = save_tiny_model("llama", tmp_path / "src")
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    (source / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv")
    loaded = load_model(ModelConfig(converted_ckpt_dir=str(out)), torch.device("cpu"))
    assert 77 in loaded.eos_token_ids
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (out / "modules.json").is_file()


def test_converted_for_other_world_size_is_refused(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2)
    with pytest.raises(CheckpointError, match="world size 2"):
        load_model(ModelConfig(converted_ckpt_dir=str(out)), torch.device("cpu"))


def test_converted_for_other_dtype_is_refused(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source), dtype="bfloat16"), tmp_path / "conv")
    with pytest.raises(CheckpointError, match="--dtype float32"):
        load_model(ModelConfig(converted_ckpt_dir=str(out), dtype="float32"), torch.device("cpu"))


def test_gguf_cache_key_follows_content_not_location(tmp_path, monkeypatch):
    """A reinstall (new path, new mtime) of the same GGUF reuses its conversion; the file is
    hashed once per location, and a changed file gets a new key."""
    from batchgen.models import convert

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    hashed = []
    content_key = convert._content_key
    monkeypatch.setattr(convert, "_content_key", lambda p: hashed.append(p) or content_key(p))
    payload = bytes(range(256)) * 5000
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(payload)
    os.utime(second, ns=(1, 1))
    assert convert.source_key(first) == convert.source_key(second)
    assert convert.source_key(first) == convert.source_key(first)
    assert hashed == [first, second]  # the repeat came from the index
    second.write_bytes(payload[:-1] + b"x")
    assert convert.source_key(second) != convert.source_key(first)
    (tmp_path / "cache" / "converted" / "source-keys.json").write_text("not json")
    assert convert.source_key(first) == content_key(first)  # a broken index is rebuilt


def test_finished_conversion_is_kept_when_a_racing_one_finishes(tmp_path):
    from batchgen.models import convert

    out, ours = tmp_path / "out", tmp_path / "ours"
    ours.mkdir()
    (ours / MANIFEST).write_text("ours")
    out.mkdir()  # empty: the conversion goes in
    convert._publish(ours, out)
    assert (out / MANIFEST).read_text() == "ours" and not ours.exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / MANIFEST).write_text("theirs")
    convert._publish(theirs, out)
    assert (out / MANIFEST).read_text() == "ours"


def test_a_folder_of_other_files_is_never_replaced_by_a_conversion(tmp_path):
    """--converted-ckpt-dir naming a folder that holds the user's files (no manifest) is
    refused before any dequantizing, and the files stay."""
    from batchgen.models import convert

    folder = tmp_path / "mymodels"
    (folder / "other-model").mkdir(parents=True)
    (folder / "other-model" / "model.safetensors").write_text("precious")
    with pytest.raises(CheckpointError, match="holds other files.*--converted-ckpt-dir"):
        convert.converted_for_gguf(tmp_path / "unused.gguf", str(folder))
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MANIFEST).write_text("ours")
    with pytest.raises(CheckpointError, match="holds other files"):
        convert._publish(ours, folder)  # a folder that appeared while converting
    assert (folder / "other-model" / "model.safetensors").read_text() == "precious"


def test_conversions_killed_outright_leave_no_folder_behind(tmp_path):
    """A killed conversion's temp folder is removed by the next one unless a live process
    holds its lock (or, without a lock file, while it is recent)."""
    import fcntl

    from batchgen.models import convert

    def temp(name: str, lock: bool = True):
        folder = tmp_path / f"{convert.TEMP_PREFIX}{name}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        if lock:
            folder.with_name(folder.name + ".lock").write_text("")
        return folder

    killed, live, old, recent = temp("killed"), temp("live"), temp("old", False), temp("new", False)
    os.utime(old, (1, 1))
    holder = os.open(live.with_name(live.name + ".lock"), os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: as another process would hold it
    try:
        with convert.conversion_folder(tmp_path) as mine:
            assert mine.is_dir() and mine.with_name(mine.name + ".lock").exists()
            assert not killed.exists() and not old.exists()
            assert live.exists() and recent.exists()
        assert not mine.exists() and not mine.with_name(mine.name + ".lock").exists()
    finally:
        os.close(holder)


def test_a_full_disk_while_saving_is_an_os_error(tmp_path, monkeypatch):
    """safetensors reports ENOSPC as its own error type: it becomes the OSError the job runner
    turns into exit 6 with one clear line."""
    import errno

    import safetensors.torch

    from batchgen.models import convert

    def full(*args, **kwargs):
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as err:
        convert.save_weights(tmp_path / "m.safetensors", object(), {"w": torch.zeros(2)})
    assert err.value.errno == errno.ENOSPC


def test_convert_refuses_an_output_that_is_a_file_and_world_sizes_below_one(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")
    taken = tmp_path / "taken"
    taken.write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        convert_model(ModelConfig(model=str(source)), taken)
    with pytest.raises(CheckpointError, match="both >= 1"):
        convert_model(ModelConfig(model=str(source)), tmp_path / "new", world_size=0)
    assert taken.read_text() == "mine" and not (tmp_path / "new").exists()
