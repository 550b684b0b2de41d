"""Engine-level sampling: n choices with a seed reproduce whatever shares the batch; greedy
logprobs equal the log-softmax of HF's logits; stop strings and min_tokens."""

import pytest
import torch

from batchgen.core import Request, SamplingParams
from engine_utils import load_ours, make_engine
from tiny_models import VOCAB, save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    return load_ours(folder), AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def choices(engine, requests, rid):
    return [c.token_ids
            for c in {r.request_id: r for r in engine.generate(requests)}[rid].completions]


def test_n_choices_with_seed_are_reproducible_across_batches(tiny):
    model, _ = tiny
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=1234, n=3)
    target = Request("t", list(range(5, 40)), params)
    alone = choices(make_engine(model), [target], "t")
    others = [Request(f"o{i}", list(range(7, 7 + 13 * i)),
                      SamplingParams(max_tokens=30, temperature=1.0))
              for i in range(1, 6)]
    crowded = choices(make_engine(model),
                      others[:2] + [Request("t", target.prompt_token_ids, params)] + others[2:],
                      "t")
    assert alone == crowded
    assert len({tuple(c) for c in alone}) > 1  # the three choices differ from each other


def test_greedy_logprobs_match_hf_log_softmax(tiny):
    model, hf = tiny
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    result = make_engine(model).generate([Request("g", prompt, SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True))])[0]
    completion = result.completions[0]
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    for step, lp in enumerate(completion.logprobs):
        assert lp.token_id == completion.token_ids[step]
        assert abs(lp.logprob - ref[step, lp.token_id].item()) < 1e-4
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


def test_min_tokens_suppresses_eos(tiny):
    model, _ = tiny
    eos = 2
    prompt = list(range(3, 20))
    engine = make_engine(model, eos=(eos,))
    result = engine.generate([Request("m", prompt, SamplingParams(
        max_tokens=12, min_tokens=12, temperature=1.0, seed=3))])[0]
    assert len(result.completions[0].token_ids) == 12
    assert eos not in result.completions[0].token_ids


def test_negative_seeds_are_seeds_like_any_other(tiny):
    """OpenAI and vLLM take any 64-bit signed seed: a negative one reproduces its answer and
    draws apart from the positive seed of the same low bits."""
    model, _ = tiny

    def answer(seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return choices(make_engine(model), [Request("s", list(range(5, 30)), params)], "s")

    assert answer(-1) == answer(-1)
    assert len({tuple(answer(s)[0]) for s in (-1, 2**32 - 1, -2**63, 2**63 - 1)}) == 4


def test_a_request_without_seed_draws_by_job_seed_and_id(tiny):
    """A request without `seed` draws with one derived from the job's --seed and its id:
    the same answer alone or in a crowd and choice by choice, another under another --seed."""
    from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
    from batchgen.engine.engine import Engine

    model, _ = tiny
    params = SamplingParams(max_tokens=16, temperature=1.0, n=2, ignore_eos=True)
    prompt = list(range(5, 40))

    def answer(job_seed, crowd=0):
        engine = Engine(model, EngineConfig(
            memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1),
            runtime=RuntimeConfig(seed=job_seed)).validate())
        others = [Request(f"o{i}", list(range(9, 20 + 7 * i)), params) for i in range(crowd)]
        return choices(engine, others + [Request("q", prompt, params)], "q")

    alone = answer(0)
    assert alone == answer(0, crowd=3)
    assert alone[0] != alone[1]
    assert answer(1) != alone
