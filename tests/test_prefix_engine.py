"""Prefix caching in the engine on a tiny model: answers are the same with it on and off
(roomy pools, and tight pools that unload, load and evict), n > 1 choices fork from one
prefill, and the reuse is counted per request and in the stats."""

import pytest
import torch

from batchgen.core import Request, SamplingParams
from engine_utils import load_ours, make_engine, make_engine_pages
from tiny_models import VOCAB, save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return load_ours(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def shared_prompts(count=8, prefix_len=150, seed=0, prefixes=2):
    """`count` prompts: one of `prefixes` shared prefixes, then 3..40 tokens of their own."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, VOCAB, (prefix_len,), generator=gen).tolist()
             for _ in range(prefixes)]
    tails = [torch.randint(3, VOCAB, (int(torch.randint(3, 40, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in range(count)]
    return [heads[i % prefixes] + tail for i, tail in enumerate(tails)]


def answers(engine, prompts, max_tokens=40, n=1, temperature=0.0):
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, n=n, seed=i,
                                                   temperature=temperature, ignore_eos=True))
                for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    engine.scheduler.check_integrity()
    return [[c.token_ids for c in r.completions] for r in results], results, engine.stats()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3fn"])
def test_greedy_answers_equal_with_caching_on_and_off(tiny_llama, kv_dtype):
    prompts = shared_prompts()
    off, _, off_stats = answers(make_engine(tiny_llama, kv_dtype=kv_dtype,
                                            enable_prefix_caching=False), prompts)
    on, results, stats = answers(make_engine(tiny_llama, kv_dtype=kv_dtype), prompts)
    assert on == off
    assert off_stats["cached_prompt_tokens"] == 0 and off_stats["prefix_hit_rate"] == 0
    # The prefill budget admits every prompt at once; the first of each prefix computes it
    # and the others wait a step, then map its two full pages and copy the start of its
    # third (the prefix's last 22 tokens, from the first one's page while it runs).
    assert [r.cached_tokens for r in results] == [0, 0] + [150] * 6
    assert stats["cached_prompt_tokens"] == 6 * 150 and stats["shared_tails"] == 6
    assert stats["prefix_hit_rate"] == pytest.approx(6 * 150 / sum(map(len, prompts)))
    assert {r.request.request_id for r in results} == {f"r{i}" for i in range(8)}


def test_tight_pools_with_caching_match_caching_off(tiny_llama):
    """Unloads, loads and evictions of sequences holding shared pages."""
    prompts = shared_prompts(count=10, prefix_len=140, seed=1)
    off, _, _ = answers(make_engine(tiny_llama, enable_prefix_caching=False), prompts, 150)
    engine = make_engine_pages(
        tiny_llama, device_pages=9, host_pages=10, initial_gpu_page_buffer=1,
        extension_gpu_page_buffer=1, decision_frequency_pages=1, host_kv_chunk_size=64,
        adaptive_chunk_min=64, max_prefill_tokens=96, host_kv_watermark=50.0)
    on, _, stats = answers(engine, prompts, 150)
    assert on == off
    assert stats["unloads"] > 0 and stats["loads"] > 0 and stats["evictions"] > 0
    assert stats["cached_prompt_tokens"] > 0
    engine.scheduler.clear_prefix_cache()
    assert engine.scheduler.device.num_free == engine.scheduler.device.num_pages
    assert engine.scheduler.host.num_free == engine.scheduler.host.num_pages


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_choices_fork_from_one_prefill(tiny_llama, temperature):
    prompts = shared_prompts(count=3, prefix_len=100, seed=2, prefixes=3)
    off, _, _ = answers(make_engine(tiny_llama, enable_prefix_caching=False), prompts, 30,
                        n=4, temperature=temperature)
    on, results, stats = answers(make_engine(tiny_llama), prompts, 30, n=4,
                                 temperature=temperature)
    assert on == off
    # A fork copies the partial last prompt page; a prompt of 64k + 1 tokens has none.
    assert stats["forks"] == 3 * sum((len(p) - 1) % 64 != 0 for p in prompts) > 0
    # Each request's prompt is computed once: three of its four choices only its last token.
    assert stats["cached_prompt_tokens"] == sum(3 * (len(p) - 1) for p in prompts)
    assert [r.cached_tokens for r in results] == [0, 0, 0]
    if temperature:
        assert all(len({tuple(c) for c in choices}) > 1 for choices in on)


def test_a_later_request_maps_an_earlier_ones_prefix(tiny_llama):
    """After the first request finished, its pages stay cached (idle) and the second maps
    them; cached_tokens is reported per request."""
    prompt = shared_prompts(count=1, prefix_len=200, seed=3)[0]
    engine = make_engine(tiny_llama)
    first, results1, _ = answers(engine, [prompt], 20)
    again = engine.generate([Request("again", prompt, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True))])
    assert again[0].completions[0].token_ids == first[0][0]
    assert results1[0].cached_tokens == 0
    assert again[0].cached_tokens == (len(prompt) - 1) // 64 * 64


def test_waiting_prompts_are_hashed_while_a_step_runs(tiny_llama):
    """Each step that samples hands the scheduler its prepare() after queueing the forward and
    before reading the samples (on a GPU the hashing overlaps the step); the prompts left
    waiting are hashed there, not by the decision that admits them."""
    engine = make_engine(tiny_llama, max_decode_batch=2)
    calls = []
    prepare = engine.scheduler.prepare

    def spy():
        calls.append([len(s.page_keys) for s in engine.scheduler.waiting])
        prepare()

    engine.scheduler.prepare = spy
    off, _, _ = answers(make_engine(tiny_llama, enable_prefix_caching=False), shared_prompts())
    on, _, _ = answers(engine, shared_prompts())
    assert on == off
    assert calls and engine.times.decode_steps < engine.steps  # single steps ran it
    # The first call finds the waiting prompts filed by their first page only; prepare()
    # hashes their prefix's pages (2 full pages of 150 tokens) before the next decision.
    assert calls[0] and set(calls[0]) == {1}
    assert any(keys and min(keys) >= 2 for keys in calls[1:])


def _family_prompts(vocab, prefix_len=140, count=5, seed=4):
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (prefix_len,), generator=gen).tolist()
    return [head + torch.randint(3, vocab, (5 + 7 * i,), generator=gen).tolist()
            for i in range(count)]


def test_mla_latent_pages_share(tmp_path):
    """DeepSeek's MLA latent cache shares pages like GQA pages (answers equal on and off)."""
    from test_deepseek import VOCAB as DS_VOCAB, save_tiny

    save_tiny(tmp_path / "ds")
    model = load_ours(tmp_path / "ds")
    prompts = _family_prompts(DS_VOCAB)
    off, _, _ = answers(make_engine(model, enable_prefix_caching=False), prompts, 12, n=2)
    on, _, stats = answers(make_engine(model), prompts, 12, n=2)
    assert on == off and stats["cached_prompt_tokens"] > 0 and stats["forks"] > 0


def test_sliding_window_layers_share(tmp_path):
    """gpt-oss's sliding-window layers read cached pages through the same position mask (its
    window is far shorter than the 140-token shared prefix)."""
    from test_gpt_oss import VOCAB as OSS_VOCAB, WINDOW, tiny_config
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    GptOssForCausalLM(tiny_config()).float().eval().save_pretrained(
        str(tmp_path / "oss"), safe_serialization=True)
    model = load_ours(tmp_path / "oss")
    prompts = _family_prompts(OSS_VOCAB)
    assert WINDOW < 140
    off, _, _ = answers(make_engine(model, enable_prefix_caching=False), prompts, 12, n=2)
    on, _, stats = answers(make_engine(model), prompts, 12, n=2)
    assert on == off and stats["cached_prompt_tokens"] > 0 and stats["forks"] > 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_other_gqa_families_share(family, tmp_path):
    """Qwen2 (QKV biases), Qwen3 (per-head q/k norms), Mistral and the MoE families on their
    attention share pages like Llama."""
    model = load_ours(save_tiny_model(family, tmp_path / family))
    prompts = _family_prompts(VOCAB)
    off, _, _ = answers(make_engine(model, enable_prefix_caching=False), prompts, 12, n=2)
    on, _, stats = answers(make_engine(model), prompts, 12, n=2)
    assert on == off and stats["cached_prompt_tokens"] > 0 and stats["forks"] > 0


def test_a_continued_request_never_reports_its_last_prompt_token_as_cached(tiny_llama):
    """Two requests with the same prompt, continued from a checkpoint with the same greedy
    answer so far: the second maps the first's pages past the end of its prompt, yet its
    cached_tokens stops short of the last prompt token (job-files.md), as an uninterrupted
    run reports (there the second copies the start of the first's partly filled page: every
    prompt token but the last), never the whole prompt."""
    import dataclasses

    prompt = shared_prompts(count=1, prefix_len=100, seed=5)[0][:100]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    requests = [Request("a", prompt, params), Request("b", prompt, params)]
    whole = make_engine(tiny_llama).generate(requests)
    engine = make_engine(tiny_llama)
    for request in requests:
        engine.add_request(request)
    for _ in range(6):
        engine.step()
    engine.settle()
    state = engine.inflight_state()
    assert all(len(p.token_ids) > 30 for choices in state.values() for p in choices)
    resumed = make_engine(tiny_llama).generate(
        [dataclasses.replace(r, resume=state[r.request_id]) for r in requests])
    assert [r.completions[0].token_ids for r in resumed] == [
        r.completions[0].token_ids for r in whole]
    assert [r.cached_tokens for r in whole] == [0, len(prompt) - 1]
    assert all(r.cached_tokens <= len(prompt) - 1 for r in resumed)
