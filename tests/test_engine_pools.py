"""Tiny pools force unload/reload, eviction + re-prefill, chunk growth and chunked prefill;
greedy output must equal the roomy-pool run token for token."""

import pytest
import torch

from batchgen.engine.engine import host_threads
from engine_utils import greedy_requests, load_ours, make_engine, make_engine_pages
from tiny_models import VOCAB, save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return load_ours(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def workload(count=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 120, (count,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run(engine, prompts, max_tokens=90):
    results = engine.generate(greedy_requests(prompts, max_tokens, ignore_eos=True))
    engine.scheduler.check_integrity()
    return [r.completions[0].token_ids for r in results], engine.stats()


@pytest.mark.parametrize("adaptive", [True, False])
def test_tiny_pools_match_roomy_pools(tiny_llama, adaptive):
    prompts = workload()
    roomy, _ = run(make_engine(tiny_llama), prompts, 200)
    tight, stats = run(make_engine_pages(
        tiny_llama, device_pages=7, host_pages=10, initial_gpu_page_buffer=1,
        extension_gpu_page_buffer=1, decision_frequency_pages=1, host_kv_chunk_size=64,
        adaptive_chunk=adaptive, adaptive_chunk_min=64, max_prefill_tokens=96,
        host_kv_watermark=50.0), prompts, 200)
    assert tight == roomy
    assert stats["unloads"] > 0 and stats["loads"] > 0
    assert stats["evictions"] > 0 and stats["reprefill_tokens"] > 0
    assert stats["chunk_growths"] > 0
    assert stats["peak_device_pages"] <= 7 and stats["peak_host_pages"] <= 10


def test_fp8_kv_comes_back_from_the_host_tier_bit_for_bit(tiny_llama):
    """fp8 pages and their scales (stored with the slots innermost, carved from the host
    segment) survive unload and reload exactly: a device pool of 7 pages gives the roomy
    run's tokens. No eviction here: a re-prefill would requantize recomputed values."""
    prompts = workload()
    roomy, _ = run(make_engine(tiny_llama, kv_dtype="fp8_e4m3fn"), prompts, 200)
    tight, stats = run(make_engine_pages(
        tiny_llama, device_pages=7, host_pages=80, kv_dtype="fp8_e4m3fn",
        initial_gpu_page_buffer=1, extension_gpu_page_buffer=1, decision_frequency_pages=1,
        max_prefill_tokens=96), prompts, 200)
    assert tight == roomy
    assert stats["unloads"] > 0 and stats["loads"] > 0 and stats["evictions"] == 0
    assert stats["peak_device_pages"] <= 7


def test_prepack_packs_many_prompts_in_one_step(tiny_llama):
    engine = make_engine(tiny_llama, max_prefill_tokens=4096)
    for request in greedy_requests(workload(6, seed=1), 4):
        engine.add_request(request)
    out = engine.scheduler.schedule()
    assert len(out.chunks) == 6 and all(c.sample for c in out.chunks)


def test_long_prompt_is_prefilled_in_chunks(tiny_llama):
    prompt = workload(1, seed=2)[0] * 4
    whole, _ = run(make_engine(tiny_llama), [prompt], 20)
    chunked, stats = run(make_engine(tiny_llama, max_prefill_tokens=50), [prompt], 20)
    assert chunked == whole
    assert stats["steps"] >= len(prompt) // 50 + 20


def test_request_larger_than_pool_is_refused(tiny_llama):
    from batchgen.sched.scheduler import RequestTooLarge

    engine = make_engine_pages(tiny_llama, device_pages=2, host_pages=8)
    with pytest.raises(RequestTooLarge, match="gpu-kv-cache-size"):
        engine.add_request(greedy_requests([list(range(3, 100))], 100)[0])


def test_a_line_too_large_for_the_pools_says_how_to_answer_it(tiny_llama):
    """A job saves the kv_pool_too_small error as the line's result, so a rerun does not retry
    it: the message says to run the refused lines as a new input with the larger pool."""
    from types import SimpleNamespace

    from batchgen.runner.worker.worker import pool_too_small
    from batchgen.sched.scheduler import RequestTooLarge

    engine = make_engine_pages(tiny_llama, device_pages=2, host_pages=8)
    with pytest.raises(RequestTooLarge) as refused:
        engine.add_request(greedy_requests([list(range(3, 100))], 100)[0])
    err = pool_too_small(SimpleNamespace(custom_id="q7", line=7), refused.value)
    assert err.code == "kv_pool_too_small" and (err.custom_id, err.line) == ("q7", 7)
    assert err.message.startswith("line 7: needs ") and "--gpu-kv-cache-size" in err.message
    assert "new input" in err.message and "does not retry" in err.message


def test_answers_stop_at_the_model_context(tiny_llama):
    """Requests given straight to the engine (the bench, library users) are bounded by the
    model's positions as the job intake bounds them: max_tokens past the context ends the
    answer "length" at the last position (never an index past the rope table), and a prompt
    that fills the context is refused."""
    limit = tiny_llama.max_context
    engine = make_engine(tiny_llama, device_gb=0.2, host_gb=0.4)
    prompts = [[3 + i % (VOCAB - 3) for i in range(n)] for n in (limit - 20, limit - 1, 30)]
    results = engine.generate(greedy_requests(prompts, 100, ignore_eos=True))
    engine.scheduler.check_integrity()
    got = {r.request_id: r.completions[0] for r in results}
    assert [len(got[f"r{i}"].token_ids) for i in range(3)] == [20, 1, 100]
    assert {c.finish_reason.value for c in got.values()} == {"length"}
    with pytest.raises(ValueError, match="at least one token must be left"):
        engine.add_request(greedy_requests([[3] * limit], 10)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_copy_pages_moves_exactly_the_listed_pages(dtype):
    """Runs of consecutive pages are copied as one slice each: every listed page (and its fp8
    scales) lands on its partner, nothing else changes, whatever the runs look like."""
    from batchgen.engine.kv_cache import KVLayout, KVPool, copy_pages, page_runs

    layout = KVLayout(3, (2, 2, 8), dtype, torch.float32)
    src, dst = KVPool(layout, 12, "cpu"), KVPool(layout, 10, "cpu")
    for pool in (src, dst):
        pool.data.copy_(torch.randn(pool.data.shape).to(dtype))
        if pool.scales is not None:
            pool.scales.copy_(torch.rand(pool.scales.shape))
    before = [dst.data.float().clone(), None if dst.scales is None else dst.scales.clone()]
    src_pages, dst_pages = [4, 5, 6, 0, 11, 9, 10], [1, 2, 3, 7, 0, 8, 9]
    assert page_runs(src_pages, dst_pages) == [(4, 1, 3), (0, 7, 1), (11, 0, 1), (9, 8, 2)]
    copy_pages(src, dst, page_runs(src_pages, dst_pages))
    for s, d in zip(src_pages, dst_pages):
        assert torch.equal(dst.data[d].float(), src.data[s].float())
        if dtype == torch.float8_e4m3fn:
            assert torch.equal(dst.scales[d], src.scales[s])
    untouched = [p for p in range(10) if p not in dst_pages]
    assert torch.equal(dst.data[untouched].float(), before[0][untouched])
    if before[1] is not None:
        assert torch.equal(dst.scales[untouched], before[1][untouched])
    assert page_runs([], []) == []


def test_fp8_kv_roundtrip_error_is_bounded():
    from batchgen.engine.kv_cache import KVLayout, KVPool

    layout = KVLayout(2, (2, 3, 16), torch.float8_e4m3fn, torch.float32)
    pool = KVPool(layout, 4, "cpu")
    kv = torch.randn(100, 2, 3, 16) * torch.logspace(-3, 2, 100)[:, None, None, None]
    slots = torch.randperm(256)[:100]
    pool.store(1, slots, kv)
    back = pool.gather(1, torch.arange(4)).reshape(256, 2, 3, 16)[slots]
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of the per-(token, head)
    # scale's range; values tiny relative to their row's max lose more (absolute bound).
    amax = kv.abs().amax(-1, keepdim=True)
    assert ((back - kv).abs() <= amax * 2**-4 + 1e-12).all()


def test_fp8_kv_logits_stay_close(tiny_llama):
    from batchgen.forward_batch import ForwardBatch
    from batchgen.engine.kv_cache import KVLayout, KVPool

    prompt = workload(1, seed=3)[0]
    logits = {}
    for dtype in (torch.float32, torch.float8_e4m3fn):
        layout = KVLayout(3, tiny_llama.kv_token_shape, dtype, torch.float32)
        pool = KVPool(layout, 4, "cpu")
        batch = ForwardBatch.build([prompt], [0], [[0, 1, 2, 3]], [True], pool, torch.device("cpu"))
        with torch.inference_mode():
            logits[dtype] = tiny_llama(batch)[0]
    ref, fp8 = logits[torch.float32], logits[torch.float8_e4m3fn]
    # The per-value bound is tested above; this checks the plumbing end to end. The tiny model's
    # large random weights amplify the ~3% KV error to ~13% of the logits (garbage would be
    # ~100%).
    assert (fp8 - ref).norm() / ref.norm() < 0.25


@pytest.mark.gpu
def test_tiny_pools_match_roomy_pools_on_cuda(tmp_path):
    """Unloads copy device -> pinned host pages and loads copy them back on the GPU path."""
    from batchgen.models.loader import build_model, load_hf_config, read_safetensors

    folder = save_tiny_model("llama", tmp_path / "m")
    model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                        torch.device("cuda"))
    prompts = workload()
    roomy, _ = run(make_engine(model), prompts, 200)
    tight, stats = run(make_engine_pages(
        model, device_pages=7, host_pages=10, initial_gpu_page_buffer=1,
        extension_gpu_page_buffer=1, decision_frequency_pages=1, host_kv_chunk_size=64,
        adaptive_chunk_min=64, max_prefill_tokens=96, host_kv_watermark=50.0), prompts, 200)
    assert stats["unloads"] > 0 and stats["loads"] > 0
    assert tight == roomy


def test_host_threads_one_on_an_accelerator_unchanged_on_the_cpu(tiny_llama):
    assert host_threads(torch.device("cuda", 0), 16) == 1
    assert host_threads(torch.device("cpu"), 3) == 3
    before = torch.get_num_threads()
    make_engine(tiny_llama)
    assert torch.get_num_threads() == before  # the CPU engine keeps the model's threads
