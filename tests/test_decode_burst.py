"""Decode bursts (several decode steps per host sync) give exactly the output of one step per
sync: sequences stopping inside a burst (EOS, stop ids, stop strings, max_tokens), sampling with
seeds and truncation, min_tokens bans, logprobs, n > 1, penalties (their counts carried from a
burst to its continuation), and tight pools that unload and evict."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig, SchedulerConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.burst import DecodeBurst
from batchgen.engine.engine import Engine
from batchgen.sched.sequence import SeqState
from engine_utils import load_ours, page_bytes
from tiny_models import VOCAB, save_tiny_chat_model, save_tiny_model


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_chat_model(tmp_path_factory.mktemp("burst-chat"))
    return load_ours(folder), AutoTokenizer.from_pretrained(str(folder))


def engine(model, tokenizer, burst, device_pages=None, host_pages=None, overlap=True,
           **sched):
    """An engine with `burst`-step decode bursts. `overlap`: queue each burst's continuation
    before its last step is read, as on a GPU (the CPU's runner does not); None: the runner's
    own choice."""
    size = page_bytes(model)
    memory = MemoryConfig(
        gpu_kv_cache_size=0.05 if device_pages is None else (device_pages + 0.5) * size / 1e9,
        host_kv_cache_size=0.1 if host_pages is None else (host_pages + 0.5) * size / 1e9)
    cfg = EngineConfig(memory=memory, scheduler=SchedulerConfig(**sched),
                       runtime=RuntimeConfig(decode_burst_steps=burst)).validate()
    eng = Engine(model, cfg, tokenizer, (tokenizer.eos_token_id,))
    if overlap is not None:
        eng.runner.overlaps_host = overlap
    return eng


def mixed_requests(tokenizer, seed=0, count=10, vocab=None):
    """Requests of every kind; without a tokenizer (then `vocab` is given) no stop strings."""
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab or len(tokenizer)
    word = int(torch.randint(3, vocab, (1,), generator=gen))
    stops = (dict(stop=(tokenizer.decode([word]), "e")) if tokenizer
             else dict(stop_token_ids=(word,)))
    kinds = [
        dict(temperature=0.0, max_tokens=37),
        dict(temperature=0.0, max_tokens=5, logprobs=True, top_logprobs=3),
        dict(temperature=0.8, top_k=20, seed=7, max_tokens=40, min_tokens=30),
        dict(temperature=1.0, top_p=0.9, min_p=0.05, max_tokens=50, n=2),
        dict(temperature=1.0, max_tokens=60, logprobs=True, **stops),
        dict(temperature=1.2, max_tokens=45, stop_token_ids=tuple(range(100, 1100))),
        dict(temperature=0.0, max_tokens=64, ignore_eos=True),
        dict(temperature=0.0, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5),
        dict(temperature=0.9, seed=3, max_tokens=30, repetition_penalty=1.4, n=2),
    ]
    requests = []
    for i in range(count):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 90, (1,), generator=gen)),),
                               generator=gen).tolist()
        requests.append(Request(f"r{i}", prompt, SamplingParams(**kinds[i % len(kinds)])))
    return requests


def long_requests(count=4):
    """Greedy, EOS ignored, long: they outgrow a tight device pool and force unloads."""
    gen = torch.Generator().manual_seed(11)
    return [Request(f"long{i}", torch.randint(3, 500, (60,), generator=gen).tolist(),
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=150))
            for i in range(count)]


def outcome(results):
    """What must not depend on the burst length. Log-probabilities compare within 1e-4: a
    batch of another size may round the float32 matmuls differently (rounding them to 4
    decimals instead flips the last digit now and then), which may also swap two near-tied
    top alternatives: those compare by id, not by rank."""
    return {r.request_id: [(c.token_ids, c.finish_reason, c.text, c.stop_reason,
                            None if c.logprobs is None else
                            [(lp.token_id, pytest.approx(lp.logprob, abs=1e-4),
                              {t: pytest.approx(v, abs=1e-4) for t, v in lp.top})
                             for lp in c.logprobs])
                           for c in r.completions] for r in results}


def count_bursts(eng):
    """The length of every burst the engine queues (continuations included)."""
    bursts = []
    queue_burst = eng.runner.queue_burst

    def counting(chunks, rows, *args, **kwargs):
        bursts.append(len(rows))
        return queue_burst(chunks, rows, *args, **kwargs)

    eng.runner.queue_burst = counting
    return bursts


def count_continuations(eng):
    """The length of every burst queued while the one before it still ran."""
    continued = []
    queue_burst = eng.runner.queue_burst

    def counting(chunks, rows, after=None, **kwargs):
        if after is not None:
            continued.append(len(rows))
        return queue_burst(chunks, rows, after, **kwargs)

    eng.runner.queue_burst = counting
    return continued


@pytest.mark.parametrize("burst", [2, 8, 32])
def test_bursts_equal_one_step_per_sync(chat, burst):
    model, tokenizer = chat
    reference = outcome(engine(model, tokenizer, 1).generate(mixed_requests(tokenizer)))
    eng = engine(model, tokenizer, burst)
    bursts, continued = count_bursts(eng), count_continuations(eng)
    assert outcome(eng.generate(mixed_requests(tokenizer))) == reference
    assert max(bursts) == burst  # bursts really ran, at full length
    assert continued  # and some were queued before the one they follow had ended
    eng.scheduler.check_integrity()
    assert eng.scheduler.device.num_used == 0 and eng.scheduler.host.num_used == 0
    # The request mix really stops inside bursts, for every reason.
    reasons = {c[1].value for r in reference.values() for c in r}
    assert reasons == {"stop", "length"}


def test_without_overlap_results_come_with_their_burst(chat):
    """On the CPU (nothing runs while the host goes on) no continuation is queued: a request
    that finished in a burst is returned by the step() that ran the burst, and no burst
    computes rows that had already finished."""
    model, tokenizer = chat
    eng = engine(model, tokenizer, 8, overlap=None)  # the runner's own choice
    assert not eng.runner.overlaps_host
    continued = count_continuations(eng)
    greedy = dict(temperature=0.0, ignore_eos=True)
    for i, length in enumerate((5, 13, 24)):
        eng.add_request(Request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=length,
                                                                       **greedy)))
    finished_at = {}
    while eng.has_unfinished():
        steps_before = eng.steps
        for done in eng.step():
            finished_at[done.request_id] = (steps_before, eng.steps)
    assert not continued
    # Each request came back from the step() whose forwards drew its last token: the prompt
    # step draws token 1, so token n is drawn by forward n (counting from 1).
    for rid, length in (("r0", 5), ("r1", 13), ("r2", 24)):
        first, last = finished_at[rid]
        assert first < length <= last, (rid, first, last)


def test_bursts_with_tight_pools_equal_one_step_per_sync(chat):
    model, tokenizer = chat
    tight = dict(device_pages=7, host_pages=10, initial_gpu_page_buffer=1,
                 extension_gpu_page_buffer=1, decision_frequency_pages=1,
                 max_prefill_tokens=96, host_kv_watermark=50.0, host_kv_chunk_size=64,
                 adaptive_chunk_min=64)

    def requests():
        return long_requests() + mixed_requests(tokenizer, 1)

    reference = outcome(engine(model, tokenizer, 1, **tight).generate(requests()))
    eng = engine(model, tokenizer, 16, **tight)
    bursts, continued = count_bursts(eng), count_continuations(eng)
    assert outcome(eng.generate(requests())) == reference
    stats = eng.stats()
    assert stats["unloads"] > 0 and stats["evictions"] > 0 and max(bursts) > 1 and continued
    assert stats["peak_device_pages"] <= 7
    eng.scheduler.check_integrity()


def test_bursts_shrink_when_finished_sequences_are_short(chat):
    model, tokenizer = chat
    eng = engine(model, tokenizer, 8)
    bursts = count_bursts(eng)
    greedy = dict(temperature=0.0, ignore_eos=True)
    eng.generate([Request(f"s{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=20, **greedy))
                  for i in range(4)])
    assert max(bursts) == 8  # nothing had finished yet
    bursts.clear()
    eng.generate([Request("later", [9, 10, 11], SamplingParams(max_tokens=40, **greedy))])
    assert max(bursts) == 1  # finished sequences are 20 tokens long: 20 // 16 = 1


@settings(max_examples=15, deadline=None)
@given(burst=st.integers(1, 40), decision_pages=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_burst_never_outruns_the_reserved_pages(chat, burst, decision_pages, seed):
    """Every slot a burst writes lies in its row's own pages (or is -1), and the positions of
    rows still decoding are covered: a burst never writes into another sequence's page."""
    model, tokenizer = chat
    eng = engine(model, tokenizer, burst, device_pages=12, host_pages=30,
                 initial_gpu_page_buffer=1, extension_gpu_page_buffer=3,
                 decision_frequency_pages=decision_pages)
    checked = []
    queue_burst = eng.runner.queue_burst

    def checking(chunks, rows, *args, **kwargs):
        unread = torch.zeros(len(chunks), dtype=torch.long)  # a continuation's inputs
        plan = DecodeBurst.build(chunks, len(rows), eng.runner.device_pool, torch.device("cpu"),
                                 unread)
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.state is SeqState.FINISHED:
                continue  # finished while the burst before this one ran: its pages are gone
            own = set(seq.device_pages)
            for step in range(len(rows)):
                slot = int(plan.slots[step, row])
                still_decoding = chunk.end - seq.prompt_len + step < seq.sampling.max_tokens
                assert slot >= 0 or not still_decoding
                assert slot < 0 or slot // 64 in own
        checked.append(len(rows))
        return queue_burst(chunks, rows, *args, **kwargs)

    eng.runner.queue_burst = checking
    gen = torch.Generator().manual_seed(seed)
    requests = [Request(f"q{i}",
                        torch.randint(3, 500, (int(torch.randint(2, 100, (1,), generator=gen)),),
                                      generator=gen).tolist(),
                        SamplingParams(temperature=0.0, ignore_eos=True,
                                       max_tokens=int(torch.randint(32, 150, (1,), generator=gen))))
                for i in range(5)]
    eng.generate(requests)
    eng.scheduler.check_integrity()
    # Bursts shrink to 1/16 of the finished answers' mean length: answers of >= 32 tokens
    # keep them >= 2 steps, so a burst > 1 must have been checked.
    assert burst == 1 or checked


@pytest.mark.gpu
def test_bursts_replay_cuda_graphs_like_single_steps(tmp_path):
    """On CUDA a burst replays the decode graphs back to back with no host sync between its
    steps; its output equals syncing after every token."""
    from batchgen.models.loader import build_model, load_hf_config, read_safetensors

    folder = save_tiny_model("llama", tmp_path / "m")  # no tokenizer: no stop strings here
    results = {}
    for burst in (1, 8):
        model = build_model(load_hf_config(folder), read_safetensors(folder), torch.bfloat16,
                            torch.device("cuda"))
        runtime = RuntimeConfig(cuda_graph_max_bucket_size=16, cuda_graph_num_buckets=5,
                                decode_burst_steps=burst)
        cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.2, host_kv_cache_size=0.2),
                           runtime=runtime).validate()
        eng = Engine(model, cfg, None, (2,))
        assert eng.runner.graphs is not None
        bursts = count_bursts(eng)
        results[burst] = outcome(eng.generate(mixed_requests(None, 2, count=14, vocab=VOCAB)))
        # Bursts ran (shorter than 8 once the 5-token requests finish: see
        # test_bursts_shrink_when_finished_sequences_are_short).
        assert not bursts if burst == 1 else max(bursts) > 1
    assert results[8] == results[1]


def test_burst_rows_that_end_at_the_model_context_stay_inside_it(chat):
    """A sequence whose budget ends at the model's last position stops inside a burst while
    another goes on: its idle steps must not index past the rope table (or the context)."""
    model, tokenizer = chat
    limit = model.config.max_position_embeddings
    gen = torch.Generator().manual_seed(3)
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_prompt = torch.randint(3, 500, (limit - 18,), generator=gen).tolist()
    requests = [Request("edge", long_prompt, SamplingParams(max_tokens=18, **greedy)),
                Request("other", [5, 6, 7], SamplingParams(max_tokens=60, **greedy))]
    single = outcome(engine(model, tokenizer, 1).generate(requests))
    assert outcome(engine(model, tokenizer, 32).generate(requests)) == single
