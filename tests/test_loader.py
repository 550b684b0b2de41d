"""Finding and loading models: clear errors, hub cache layout, and the embedded SmolLM2 against
HF transformers (greedy tokens and logits)."""

import json

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.core import Request, SamplingParams
from batchgen.models.factory import eos_token_ids, load_model
from batchgen.models.folder_checks import check_model_folder
from batchgen.models.loader import (CheckpointError, ModelNotFoundError, load_hf_config,
                                    resolve_model)
from batchgen.models.registry import UnsupportedModelError
from engine_utils import assert_last_logits_match, hf_greedy, make_engine
from tiny_models import embedded_tokenizer, save_tiny_model


def test_missing_model_lists_every_place_searched(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("org/absent", cache_dir=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "models--org--absent" in str(err.value)


def test_a_path_to_something_else_than_a_model_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="a file that is not .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFoundError, match="a folder without config.json"):
        resolve_model(str(tmp_path))


def test_a_gguf_is_found_whatever_the_case_of_its_suffix(tmp_path):
    (tmp_path / "model.GGUF").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path / "model.GGUF")).kind == "gguf"
    assert resolve_model(str(tmp_path)).path == tmp_path / "model.GGUF"


def test_a_folder_of_several_ggufs_names_them_and_the_path_to_give(tmp_path):
    for name in ("m-Q4_K_M.gguf", "m-Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(str(tmp_path))
    assert "2 .gguf files (m-Q4_K_M.gguf, m-Q8_0.gguf)" in str(err.value)
    assert f"--model {tmp_path / 'm-Q4_K_M.gguf'}" in str(err.value)


def test_a_config_transformers_cannot_read_names_the_file_and_the_fix(tmp_path):
    folder = save_tiny_model("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0}  # no factor
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_hf_config(folder)
    assert str(err.value).startswith(f"cannot read {folder / 'config.json'}: Missing required")
    assert "'factor'" in str(err.value) and "restore the model's own config.json" in str(err.value)


def test_hub_cache_layout_is_found(tmp_path):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    save_tiny_model("llama", snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert resolve_model("org/tiny", cache_dir=str(tmp_path)).path == snapshot


def test_the_cache_folder_of_a_hub_repo_points_at_its_snapshot(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    save_tiny_model("llama", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for given in (repo, repo / "snapshots"):
        with pytest.raises(ModelNotFoundError) as err:
            resolve_model(str(given))
        assert f"--model {str(given)!r} is the Hugging Face cache folder of org/tiny" \
            in str(err.value)
        assert f"--model {snapshot}" in str(err.value)
        assert f"--model org/tiny --cache-dir {tmp_path / 'hub'}" in str(err.value)
    assert resolve_model("org/tiny", cache_dir=str(tmp_path / "hub")).path == snapshot
    (snapshot / "config.json").unlink()  # a download that stopped part way
    with pytest.raises(ModelNotFoundError, match="none of its snapshots is a complete"):
        resolve_model(str(repo))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"))


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_a_config_without_architectures_loads_by_its_model_type(tmp_path, family):
    """A config saved on its own (`LlamaConfig(...).save_pretrained`) lists no architectures:
    transformers' AutoModelForCausalLM picks the class by model_type, and so does batchgen."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(family, tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    check_model_folder(folder, 1 << 40, 1 << 40)
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(loaded.model).__name__ == type(hf).__name__
    assert_last_logits_match(loaded.model, hf, list(range(3, 40)))


def test_a_config_without_architectures_of_another_model_type_says_what_to_add(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError,
                       match=r"no architectures.*model_type 'gpt2'.*LlamaForCausalLM"):
        check_model_folder(folder, 1 << 40, 1 << 40)


def test_a_quantization_batchgen_does_not_read_is_refused_by_name_at_load(tmp_path):
    """Also where no folder check ran first (a worker, `batchgen convert`): not a tensor
    "without a place" blamed on config.json."""
    folder = save_tiny_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quant_method 'gptq'"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"))


def test_an_unreadable_tokenizer_is_a_checkpoint_error_naming_the_folder(tmp_path):
    """Not a worker crash (which a rerun would repeat): exit 5 with the folder and the fix."""
    from batchgen.models.factory import load_tokenizer

    folder = save_tiny_model("llama", tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"tokenizer of {folder}.*tokenizer files"):
        load_tokenizer(folder)


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"))


def test_tied_config_over_two_different_tensors_unties_as_hf_does(tmp_path, caplog):
    """config.json says tie_word_embeddings but the checkpoint holds lm_head and the embedding
    with different values: HF keeps both, so must we (tying would let one overwrite the other)."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with caplog.at_level("WARNING", logger="batchgen.loader"):
        ours = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    assert "keeping them apart" in caplog.text
    assert ours.model.lm_head.weight.data_ptr() != ours.model.model.embed_tokens.weight.data_ptr()
    assert_last_logits_match(ours.model, hf, list(range(3, 70)))


@pytest.mark.parametrize("field, value", [("intermediate_size", 256),
                                          ("num_key_value_heads", 4),
                                          ("num_hidden_layers", 2)])
def test_config_contradicting_layer_tensors_is_a_checkpoint_error(tmp_path, field, value):
    """A layer tensor of another shape, or one with no place in the model, found while the
    weights load: CheckpointError (exit 5, "fix the model"), not a crash that a requeue repeats."""
    folder = save_tiny_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match config.json"):
        load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))



def _drop_tensor(folder, name):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family, dropped", [
    ("llama", "model.layers.2.self_attn.k_proj.weight"),
    ("llama", "model.layers.0.mlp.up_proj.weight"),
    ("qwen2", "model.layers.1.self_attn.q_proj.bias"),
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight")])  # Phi-3 ships them fused
def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(tmp_path, family, dropped):
    """Not by the fused parameter it fills (qkv_proj, gate_up_proj), which no file holds."""
    folder = save_tiny_model(family, tmp_path / "m")
    _drop_tensor(folder, dropped)
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensors, e\.g\. \['{dropped}'\]"):
        load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))


def test_a_damaged_tokenizer_is_named_before_the_weights_are_placed(tmp_path, monkeypatch):
    """A whole checkpoint read first would name it minutes late on a large model."""
    from batchgen.models import factory

    folder = save_tiny_model("llama", tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")

    def build_model(*args, **kwargs):
        raise AssertionError("weights placed before the tokenizer was read")

    monkeypatch.setattr(factory, "build_model", build_model)
    with pytest.raises(CheckpointError, match="tokenizer of"):
        load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))


def test_an_untied_model_without_lm_head_says_what_it_lacks(tmp_path, caplog):
    """It loads as an embedding model (no LM head): the log names the missing tensor and the
    config field, for a causal LM whose lm_head.weight was lost."""
    folder = save_tiny_model("llama", tmp_path / "m")
    _drop_tensor(folder, "lm_head.weight")
    with caplog.at_level("WARNING", logger="batchgen.models"):
        loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    assert not loaded.model.generates
    assert "no lm_head.weight" in caplog.text and "tie_word_embeddings" in caplog.text


@pytest.mark.parametrize("text", ['{"eos_token_id": [2,', "[2]"])
def test_an_unreadable_generation_config_is_a_checkpoint_error(tmp_path, text):
    """generation_config.json names where answers end: a damaged one is the model folder's
    fault (exit 5 naming the file), not a JSONDecodeError that crashes every rerun."""
    folder = save_tiny_model("llama", tmp_path / "m")
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json"):
        eos_token_ids(folder, None, None)


def test_an_adapter_beside_model_safetensors_is_not_read(tmp_path):
    """Without an index the folder's model is `model.safetensors` (as transformers reads it):
    an adapter file beside it is not loaded as part of the model."""
    from safetensors.torch import save_file

    folder = save_tiny_model("llama", tmp_path / "m")
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
              str(folder / "adapter_model.safetensors"))
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    assert loaded.model is not None


def test_model_safetensors_is_read_before_a_stale_index(tmp_path):
    """transformers reads `model.safetensors` when a folder holds it, whatever index lies
    beside it: re-saving a sharded model in one file leaves the old index (and any old shards)
    behind, and the folder must load the new weights, not refuse or load the old ones."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "m"
    save_tiny_model("llama", folder, seed=0)
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(
        str(folder), max_shard_size="200KB")  # the old weights, sharded, with an index
    save_tiny_model("llama", tmp_path / "new", seed=1)
    (tmp_path / "new" / "model.safetensors").replace(folder / "model.safetensors")
    assert (folder / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    assert_last_logits_match(ours.model, hf, list(range(3, 70)))
    for shard in folder.glob("model-*.safetensors"):
        shard.unlink()  # the index alone: its shards are gone, model.safetensors still loads
    load_model(ModelConfig(model=str(folder), dtype="float32"), torch.device("cpu"))


def test_pickle_checkpoints_are_not_loaded(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"))


def test_embedded_smollm2_matches_hf_on_chat_prompts():
    from transformers import AutoModelForCausalLM

    loaded = load_model(ModelConfig(dtype="float32"), torch.device("cpu"))
    tok = loaded.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about autumn.",
                 "Explain photosynthesis briefly.", "List three prime numbers.",
                 "What is 12 times 7?", "Translate 'good morning' to Spanish.",
                 "Give me a tip for learning to code.", "Why is the sky blue?"]
    prompts = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    engine = make_engine(loaded.model, tok, loaded.eos_token_ids, device_gb=0.3, host_gb=0.3)
    results = engine.generate([Request(f"q{i}", p, SamplingParams(max_tokens=32, temperature=0.0,
                                                                   ignore_eos=True))
                               for i, p in enumerate(prompts)])
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=torch.float32).eval()
    for prompt, result in zip(prompts, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("shape", ["llama3-8b", "deepseek-v3-4l", "gpt-oss-20b"])
def test_building_a_model_draws_no_normal_weights(shape, monkeypatch):
    """Every weight is loaded, so the meta model draws no normal_ init: nn.Embedding's, even
    on the meta device, cost about a second of each worker's start-up (Linear's uniform init
    on meta costs nothing measurable and is left to torch)."""
    from batchgen.bench_models import hf_config_for
    from batchgen.models.loader import meta_model

    def drawn(*args, **kwargs):
        raise AssertionError("a normal_ init ran while building the model")

    for name in ("normal_", "trunc_normal_"):
        monkeypatch.setattr(torch.nn.init, name, drawn)
    monkeypatch.setattr(torch.Tensor, "normal_", drawn)
    model = meta_model(hf_config_for(shape, tiny=True))
    assert model.model.embed_tokens.weight.is_meta


def test_weights_are_read_while_the_config_is(tmp_path, monkeypatch):
    """load_model starts the checkpoint's readers before it reads config.json (which imports
    transformers), and the model it builds is the same."""
    import threading

    import batchgen.models.factory as factory

    folder = save_tiny_model("llama", tmp_path / "m")
    readers_at_config, streams = [], []
    real, real_stream = factory.load_hf_config, factory.stream_to_device

    def stream(*args, **kw):
        streams.append(real_stream(*args, **kw))
        return streams[-1]

    def config_after_readers(path):
        # Started readers (a tiny checkpoint's may already have read everything and ended).
        readers_at_config.extend(t.name for s in streams for t in s._staged._threads
                                 if t.ident is not None)
        return real(path)

    monkeypatch.setattr(factory, "stream_to_device", stream)
    monkeypatch.setattr(factory, "load_hf_config", config_after_readers)
    loaded = load_model(ModelConfig(model=str(folder)), torch.device("cpu"))
    assert readers_at_config
    assert not [t for t in threading.enumerate() if t.name.startswith("batchgen-weights")]
    from batchgen.models.loader import build_model, load_hf_config, read_safetensors

    again = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                        torch.device("cpu"))
    for (name, ours), (_, ref) in zip(loaded.model.state_dict().items(),
                                      again.state_dict().items()):
        assert torch.equal(ours, ref), name
