"""Our models vs HF transformers on the same random weights: greedy tokens and logits."""

import pytest
import torch

from batchgen.engine.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from engine_utils import greedy_requests, hf_greedy, load_ours, make_engine
from tiny_models import VOCAB, save_tiny_model

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 64, 65, 150]  # within a page, exactly one page, crossing pages
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return request.param, hf, load_ours(folder)


def test_greedy_tokens_match_hf_batched(family_models):
    _, hf, ours = family_models
    ps = prompts()
    engine = make_engine(ours)
    results = engine.generate(greedy_requests(ps, 80, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 80)


def test_logits_match_hf(family_models):
    _, hf, ours = family_models
    prompt = prompts(1)[4]
    layout = KVLayout(ours.config.num_hidden_layers, ours.kv_token_shape,
                      torch.float32, torch.float32)
    pool = KVPool(layout, 8, "cpu")
    batch = ForwardBatch.build([prompt], [0], [list(range(8))], [True], pool, torch.device("cpu"))
    with torch.inference_mode():
        ours_logits = ours(batch)[0]
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours_logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_batched_equals_one_at_a_time(family_models):
    _, _, ours = family_models
    ps = prompts(2)
    together = [r.completions[0].token_ids
                for r in make_engine(ours).generate(greedy_requests(ps, 40, ignore_eos=True))]
    alone = [make_engine(ours).generate(greedy_requests([p], 40, ignore_eos=True))[0]
             .completions[0].token_ids
             for p in ps]
    assert together == alone
