"""CUDA-graph decode: bucket choice on any machine; on CUDA, graphs give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from engine_utils import greedy_requests
from tiny_models import save_tiny_model

from batchgen.config import ConfigError, EngineConfig, MemoryConfig, RuntimeConfig
from batchgen.engine.engine import Engine
from batchgen.engine.graphs import bucket_sizes
from batchgen.models.loader import build_model, load_hf_config, read_safetensors


@pytest.mark.parametrize("max_bucket,num", [(128, 16), (256, 16), (16, 4), (1, 16), (5, 2)])
def test_buckets_cover_one_to_max(max_bucket, num):
    sizes = bucket_sizes(max_bucket, num)
    assert sizes[0] == 1 and sizes[-1] == max_bucket and sizes == sorted(set(sizes))
    assert len(sizes) <= max(num, 2)


def test_graph_flags_are_exclusive_and_on_by_default():
    assert RuntimeConfig().use_cuda_graphs
    assert not RuntimeConfig(disable_cuda_graphs=True).use_cuda_graphs
    with pytest.raises(ConfigError, match="mutually exclusive"):
        RuntimeConfig(enable_cuda_graph=True, disable_cuda_graphs=True).validate()


def test_cpu_decodes_eagerly(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                        torch.device("cpu"))
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1))
    assert Engine(model, cfg.validate()).runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_match_eager_on_cuda(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 17, 64, 65, 150, 7)]
    tokens = {}
    for disable in (True, False):
        model = build_model(load_hf_config(folder), read_safetensors(folder), torch.bfloat16,
                            torch.device("cuda"))
        runtime = RuntimeConfig(disable_cuda_graphs=disable, cuda_graph_max_bucket_size=8,
                                cuda_graph_num_buckets=4)  # 6 rows pad to 8
        engine = Engine(model, EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.2,
                                                                host_kv_cache_size=0.2),
                                            runtime=runtime).validate())
        assert (engine.runner.graphs is None) == disable
        done = engine.generate(greedy_requests(prompts, 40, ignore_eos=True))
        tokens[disable] = [d.completions[0].token_ids for d in done]
    assert tokens[False] == tokens[True]
