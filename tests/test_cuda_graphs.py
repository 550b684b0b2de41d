"""CUDA-graph decode: bucket choice on any machine; on CUDA, graphs give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from engine_utils import greedy_requests
from tiny_models import save_tiny_model

from batchgen.bench_models import hf_config_for, random_model
from batchgen.config import (EAGER_DECODE_BATCH, ConfigError, EngineConfig, MemoryConfig,
                             RuntimeConfig, SchedulerConfig)
from batchgen.core import PAGE_SIZE
from batchgen.engine.engine import Engine
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.graphs import DecodeGraphs, bucket_sizes
from batchgen.engine.kv_cache import KVLayout, KVPool
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
    engine = Engine(model, cfg.validate())
    assert engine.runner.graphs is None
    assert engine.scheduler.cfg.max_decode_batch == EAGER_DECODE_BATCH


def test_decode_batch_follows_the_largest_graph_unless_given():
    unset = SchedulerConfig()
    unset.validate()
    assert unset.with_decode_batch(128).max_decode_batch == 128
    assert unset.with_decode_batch(None).max_decode_batch == EAGER_DECODE_BATCH
    assert SchedulerConfig(max_decode_batch=384).with_decode_batch(128).max_decode_batch == 384
    with pytest.raises(ConfigError, match="max.decode.batch"):
        SchedulerConfig(max_decode_batch=0).validate()


def test_graphs_reach_an_explicit_decode_batch_unless_their_size_is_given():
    """`--max-decode-batch 512` alone captured graphs up to 128 and ran every larger decode
    step eagerly, several times slower (with a warning); now the graphs follow it, up to
    FOLLOWED_GRAPH_BUCKET_MAX, and the default is DEFAULT_GRAPH_BUCKET for both."""
    from batchgen.config.engine import DEFAULT_GRAPH_BUCKET, FOLLOWED_GRAPH_BUCKET_MAX

    def bucket(max_decode_batch=None, cuda_graph_max_bucket_size=None) -> int:
        config = EngineConfig(scheduler=SchedulerConfig(max_decode_batch=max_decode_batch),
                              runtime=RuntimeConfig(
                                  cuda_graph_max_bucket_size=cuda_graph_max_bucket_size))
        return config.validate().runtime.cuda_graph_max_bucket_size

    assert bucket() == DEFAULT_GRAPH_BUCKET == 256
    assert bucket(max_decode_batch=512) == 512
    assert bucket(max_decode_batch=5000) == FOLLOWED_GRAPH_BUCKET_MAX == 1024
    assert bucket(max_decode_batch=512, cuda_graph_max_bucket_size=64) == 64
    assert bucket(cuda_graph_max_bucket_size=64) == 64


class ReplayedOnCpu:
    """Stands in for a CUDA graph on the CPU: replaying re-runs the captured call and writes
    into the tensor the capture returned, as a replayed graph writes its output buffer."""

    def __init__(self, segment, x, batch):
        self.call = lambda: segment(x, batch)
        self.out = self.call()

    def replay(self):
        fresh = self.call()
        if isinstance(fresh, tuple):  # a decoder layer's (residual, pending) pair
            for buffer, value in zip(self.out, fresh):
                buffer.copy_(value)
        else:
            self.out.copy_(fresh)


def capture_on_cpu(graphs, segment, x, batch, mid_job=False):
    graph = ReplayedOnCpu(segment, x, batch)
    return graph, graph.out

def tiny_graphs(monkeypatch, limit=None):
    """DecodeGraphs of a tiny model over buckets [1, 2, 16], captured on the CPU stand-in, and
    the batch size of every forward the capture ran."""
    monkeypatch.setattr(DecodeGraphs, "_capture_segment", capture_on_cpu)
    model = random_model(hf_config_for("smollm2-135m", tiny=True), torch.float32,
                         torch.device("cpu"))
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].num_seqs))
    pool = KVPool(KVLayout(model.config.num_hidden_layers, tuple(model.kv_token_shape),
                           torch.float32, torch.float32), 8, "cpu")
    with torch.inference_mode():
        graphs = DecodeGraphs(model, pool, 16, 3, 256, limit=limit)
        graphs.capture()
    return graphs, seen



def test_capture_also_runs_the_powers_of_two_between_buckets(monkeypatch):
    """Launch settings follow the batch size, so the sizes eager decode rows take between the
    buckets are run once before capture (their Triton variants compile then, not mid-job)."""
    from batchgen.engine.graphs import bucket_sizes, eager_warmup_sizes

    assert bucket_sizes(512, 6) == [1, 2, 4, 8, 16, 512]
    assert eager_warmup_sizes([1, 2, 4, 8, 16, 512]) == [32, 64, 128, 256]
    assert eager_warmup_sizes(bucket_sizes(384, 12)) == []
    graphs, seen = tiny_graphs(monkeypatch)  # buckets [1, 2, 16]
    assert seen[:2] == [4, 8] and sorted(set(seen)) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("shape", ["llama3-8b", "deepseek-v3-4l", "gpt-oss-20b"])
@pytest.mark.parametrize("segmented", [False, True], ids=["whole", "segmented"])
def test_graph_buffers_and_segment_chain_give_eager_logits(shape, segmented, monkeypatch):
    """The graph plumbing on any machine (graphs replaced by re-runs): static inputs refreshed,
    rows padded up to a bucket, and per segment each link reading the previous one's output
    buffer give the eager forward's logits, step after step (tiny random-weight models)."""
    monkeypatch.setattr(DecodeGraphs, "_capture_segment", capture_on_cpu)
    model = random_model(hf_config_for(shape, tiny=True), torch.float32, torch.device("cpu"))
    layers = model.config.num_hidden_layers
    pool = KVPool(KVLayout(layers, tuple(model.kv_token_shape), torch.float32, torch.float32),
                  32, "cpu")
    lens = [5, 70, 12, 130, 3]
    tables, first = [], 1  # page 0 is where padding rows look
    for n in lens:
        count = -(-(n + 8) // PAGE_SIZE)
        tables.append(list(range(first, first + count)))
        first += count
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
    with torch.inference_mode():
        model(ForwardBatch.build(prompts, [0] * len(lens), tables, [True] * len(lens), pool,
                                 torch.device("cpu")))
        graphs = DecodeGraphs(model, pool, 8, 3, 1024, segmented)  # 5 rows pad to 8
        graphs.capture()
        assert len(graphs.graphs[8, False]) == (layers + 3 if segmented else 1)
        for step in range(3):
            tokens = [[int(t)] for t in torch.randint(3, 500, (len(lens),), generator=g)]
            batch = ForwardBatch.build(tokens, [n + step for n in lens], tables,
                                       [True] * len(lens), pool, torch.device("cpu"))
            assert graphs.can_run(batch)
            torch.testing.assert_close(graphs.run(batch).clone(), model(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("segmented", [False, True], ids=["whole", "segmented"])
def test_graphs_match_eager_on_cuda(tmp_path, monkeypatch, segmented):
    if segmented:
        monkeypatch.setenv("BATCHGEN_SEGMENTED_GRAPH", "1")
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
        # Unset, the decode batch stops at the largest graph: no eager steps above it.
        assert engine.scheduler.cfg.max_decode_batch == (EAGER_DECODE_BATCH if disable else 8)
        if not disable:  # embedding, 3 layers, final norm, LM head
            assert len(engine.runner.graphs.graphs[8, False]) == (6 if segmented else 1)
        done = engine.generate(greedy_requests(prompts, 40, ignore_eos=True))
        tokens[disable] = [d.completions[0].token_ids for d in done]
    assert tokens[False] == tokens[True]


@pytest.mark.gpu
def test_a_job_that_decodes_nothing_captures_no_graph(tmp_path):
    """A job of embeddings only (job_sequences 0) captures no CUDA graph and pins no host
    chunk ahead; one sequence still gets its graph."""
    folder = save_tiny_model("llama", tmp_path / "m")
    for sequences, captured in ((0, False), (1, True)):
        model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                            torch.device("cuda"))
        engine = Engine(model, EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.2,
                                                                host_kv_cache_size=0.2),
                                            ).validate(), job_sequences=sequences)
        assert (engine.runner.graphs is not None) == captured
        if not captured:
            engine.runner.host_pin.wait_idle()
            assert engine.runner.host_pin.pinned_bytes == 0
        engine.close()


@pytest.mark.gpu
def test_shared_prefix_decode_matches_plain_decode_on_cuda(tmp_path):
    """Rows sharing a 3-page prompt prefix: decode through the shared-prefix kernel (eager,
    and replaying the grouped graph captured on first need) gives the tokens of the plain
    kernel with prefix caching off."""
    folder = save_tiny_model("llama", tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 500, (3 * PAGE_SIZE,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=g).tolist()
               for n in (1, 5, 30, 64, 70, 2)]
    tokens = {}
    for caching, disable, ahead in ((False, True, False), (True, True, False),
                                    (True, False, False), (True, False, True)):
        model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                            torch.device("cuda"))
        runtime = RuntimeConfig(disable_cuda_graphs=disable, cuda_graph_max_bucket_size=8,
                                cuda_graph_num_buckets=4)
        engine = Engine(model, EngineConfig(
            memory=MemoryConfig(gpu_kv_cache_size=0.2, host_kv_cache_size=0.2),
            scheduler=SchedulerConfig(enable_prefix_caching=caching),
            runtime=runtime).validate())
        graphs = engine.runner.graphs
        if ahead:  # as bench's warm-up does: every bucket's grouped graph before any request
            graphs.capture_grouped()
            assert all(graphs.graphs.get((size, True)) is not None for size in graphs.sizes)
        done = engine.generate(greedy_requests(prompts, 40, ignore_eos=True))
        tokens[caching, disable, ahead] = [d.completions[0].token_ids for d in done]
        if caching and not disable:
            assert any(grouped for _, grouped in graphs.graphs)
    assert tokens[True, True, False] == tokens[False, True, False]
    assert tokens[True, False, False] == tokens[False, True, False]
    assert tokens[True, False, True] == tokens[False, True, False]


def test_buckets_stop_at_what_the_job_can_decode():
    """No bucket above the most sequences a decode step of the job can hold; that size itself
    is the largest bucket, so every batch the job can form still runs in a graph."""
    from batchgen.engine.graphs import capture_sizes, graph_limit

    full = bucket_sizes(128, 16)
    assert capture_sizes(128, 16) == full == capture_sizes(128, 16, 128)
    assert capture_sizes(128, 16, 1000) == full  # a job larger than the buckets: all of them
    assert capture_sizes(128, 16, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128, 16, 16) == [1, 2, 4, 8, 16]
    assert capture_sizes(128, 16, 1) == [1] == capture_sizes(128, 16, 0)
    assert graph_limit(None, None) is None
    assert graph_limit(300, None) == 300 and graph_limit(None, 64) == 64
    assert graph_limit(300, 64) == 64 and graph_limit(10, 64) == 10


def test_capture_and_warm_up_follow_the_job_size(monkeypatch):
    """A job of 5 sequences under buckets [1, 2, 16] captures [1, 2, 5] and runs no eager
    warm-up size above 5 (4 is warmed: 3-4 decode rows take its launch settings)."""
    graphs, seen = tiny_graphs(monkeypatch, limit=5)
    assert graphs.sizes == [1, 2, 5]
    assert sorted(graphs.graphs) == [(1, False), (2, False), (5, False)]
    assert sorted(set(seen)) == [1, 2, 4, 5]
