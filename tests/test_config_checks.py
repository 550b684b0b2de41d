"""Config fields no model can be built from are refused before a worker starts, naming the
fields; a tokenizer larger than the model's vocabulary is named at load and in each refusal."""

import json
import logging

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.core import SamplingParams
from batchgen.io.intake import ParsedRequest, tokenize_request, vocabulary_bound
from batchgen.models.factory import load_model
from batchgen.models.folder_checks import check_model_folder
from batchgen.models.loader import CheckpointError
from tiny_models import embedded_tokenizer, save_tiny_model

ROOMY = (1 << 40, 1 << 40)


def _edited(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    folders = {}
    for family in ("mixtral", "qwen3_moe", "qwen3"):
        folder = save_tiny_model(family, tmp_path_factory.mktemp(family))
        embedded_tokenizer().save_pretrained(str(folder))
        folders[family] = folder
    return folders


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3"])
def test_the_unedited_configs_pass(moe_folders, family):
    check_model_folder(moe_folders[family], *ROOMY)


@pytest.mark.parametrize("family, spelling", [("mixtral", None), ("qwen3_moe", None),
                                              ("qwen3_moe", "num_experts")])
def test_more_experts_per_token_than_experts_is_refused(moe_folders, family, spelling,
                                                        tmp_path):
    """Whichever field the config counts its experts in (Qwen3-MoE's Hub configs say
    num_experts, transformers 5 writes num_local_experts)."""
    config = json.loads((moe_folders[family] / "config.json").read_text())
    saved = next(f for f in ("num_local_experts", "num_experts", "n_routed_experts")
                 if f in config)
    experts_field = spelling or saved
    experts = config.pop(saved)
    config[experts_field] = experts
    folder = tmp_path / "m"
    folder.mkdir()
    for path in moe_folders[family].iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "num_experts_per_tok": experts + 1}))
    with pytest.raises(CheckpointError, match=rf"num_experts_per_tok {experts + 1} is more "
                                              rf"than {experts_field} {experts}"):
        check_model_folder(folder, *ROOMY)


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
     "hidden_size 64 is not a multiple of num_attention_heads 5 and no head_dim"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types lists 2 layers but "
                                              "num_hidden_layers is 3"),
])
def test_head_and_layer_counts_that_build_no_model_are_refused(tmp_path, fields, message):
    folder = save_tiny_model("llama", tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    _edited(folder, **fields)
    with pytest.raises(CheckpointError, match=message):
        check_model_folder(folder, *ROOMY)


def test_custom_modeling_code_a_config_names_is_said_to_be_not_run(tmp_path, caplog):
    """gte-Qwen2-7B-instruct's config is a plain Qwen2ForCausalLM's but for auto_map, whose code
    attends bidirectionally: batchgen runs its own Qwen2, so the log says that code is not run."""
    folder = save_tiny_model("qwen2", tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    with caplog.at_level(logging.WARNING, logger="batchgen.model"):
        check_model_folder(folder, *ROOMY)
    assert not caplog.records
    _edited(folder, auto_map={"AutoModel": "modeling_qwen.Qwen2Model",
                              "AutoModelForCausalLM": "modeling_qwen.Qwen2ForCausalLM"})
    with caplog.at_level(logging.WARNING, logger="batchgen.model"):
        check_model_folder(folder, *ROOMY)
    said = caplog.records[0].getMessage()
    assert "names custom modeling code (auto_map: modeling_qwen.Qwen2ForCausalLM, " \
           "modeling_qwen.Qwen2Model), which batchgen does not run: it runs its own " \
           "Qwen2ForCausalLM" in said


def test_vocabulary_bound_names_what_sets_the_limit():
    assert vocabulary_bound(100, None) == vocabulary_bound(100, 100) == \
        "the vocabulary size of the model and its tokenizer"
    assert "tokenizer has 120 tokens" in vocabulary_bound(120, 100)
    assert "belongs to these weights" in vocabulary_bound(120, 100)
    assert vocabulary_bound(100, 128) == "the tokenizer's 100 tokens; the model's vocab_size " \
                                         "is 128"


def test_a_tokenizer_larger_than_the_model_is_named_at_load_and_per_line(tmp_path, caplog):
    tokenizer = embedded_tokenizer()
    small = len(tokenizer) - 200
    folder = save_tiny_model("llama", tmp_path / "m", vocab_size=small)
    tokenizer.save_pretrained(str(folder))
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        loaded = load_model(ModelConfig(model=str(folder), dtype="float32"),
                            torch.device("cpu"))
    assert f"the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is " \
           f"{small}" in caplog.text
    top = len(tokenizer) - 1
    parsed = ParsedRequest("a", 3, "completion", None, [5, top], SamplingParams(max_tokens=4),
                           {})
    error = tokenize_request(parsed, loaded.tokenizer, 1000, loaded.hf_config.vocab_size)
    assert error.code == "invalid_prompt"
    assert f"must be < {small} (the model's vocab_size; its tokenizer has" in error.message


def test_a_job_whose_model_is_refused_is_found_and_described_by_status(tmp_path):
    """Refused (exit 5) before its workers: the job folder it leaves is found from the output
    path, and status says it stopped before answering, not that the same command resumes it
    (a refused model is refused again)."""
    from job_utils import batchgen, chat_rows, write_jsonl

    folder = save_tiny_model("llama", tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    _edited(folder, num_attention_heads=4, num_key_value_heads=3)
    out = tmp_path / "out" / "res.jsonl"
    run = batchgen("run", "-i", write_jsonl(tmp_path / "in.jsonl", chat_rows(2)), "-o", out,
                   "--model", folder, "--device", "cpu")
    assert run.returncode == 5 and "num_key_value_heads 3" in run.stderr
    shown = batchgen("status", out, env={"COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "validating" in text and "stopped before answering anything" in text
    assert "resumes it" not in text


@pytest.mark.parametrize("fields, says", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_what_gemma_3_asks_and_is_not_computed_is_refused_before_a_worker(tmp_path, fields,
                                                                          says):
    """It was refused only by the worker, after its launch and a torch elastic error line."""
    from batchgen.models.registry import UnsupportedModelError

    folder = save_tiny_model("gemma3", tmp_path / "m")
    embedded_tokenizer().save_pretrained(str(folder))
    check_model_folder(folder, *ROOMY)
    _edited(folder, **fields)
    with pytest.raises(UnsupportedModelError, match=says):
        check_model_folder(folder, *ROOMY)
