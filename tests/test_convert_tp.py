"""`batchgen convert --tensor-parallel-size 2`: one file per TP rank holding only that rank's
weights; the ranks load their own file (no slicing) and generate exactly what one process
running the unconverted model does; a folder sharded for another TP size is refused."""

from __future__ import annotations

import json

import pytest
import torch

from engine_utils import greedy_requests
from tiny_models import save_tiny_model
from tp_utils import run_tensor_parallel

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig
from batchgen.engine.engine import Engine
from batchgen.models.export import convert_model
from batchgen.models.factory import load_model
from batchgen.models.loader import MANIFEST, CheckpointError
from batchgen.parallel import TensorParallel

PROMPTS = [[1 + (i * 7 + j * 13) % 200 for j in range(n)] for i, n in enumerate((5, 70, 131))]
SHARDS = ["model-tp00-of-02.safetensors", "model-tp01-of-02.safetensors"]


def generate(tp: TensorParallel, model_cfg: ModelConfig, world: int, max_tokens: int):
    torch.manual_seed(0)
    model = load_model(model_cfg, torch.device("cpu"), world, tp).model
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05,
                                           host_kv_cache_size=0.1)).validate()
    engine = Engine(model, cfg, tp=tp)
    done = engine.generate(greedy_requests(PROMPTS, max_tokens, ignore_eos=True))
    return [c.completions[0].token_ids for c in done]


def assert_sharded(out) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tensor_parallel_size"] == 2 and manifest["world_size"] == 2
    assert manifest["files"] == SHARDS
    assert sorted(p.name for p in out.glob("*.safetensors")) == SHARDS


def test_llama_tp2_shards_give_the_unconverted_tokens(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")  # 4 heads, 2 KV heads
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2,
                        tensor_parallel_size=2)
    assert_sharded(out)
    from safetensors import safe_open

    with safe_open(str(out / SHARDS[1]), framework="pt") as f:  # rank 1's share only
        qkv = f.get_slice("model.layers.0.self_attn.qkv_proj.weight").get_shape()
        o = f.get_slice("model.layers.0.self_attn.o_proj.weight").get_shape()
    assert qkv[0] == (4 + 2 + 2) * 16 // 2 and o[1] == 4 * 16 // 2
    single = generate(TensorParallel(), ModelConfig(model=str(source)), 1, 16)
    ranks = run_tensor_parallel(2, generate, ModelConfig(converted_ckpt_dir=str(out)), 2, 16)
    assert ranks[0] == ranks[1] == single


def test_deepseek_tp2_shards_give_the_unconverted_tokens(tmp_path):
    """Experts are written per rank (8 of 16 each, numbered from the rank's first expert); at
    load time half of each rank's experts go to host memory, the rest stay resident."""
    from test_deepseek import save_tiny

    save_tiny(tmp_path / "src")
    out = convert_model(ModelConfig(model=str(tmp_path / "src")), tmp_path / "conv",
                        world_size=2, tensor_parallel_size=2)
    assert_sharded(out)
    single = generate(TensorParallel(), ModelConfig(model=str(tmp_path / "src")), 1, 12)
    offload = ModelConfig(converted_ckpt_dir=str(out), enable_ep_with_offloading=True,
                          ep_offloading_ratio=0.5)
    ranks = run_tensor_parallel(2, generate, offload, 2, 12)
    assert ranks[0] == ranks[1] == single


def test_qwen3_moe_tp2_shards_give_the_unconverted_tokens(tmp_path):
    """Qwen3-MoE's experts are written per rank as grouped tensors (4 of 8 each) beside the
    dense layer's column / row slices."""
    source = save_tiny_model("qwen3_moe", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2,
                        tensor_parallel_size=2)
    assert_sharded(out)
    single = generate(TensorParallel(), ModelConfig(model=str(source)), 1, 12)
    ranks = run_tensor_parallel(2, generate, ModelConfig(converted_ckpt_dir=str(out)), 2, 12)
    assert ranks[0] == ranks[1] == single


def test_rank_reads_only_its_shard_and_matches_slicing(tmp_path):
    """Rank 1 loads with rank 0's file gone, and holds what slicing the full weights gives."""
    source = save_tiny_model("qwen3", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2,
                        tensor_parallel_size=2)
    (out / SHARDS[0]).unlink()
    rank1 = TensorParallel(size=2, rank=1)  # loading runs no collective
    ours = load_model(ModelConfig(converted_ckpt_dir=str(out)), torch.device("cpu"), 2, rank1)
    sliced = load_model(ModelConfig(model=str(source)), torch.device("cpu"), 2, rank1)
    want = sliced.model.state_dict()
    got = ours.model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    with pytest.raises(CheckpointError, match="model-tp00-of-02.safetensors"):
        load_model(ModelConfig(converted_ckpt_dir=str(out)), torch.device("cpu"), 2,
                   TensorParallel(size=2, rank=0))


def test_other_tp_size_is_refused_naming_the_flag(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2,
                        tensor_parallel_size=2)
    cfg = ModelConfig(converted_ckpt_dir=str(out))
    with pytest.raises(CheckpointError, match="run with --tensor-parallel-size 2"):
        load_model(cfg, torch.device("cpu"), 2)  # TP 1: two data-parallel replicas
    with pytest.raises(CheckpointError, match="world size 2, this run uses 4"):
        load_model(cfg, torch.device("cpu"), 4, TensorParallel(size=4, rank=0))


def test_whole_model_folder_still_loads_at_any_tp_size(tmp_path):
    """A TP-1 folder holds full tensors: a TP-2 rank slices them, as from an HF checkpoint."""
    source = save_tiny_model("llama", tmp_path / "src")
    out = convert_model(ModelConfig(model=str(source)), tmp_path / "conv", world_size=2)
    assert json.loads((out / MANIFEST).read_text())["tensor_parallel_size"] == 1
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    rank0 = TensorParallel(size=2, rank=0)
    model = load_model(ModelConfig(converted_ckpt_dir=str(out)), torch.device("cpu"), 2, rank0)
    assert model.model.model.layers[0].self_attn.heads == 2


def test_bad_tp_sizes_are_refused_before_writing(tmp_path):
    source = save_tiny_model("llama", tmp_path / "src")  # 4 heads, 2 KV heads
    with pytest.raises(CheckpointError, match="must divide --world-size 2"):
        convert_model(ModelConfig(model=str(source)), tmp_path / "a", 2, tensor_parallel_size=4)
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        convert_model(ModelConfig(model=str(source)), tmp_path / "b", 3, tensor_parallel_size=3)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_default_tp_size_follows_a_sharded_folder(tmp_path):
    """Without --tensor-parallel-size a worker takes the TP size the folder was sharded for
    (it loads at no other); whole folders leave the choice to the memory rule."""
    from batchgen.runner.worker.worker import sharded_tp_size

    source = save_tiny_model("llama", tmp_path / "src")
    sharded = convert_model(ModelConfig(model=str(source)), tmp_path / "tp2", world_size=2,
                            tensor_parallel_size=2)
    whole = convert_model(ModelConfig(model=str(source)), tmp_path / "tp1", world_size=2)
    assert sharded_tp_size(ModelConfig(converted_ckpt_dir=str(sharded)), 2) == 2
    assert sharded_tp_size(ModelConfig(converted_ckpt_dir=str(whole)), 2) is None
    assert sharded_tp_size(ModelConfig(model=str(source)), 2) is None
