"""Tensor parallelism on CPU (gloo): two ranks splitting heads, columns and rows must produce
the same greedy tokens and (nearly) the same logprobs as one process holding the whole model."""

from __future__ import annotations

import pytest
import torch

from engine_utils import greedy_requests
from tiny_models import save_tiny_model
from tp_utils import run_tensor_parallel

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig
from batchgen.engine.engine import Engine
from batchgen.models.loader import build_model, load_hf_config, read_safetensors
from batchgen.parallel import ParallelError, TensorParallel

PROMPTS = [[1 + (i * 7 + j * 13) % 500 for j in range(n)] for i, n in enumerate((5, 70, 131, 20))]


def generate(tp: TensorParallel, folder, max_tokens: int, options=None):
    torch.manual_seed(0)
    model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                        torch.device("cpu"), options, tp=tp)
    attn = model.model.layers[0].self_attn
    assert attn.heads * tp.size == model.config.num_attention_heads  # really split
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05,
                                           host_kv_cache_size=0.1)).validate()
    engine = Engine(model, cfg, tp=tp)
    done = engine.generate(greedy_requests(PROMPTS, max_tokens, logprobs=True))
    return [(c.completions[0].token_ids, c.completions[0].logprobs) for c in done]


def assert_same_as_single(ranks, single):
    for rank in ranks:
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(rank, single):
            assert tokens == ref_tokens
            got = torch.tensor([lp.logprob for lp in logprobs])
            want = torch.tensor([lp.logprob for lp in ref_logprobs])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert ranks[0] == ranks[1]  # the replicas are bitwise identical


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "granite", "gemma3"])
def test_tp2_equals_one_process(tmp_path, family):
    folder = save_tiny_model(family, tmp_path / family)
    single = generate(TensorParallel(), folder, 24)
    assert_same_as_single(run_tensor_parallel(2, generate, folder, 24), single)


@pytest.mark.parametrize(("family", "ratio"), [("qwen3_moe", 0.0), ("mixtral", 0.5)])
def test_softmax_moe_tp2_with_expert_parallel_equals_one_process(tmp_path, family, ratio):
    """Attention split by heads, routed experts as 2 x E/2 (expert parallel); with
    --ep-offloading-ratio, half of each rank's experts stream in from host memory."""
    folder = save_tiny_model(family, tmp_path / family)
    options = ModelConfig(enable_ep_with_offloading=ratio > 0, ep_offloading_ratio=ratio)
    single = generate(TensorParallel(), folder, 16)
    assert_same_as_single(run_tensor_parallel(2, generate, folder, 16, options), single)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_deepseek_tp2_with_expert_parallel_equals_one_process(tmp_path, ratio):
    """MLA split by heads, 16 experts as 2 x 8 (expert parallel), shared experts by columns;
    with --ep-offloading-ratio, half of each rank's experts stream in from host memory."""
    from test_deepseek import save_tiny

    folder = tmp_path / "ds"
    save_tiny(folder)
    options = ModelConfig(enable_ep_with_offloading=ratio > 0, ep_offloading_ratio=ratio)
    single = generate(TensorParallel(), folder, 16)
    assert_same_as_single(run_tensor_parallel(2, generate, folder, 16, options), single)


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path):
    """4 query heads over 2 KV heads at TP 4: each KV head lives on the two ranks whose query
    heads read it (checked with the weights each rank loads; TP 4 on 2 cores is too slow)."""
    folder = save_tiny_model("llama", tmp_path / "m")
    full = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                       torch.device("cpu")).model.layers[0].self_attn
    q_full, k_full, v_full = full.qkv_proj.weight.split([full.q_size, full.kv_size, full.kv_size])
    d = full.head_dim
    for rank in range(4):
        attn = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                           torch.device("cpu"), tp=TensorParallel(size=4, rank=rank)
                           ).model.layers[0].self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        assert (attn.heads, attn.kv_heads, attn.kv_first) == (1, 1, rank // 2)
        assert torch.equal(q, q_full[rank * d:(rank + 1) * d])
        assert torch.equal(k, k_full[(rank // 2) * d:(rank // 2 + 1) * d])
        assert torch.equal(v, v_full[(rank // 2) * d:(rank // 2 + 1) * d])


def test_heads_not_divisible_is_a_clear_error(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")  # 4 heads, 2 KV heads
    with pytest.raises(ParallelError, match="num_attention_heads .* tensor-parallel size 3"):
        build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                    torch.device("cpu"), tp=TensorParallel(size=3, rank=0))
