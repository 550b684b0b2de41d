"""batchgen convert -> run from the converted folder gives the same tokens as the source."""

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.models.convert import convert_model
from batchgen.models.factory import load_model
from batchgen.models.loader import CheckpointError
from engine_utils import greedy_requests, make_engine
from tiny_models import save_tiny_model


@pytest.mark.parametrize("family", ["llama_tied", "qwen3"])
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
