"""Sampling: seeded reproducibility across batch compositions, top_k=1 == greedy, truncation."""

import torch

from batchgen.core import SamplingParams
from batchgen.engine.sampler import SamplingRows, sample, uniform_noise


def rows(params, seeds, steps=None):
    return SamplingRows(params, seeds, steps or [0] * len(params), [()] * len(params))


def test_noise_is_strictly_inside_unit_interval_and_batch_independent():
    seeds = torch.tensor([0, 1, 2**40 + 7], dtype=torch.int64)
    noise = uniform_noise(seeds, torch.tensor([0, 5, 9]), 50000)
    assert bool((noise > 0).all()) and bool((noise < 1).all())
    alone = uniform_noise(seeds[1:2], torch.tensor([5]), 50000)
    assert torch.equal(noise[1], alone[0])


def test_seeded_sampling_ignores_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    together = sample(logits, rows([p] * 4, [11, 12, 13, 14])).token_ids
    alone = [sample(logits[i:i + 1], rows([p], [11 + i])).token_ids[0] for i in range(4)]
    assert together == alone


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 300)
    out = sample(logits, rows([SamplingParams(temperature=1.3, top_k=1)] * 8, list(range(8))))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_masked_tokens_are_never_sampled():
    logits = torch.randn(64, 5000)
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[:, :3] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(64)]
    for step in range(20):
        out = sample(logits, rows(params, list(range(64)), [step] * 64))
        assert all(t < 3 for t in out.token_ids)


def test_top_p_and_min_p_truncate():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(50):
        t = sample(logits, rows([SamplingParams(top_p=0.7, seed=seed)], [seed])).token_ids[0]
        assert t in (0, 1)
        t = sample(logits, rows([SamplingParams(min_p=0.5, seed=seed)], [seed])).token_ids[0]
        assert t in (0, 1)


def test_top_p_counts_mass_among_the_top_k_only():
    """top_k 3 keeps [0.4, 0.3, 0.2], renormalised [0.44, 0.33, 0.22]: top_p 0.42 then keeps
    the first token alone (of the full softmax it holds 0.4 < 0.42, so the second would stay)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    seen = {sample(logits, rows([SamplingParams(top_k=3, top_p=0.42, seed=s)], [s])).token_ids[0]
            for s in range(60)}
    assert seen == {0}


def test_truncation_keeps_what_hf_warpers_keep():
    from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    from batchgen.engine.sampler import _truncate

    gen = torch.Generator().manual_seed(3)
    for case in range(40):
        logits = torch.randn(1, 64, generator=gen) * 3
        top_k = [0, 1, 5, 20][case % 4]
        top_p = [1.0, 0.3, 0.8, 0.95][(case // 4) % 4]
        min_p = [0.0, 0.05][case % 2]
        ours = _truncate(torch.log_softmax(logits, -1),
                         [SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)])
        ref = logits
        if top_k:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = TopPLogitsWarper(top_p)(None, ref)
        if min_p:
            ref = MinPLogitsWarper(min_p)(None, ref)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), (top_k, top_p, min_p)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(2, 50)
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    out = sample(logits, rows([p, p], [0, 0]))
    ref = torch.log_softmax(logits, -1)
    for row, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - ref[row, lp.token_id].item()) < 1e-6
        assert [t for t, _ in lp.top] == ref[row].topk(3).indices.tolist()


def test_bans_apply_to_their_own_row_only():
    """Each row's banned ids (EOS before min_tokens) are masked in that row alone, in one
    indexed write; greedy rows then take their best allowed token."""
    logits = torch.zeros(3, 8)
    logits[:, 5] = 3.0  # everyone's favourite
    logits[:, 2] = 2.0
    logits[:, 7] = 1.0
    params = [SamplingParams(temperature=0.0)] * 3
    banned = [(5,), (), (5, 2)]
    out = sample(logits, SamplingRows(params, [0, 0, 0], [0, 0, 0], banned))
    assert out.token_ids == [2, 5, 7]


def test_bf16_logits_sample_as_their_float32_copy():
    """Models hand over logits in their own dtype; greedy-only steps take the argmax of those
    directly, every other step samples from a float32 copy: both as if given float32."""
    torch.manual_seed(3)
    logits = (torch.randn(16, 700) * 4).to(torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    exact = logits.float()
    greedy = rows([SamplingParams(temperature=0.0)] * 16, list(range(16)))
    assert sample(logits, greedy).token_ids == sample(exact, greedy).token_ids
    assert sample(logits, greedy).token_ids[3] == 10
    mixed = rows([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
                  SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)] * 5
                 + [SamplingParams(temperature=0.7, top_k=50, seed=1)], list(range(16)))
    ours, reference = sample(logits, mixed), sample(exact, mixed)
    assert ours.token_ids == reference.token_ids
    assert ours.logprobs == reference.logprobs


def test_top_p_one_keeps_every_token_whatever_shares_the_batch():
    """float32 cumulative sums over a large vocabulary reach 1.0 thousands of tokens before
    the tail ends: top_p 1 must still drop none of them, also beside a row whose top_p or
    top_k makes the filter run (else that row's draws would depend on its batch)."""
    from batchgen.engine.sampler import _truncate

    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)) * 3
    logprobs = torch.log_softmax(logits, -1).repeat(3, 1)
    out = _truncate(logprobs, [SamplingParams(), SamplingParams(top_p=0.5),
                               SamplingParams(top_k=20000)])
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[2]).sum() == 20000
