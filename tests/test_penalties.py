"""Presence, frequency and repetition penalties: on logits against a plain reference (and HF's
repetition processor), and end to end against a greedy loop over HF's logits."""

import pytest
import torch

from batchgen.core import Request, SamplingParams
from batchgen.engine.penalties import Penalties
from batchgen.sched.sequence import Sequence
from engine_utils import load_ours, make_engine
from tiny_models import VOCAB, save_tiny_model


def seq(prompt, answer, **penalties):
    return Sequence(0, "r", 0, prompt + answer, len(prompt), SamplingParams(**penalties), 0)


def reference(logits, prompt, answer, presence=0.0, frequency=0.0, repetition=1.0):
    """vLLM's order: repetition over prompt and answer, then frequency and presence over the
    answer."""
    out = logits.clone()
    for token in set(prompt) | set(answer):
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(answer):
        out[token] -= frequency * answer.count(token) + presence
    return out


def test_penalties_match_the_reference_and_hf_repetition_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    prompt, answer = [1, 2, 3, 3], [3, 7, 7, 7, 9]
    seqs = [seq(prompt, answer, presence_penalty=0.7, frequency_penalty=0.3),
            seq(prompt, answer),  # not penalized: left as it is
            seq(prompt, answer, repetition_penalty=1.8),
            seq(prompt, answer, presence_penalty=-0.5, frequency_penalty=1.0,
                repetition_penalty=0.8)]
    out = Penalties.of(seqs).apply(logits)
    assert torch.equal(out[1], logits[1])
    assert torch.allclose(out[0], reference(logits[0], prompt, answer, 0.7, 0.3))
    assert torch.allclose(out[3], reference(logits[3], prompt, answer, -0.5, 1.0, 0.8))
    hf = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([prompt + answer]), logits[2:3])
    assert torch.allclose(out[2], hf[0])


def test_counts_follow_the_samples_and_carry_to_a_continuation():
    logits = torch.zeros(3, 20)
    seqs = [seq([1], [5], frequency_penalty=1.0), seq([1], []), seq([1], [], presence_penalty=2)]
    penalties = Penalties.of(seqs)
    penalties.apply(logits)
    penalties.update(torch.tensor([5, 6, 8]))
    nxt = penalties.continued([2, 0])  # rows 2 and 0 go on, in that order
    out = nxt.apply(logits[:2])
    assert out[0, 8] == -2.0 and out[0].count_nonzero() == 1
    assert out[1, 5] == -2.0 and out[1].count_nonzero() == 1
    assert penalties.continued([1]) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path_factory.mktemp("pen"))
    return load_ours(folder), AutoModelForCausalLM.from_pretrained(str(folder),
                                                                   dtype=torch.float32)


@pytest.mark.parametrize("penalties", [
    dict(frequency_penalty=2.0), dict(presence_penalty=2.0, frequency_penalty=-0.3),
    dict(repetition_penalty=3.0), dict(repetition_penalty=0.5, presence_penalty=1.0)])
def test_greedy_with_penalties_equals_a_loop_over_hf_logits(tiny, penalties):
    model, hf = tiny
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 40, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **penalties)
    plain = make_engine(model).generate(
        [Request(f"p{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
         for i, p in enumerate(prompts)])
    ours = make_engine(model).generate([Request(f"p{i}", p, params)
                                        for i, p in enumerate(prompts)])
    coefficients = (penalties.get("presence_penalty", 0.0),
                    penalties.get("frequency_penalty", 0.0),
                    penalties.get("repetition_penalty", 1.0))
    for prompt, result, unpenalized in zip(prompts, ours, plain):
        answer = []
        with torch.inference_mode():
            for _ in range(24):
                logits = hf(torch.tensor([prompt + answer])).logits[0, -1].float()
                answer.append(int(reference(logits, prompt, answer, *coefficients).argmax()))
        assert result.completions[0].token_ids == answer
        assert answer != unpenalized.completions[0].token_ids  # the penalty changed something


def test_bursts_and_their_continuations_count_every_sample(tiny):
    """Bursts of 4 steps whose continuations are queued before the host read the last step
    (as on a GPU): the same tokens as one step per sync, so the counts carried to each
    continuation hold the tokens the host had not seen. Negative penalties make the answers
    repeat their own tokens, so a count missed shows at once."""
    from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
    from batchgen.engine.engine import Engine

    model, _ = tiny
    gen = torch.Generator().manual_seed(9)
    requests = [Request(f"b{i}", torch.randint(3, VOCAB, (9 + 7 * i,), generator=gen).tolist(),
                        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                       **kind))
                for i, kind in enumerate([dict(frequency_penalty=-0.6),  # repeats what it said
                                          dict(presence_penalty=-1.5, repetition_penalty=0.7),
                                          dict(frequency_penalty=1.0)])]
    tokens = []
    for burst in (1, 4):
        cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1),
                           runtime=RuntimeConfig(decode_burst_steps=burst)).validate()
        engine = Engine(model, cfg)
        engine.runner.overlaps_host = True
        tokens.append([r.completions[0].token_ids for r in engine.generate(requests)])
        assert burst == 1 or engine.times.bursts > 3
    assert tokens[0] == tokens[1]


def test_logit_bias_is_added_before_the_penalties_and_carried_to_a_continuation():
    logits = torch.zeros(4, 20)
    seqs = [seq([1], [5], frequency_penalty=1.0, logit_bias=((5, 3.0), (7, -100.0))),
            seq([1], []), seq([1], [], logit_bias=((2, 50.0),)),
            seq([4], [], repetition_penalty=2.0, logit_bias=((4, 3.0), (6, -3.0)))]
    penalties = Penalties.of(seqs)
    out = penalties.apply(logits)
    assert out[0, 5] == 2.0 and out[0, 7] == -100.0 and out[0].count_nonzero() == 2
    assert torch.equal(out[1], logits[1])
    assert out[2, 2] == 50.0 and out[2].count_nonzero() == 1
    # vLLM's order: (logit + bias) / repetition for a seen token; an unseen one keeps its bias.
    assert out[3, 4] == 1.5 and out[3, 6] == -3.0 and out[3].count_nonzero() == 2
    penalties.update(torch.tensor([2, 6, 2, 6]))
    nxt = penalties.continued([2, 0, 3])
    out = nxt.apply(logits[:3])
    assert out[0, 2] == 50.0 and out[0].count_nonzero() == 1  # no penalty: its bias only
    assert out[1, 5] == 2.0 and out[1, 7] == -100.0 and out[1, 2] == -1.0
    assert out[2, 4] == 1.5 and out[2, 6] == -6.0  # 6 drawn: seen now, (0 - 3) * 2


def test_logit_bias_forces_and_forbids_tokens_through_bursts(tiny):
    """+100 on one token makes greedy decoding emit it at every step, bursts included; -100
    on the token a plain greedy answer starts with keeps it out of the answer's first place."""
    from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
    from batchgen.engine.engine import Engine

    model, _ = tiny
    prompt = list(range(3, 20))
    greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = make_engine(model).generate([Request("p", prompt, SamplingParams(**greedy))])
    first = plain[0].completions[0].token_ids[0]
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1),
                       runtime=RuntimeConfig(decode_burst_steps=4)).validate()
    engine = Engine(model, cfg)
    engine.runner.overlaps_host = True
    forced, banned = engine.generate([
        Request("forced", prompt, SamplingParams(**greedy, logit_bias=((11, 100.0),))),
        Request("banned", prompt, SamplingParams(**greedy, logit_bias=((first, -100.0),)))])
    assert forced.completions[0].token_ids == [11] * 20
    assert engine.times.bursts > 0
    assert banned.completions[0].token_ids[0] != first


@pytest.mark.parametrize("value,message", [
    ({"7": 5, "12": -100}, None),
    ({"7": 101}, "logit_bias must map token ids"),
    ({"x": 1}, "logit_bias key 'x' is not a token id"),
    ([7, 1], "logit_bias must be an object"),
    ({"7": "high"}, "logit_bias['7'] must be a number in [-100, 100], got str 'high'"),
    ({"7": 1, "07": 2}, "logit_bias names token 7 twice"),
    ({"-3": 1}, "logit_bias must map token ids")])
def test_intake_reads_logit_bias_as_openai_writes_it(value, message):
    from batchgen.io.intake import IntakeError, parse_record
    from batchgen.io.reader import RawRecord

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "logit_bias": value}}
    parsed = parse_record(RawRecord(1, line))
    if message is None:
        assert parsed.sampling.logit_bias == ((7, 5.0), (12, -100.0))
    else:
        assert isinstance(parsed, IntakeError) and message in parsed.message, parsed
        assert parsed.param == "logit_bias"
