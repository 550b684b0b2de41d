"""Property tests of the Scheduler alone: random workloads, pool sizes and flags, no model.

A fake engine drives the scheduler with the engine's update rule and a fake model that keeps a
KV value per token slot in numpy "pools". Page copies (swap_out, swap_in) move those values as the
runner would, every chunk checks that the KV it attends to is exactly the encoding of the
sequence's tokens, and the next token is a hash of the KV read. So a lost, misplaced or stale page
changes the output, and "output must not change" is tested by comparing every token stream with
a reference generated without any scheduling (what a roomy-pools run must produce).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, target
from hypothesis import strategies as st

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE, SamplingParams
from batchgen.sched.scheduler import RequestTooLarge, ScheduleOutput, Scheduler, SeqChunk
from batchgen.sched.sequence import SeqState, Sequence, pages_for

VOCAB = 50_000
EOS = 0
MAX_POSITION = 4096
_WEIGHTS = np.random.default_rng(0).integers(1, 2**20, size=MAX_POSITION, dtype=np.int64)
PROPERTY = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Req:
    prompt_len: int
    max_tokens: int
    true_len: int
    """The fake model emits EOS as this generated token (<= max_tokens)."""
    wave: int = 0


@dataclass(frozen=True)
class Scenario:
    reqs: tuple[Req, ...]
    device_pages: int
    host_pages: int
    cfg: SchedulerConfig
    wave_gap: int = 1
    """Wave w arrives at step w * wave_gap (or as soon as the scheduler runs dry)."""


def prompt_tokens(index: int, length: int) -> list[int]:
    return [1 + (index * 7919 + j * 104729) % (VOCAB - 1) for j in range(length)]


def encode(tokens: np.ndarray, start: int) -> np.ndarray:
    """The fake KV of tokens at positions start..: unique per (token, position)."""
    return tokens * MAX_POSITION + np.arange(start, start + len(tokens), dtype=np.int64)


def next_token(kv: np.ndarray, decoded: int, req: Req) -> int:
    """Deterministic fake model: EOS at the request's true length, else a hash of the KV."""
    if decoded + 1 >= req.true_len:
        return EOS
    return 1 + int(np.dot(kv, _WEIGHTS[:len(kv)]) % (VOCAB - 1))


def reference_stream(index: int, req: Req) -> list[int]:
    """What any correct schedule produces: plain sequential generation, no pages at all."""
    kv = np.zeros(req.prompt_len + req.max_tokens, dtype=np.int64)
    kv[:req.prompt_len] = encode(np.array(prompt_tokens(index, req.prompt_len)), 0)
    out: list[int] = []
    while True:
        end = req.prompt_len + len(out)
        token = next_token(kv[:end], len(out), req)
        out.append(token)
        if token == EOS or len(out) >= req.max_tokens:
            return out
        kv[end] = token * MAX_POSITION + end


class FakeEngine:
    """Drives one Scheduler like batchgen.engine.Engine, checking invariants after each step.
    `continued`: like the engine's decode bursts (of one step here), each decode step queues
    the next one, if the scheduler grants it, before its own tokens are appended."""

    def __init__(self, sc: Scenario, continued: bool = False):
        self.sc = sc
        self.continued = continued
        self.queued: ScheduleOutput | None = None
        self.continuations = 0
        self.sched = Scheduler(sc.cfg, sc.device_pages, sc.host_pages)
        self.device_kv = np.full((sc.device_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.host_kv = np.full((sc.host_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.seqs: list[Sequence] = []
        self.expected: dict[int, np.ndarray] = {}
        """Per sequence: the KV its tokens must have, filled as tokens are appended."""
        self.finished: list[int] = []
        self.digest = hashlib.sha256()
        self.steps = 0
        self.most_packed = 0
        """Most prompts prefilled together in one step (prepacking)."""
        self.most_running = 0
        """Most sequences computed together in one step."""

    def add_wave(self, wave: int) -> None:
        for i, req in enumerate(self.sc.reqs):
            if req.wave == wave:
                seq = Sequence(i, f"r{i}", 0, prompt_tokens(i, req.prompt_len), req.prompt_len,
                               SamplingParams(max_tokens=req.max_tokens, temperature=0.0), 0)
                self.sched.add(seq)
                self.seqs.append(seq)
                self.expected[i] = np.zeros(seq.budget_tokens, dtype=np.int64)
                self.expected[i][:req.prompt_len] = encode(np.array(seq.token_ids), 0)

    def run(self) -> None:
        waves = max(r.wave for r in self.sc.reqs) + 1
        next_wave, idle = 0, 0
        limit = 1000 + 50 * sum(r.prompt_len + r.true_len for r in self.sc.reqs)
        while next_wave < waves or self.sched.has_work:
            while next_wave < waves and (self.steps >= next_wave * self.sc.wave_gap
                                         or not self.sched.has_work):
                self.add_wave(next_wave)
                next_wave += 1
            out, self.queued = self.queued or self.sched.schedule(), None
            self.steps += 1
            self.record(out)
            computed = self.execute(out)
            self.check()
            idle = 0 if computed or out.swap_in or out.swap_out else idle + 1
            assert idle <= 2, f"no progress for {idle} steps: {self.sched.counters}"
            assert self.steps <= limit, f"no end after {self.steps} steps: {self.sched.counters}"

    def record(self, out: ScheduleOutput) -> None:
        parts = [(c.seq.seq_id, c.start, c.end, c.sample) for c in out.chunks]
        parts += [("out", p.seq_id, tuple(p.src), tuple(p.dst)) for p in out.swap_out]
        parts += [("in", p.seq_id, tuple(p.src), tuple(p.dst)) for p in out.swap_in]
        self.digest.update(repr((parts, out.decided)).encode())

    def execute(self, out: ScheduleOutput) -> int:
        """Copies, then the forward of every chunk, then the engine's postprocess rule."""
        for copy in out.swap_out:
            self.host_kv[copy.dst] = self.device_kv[copy.src]
        for copy in out.swap_in:
            self.device_kv[copy.dst] = self.host_kv[copy.src]
        assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks), "a sequence twice"
        prefill = sum(c.end - c.start for c in out.chunks
                      if not (c.sample and c.end - c.start == 1))
        assert prefill <= self.sc.cfg.max_prefill_tokens
        packed = sum(c.end - c.start > 1 for c in out.chunks)
        self.most_packed = max(self.most_packed, packed)
        self.most_running = max(self.most_running, len(out.chunks))
        # A queued step's rows that finished meanwhile compute tokens the engine drops.
        chunks = [c for c in out.chunks if c.seq.state is not SeqState.FINISHED]
        sampled = [self.forward(c.seq, c.start, c.end, c.sample) for c in chunks]
        if self.continued and out.decode_only:
            self.queued = self.continuation(chunks)
        for chunk, token in zip(chunks, sampled):
            chunk.seq.num_computed = chunk.end
            if token is not None:
                self.postprocess(chunk.seq, token)
        return sum(c.end - c.start for c in chunks)

    def continuation(self, chunks: list[SeqChunk]) -> ScheduleOutput | None:
        """The next decode step of these rows, queued while their tokens are not appended."""
        if not chunks or not self.sched.continue_decode(1):
            return None
        self.continuations += 1
        return ScheduleOutput([SeqChunk(c.seq, c.start + 1, c.end + 1, True) for c in chunks])

    def forward(self, seq: Sequence, start: int, end: int, sample: bool) -> int | None:
        assert seq.state is SeqState.RUNNING and start == seq.num_computed < end <= seq.num_tokens
        assert len(seq.device_pages) >= pages_for(end), f"seq {seq.seq_id} writes past its pages"
        pages = np.array(seq.device_pages, dtype=np.int64)
        positions = np.arange(start, end)
        expected = self.expected[seq.seq_id][:end]
        self.device_kv[pages[positions // PAGE_SIZE], positions % PAGE_SIZE] = expected[start:]
        kv = self.device_kv[pages[:pages_for(end)]].ravel()[:end]
        if not np.array_equal(kv, expected):
            bad = int(np.argmax(kv != expected))
            raise AssertionError(f"seq {seq.seq_id}: KV of position {bad} is wrong "
                                 f"(computed {start}..{end}, evictions {seq.evictions})")
        return next_token(kv, seq.num_decoded, self.sc.reqs[seq.seq_id]) if sample else None

    def postprocess(self, seq: Sequence, token: int) -> None:
        if seq.num_tokens < seq.budget_tokens:
            self.expected[seq.seq_id][seq.num_tokens] = token * MAX_POSITION + seq.num_tokens
        seq.token_ids.append(token)
        if token == EOS or seq.num_decoded >= seq.sampling.max_tokens:
            assert seq.seq_id not in self.finished, f"seq {seq.seq_id} finished twice"
            self.finished.append(seq.seq_id)
            self.sched.finish(seq)
            assert not seq.host_pages and not seq.device_pages

    def check(self) -> None:
        s = self.sched
        s.check_integrity()
        live = s.running + s.swapped
        assert sum(len(q.device_pages) for q in s.running) + s.device.num_free == s.device.num_pages
        assert sum(len(q.host_pages) for q in live) + s.host.num_free == s.host.num_pages
        assert len(s.running) <= s.cfg.max_decode_batch
        assert len(live) <= s.cfg.max_pool_size
        queued = s.running + s.swapped + list(s.waiting)
        assert len(set(map(id, queued))) == len(queued) == len(self.seqs) - len(self.finished)


def run_scenario(sc: Scenario, continued: bool = False) -> FakeEngine:
    engine = FakeEngine(sc, continued)
    engine.run()
    assert sorted(engine.finished) == list(range(len(sc.reqs)))
    assert engine.sched.counters.finished == len(sc.reqs)
    by_id = {q.seq_id: q for q in engine.seqs}
    for i, req in enumerate(sc.reqs):
        assert by_id[i].token_ids[req.prompt_len:] == reference_stream(i, req), f"seq {i} changed"
    return engine


# -- strategies ---------------------------------------------------------------------------------
requests = st.builds(
    lambda p, m, frac, wave: Req(p, m, max(1, round(m * frac)), wave),
    st.integers(1, 600), st.integers(1, 400), st.floats(0.0, 1.0), st.integers(0, 2))


@st.composite
def configs(draw, tight: bool) -> SchedulerConfig:
    """Any valid flags; `tight` favours the small chunks and buffers that force pool pressure."""
    extension = draw(st.integers(1, 8))
    chunk_min = draw(st.integers(1, 512))
    cfg = SchedulerConfig(
        initial_gpu_page_buffer=draw(st.integers(1, 4 if tight else 40)),
        adaptive_gpu_page_buffer=draw(st.booleans()),
        extension_gpu_page_buffer=extension,
        decision_frequency_pages=draw(st.integers(1, extension)),
        host_kv_watermark=draw(st.floats(0, 100)),
        host_kv_chunk_size=draw(st.integers(1, 256 if tight else 2048)),
        host_kv_eviction_watermark=draw(st.floats(0, 10 if tight else 100)),
        adaptive_chunk=draw(st.booleans()),
        adaptive_chunk_min=chunk_min,
        adaptive_chunk_max=chunk_min + draw(st.integers(0, 2048)),
        adaptive_chunk_ema_alpha=draw(st.floats(0.01, 1.0)),
        adaptive_chunk_multiplier=draw(st.floats(0.25, 3.0)),
        max_prefill_tokens=draw(st.sampled_from([1, 16, 64, 100, 333, 1024, 4096])),
        max_decode_batch=draw(st.integers(1, 64)),
        max_pool_size=draw(st.integers(1, 64)),
    )
    cfg.validate()
    return cfg


@st.composite
def scenarios(draw, max_requests: int = 40) -> Scenario:
    """Pools from "exactly the largest request" up to roomy; `shape` picks which tier is tight."""
    count = draw(st.integers(1, max_requests))
    reqs = tuple(draw(st.lists(requests, min_size=count, max_size=count)))
    need = max(pages_for(r.prompt_len + r.max_tokens) for r in reqs)
    shape = draw(st.sampled_from(["tight host", "tight device", "both tight", "roomy"]))
    small = need + draw(st.integers(0, need // 2))
    device = small if shape in ("tight device", "both tight") else need * draw(st.integers(1, 8))
    host = small if shape in ("tight host", "both tight") else need * draw(st.integers(1, 12))
    cfg = draw(configs(tight=shape != "roomy"))
    # One-token prefill steps over many long prompts take too long to run per example.
    assume(sum(r.prompt_len for r in reqs) <= 2000 * cfg.max_prefill_tokens)
    return Scenario(reqs, device, host, cfg, draw(st.integers(1, 60)))


# -- properties ---------------------------------------------------------------------------------
@PROPERTY
@given(scenarios())
def test_random_workloads_finish_with_unchanged_output(sc: Scenario):
    engine = run_scenario(sc)
    c = engine.sched.counters
    target(float(c.evictions), label="evictions")
    target(float(c.unloads), label="unloads")
    target(float(c.chunk_growths), label="chunk growths")


@settings(PROPERTY, max_examples=60)
@given(scenarios())
def test_decode_queued_before_the_last_tokens_are_read_keeps_the_output(sc: Scenario):
    """The engine queues a burst's continuation before it reads the burst's last step: the
    grants of Scheduler.continue_decode keep every invariant and every token stream."""
    engine = run_scenario(sc, continued=True)
    target(float(engine.sched.counters.unloads), label="unloads")
    target(float(engine.continuations), label="continuations")


@settings(PROPERTY, max_examples=30)
@given(scenarios(max_requests=12))
def test_same_workload_same_decisions(sc: Scenario):
    assert run_scenario(sc).digest.digest() == run_scenario(sc).digest.digest()


@settings(PROPERTY, max_examples=100)
@given(st.integers(1, 2000), st.integers(1, 2000), st.integers(1, 60), st.integers(1, 60))
def test_request_too_large_for_a_pool_is_refused(prompt, max_tokens, device, host):
    sched = Scheduler(SchedulerConfig(), device, host)
    seq = Sequence(0, "r0", 0, [1] * prompt, prompt, SamplingParams(max_tokens=max_tokens), 0)
    need = pages_for(prompt + max_tokens)
    if need > min(device, host):
        with pytest.raises(RequestTooLarge, match="KV pages"):
            sched.add(seq)
        assert not sched.has_work
    else:
        sched.add(seq)
        assert sched.has_work


# -- each mechanism is exercised (and output still matches the reference) ------------------------
LONG = tuple(Req(300 + 13 * i, 400, 400 - 7 * i) for i in range(12))
LONG_NEED = pages_for(300 + 13 * 11 + 400)
SMALL_STEPS = {"initial_gpu_page_buffer": 1, "extension_gpu_page_buffer": 2,
               "decision_frequency_pages": 1, "host_kv_chunk_size": 64, "adaptive_chunk": False}


def run_with(reqs, device_pages: int, host_pages: int, continued: bool = False,
             **flags) -> FakeEngine:
    return run_scenario(Scenario(tuple(reqs), device_pages, host_pages, SchedulerConfig(**flags)),
                        continued)


def test_tiny_host_pool_evicts_and_reprefills():
    c = run_with(LONG, 6 * LONG_NEED, LONG_NEED + 3, host_kv_eviction_watermark=5,
                 **SMALL_STEPS).sched.counters
    assert c.evictions > 0 and c.reprefill_tokens > 0 and c.chunk_growths > 0
    assert c.admitted == c.finished + c.evictions


def test_tiny_device_pool_unloads_and_reloads():
    c = run_with(LONG, LONG_NEED, 10 * LONG_NEED, **SMALL_STEPS).sched.counters
    assert c.unloads > 0 and c.loads == c.unloads and c.evictions == 0


def test_both_pools_tiny_exercise_everything():
    engine = run_with(LONG + tuple(Req(20, 64, 30) for _ in range(8)), LONG_NEED + 2,
                      LONG_NEED + 2, host_kv_eviction_watermark=5, **SMALL_STEPS)
    c = engine.sched.counters
    assert c.unloads > 0 and c.evictions > 0 and c.chunk_growths > 0
    assert engine.most_packed >= 2


def test_adaptive_buffer_shrinks_only_while_other_sequences_wait():
    """24 sequences of 100 + 100..682 tokens on a 60-page device pool, 16-page initial buffer:
    while others wait, a sequence admitted or (re)loaded reserves one extension instead, so
    more sequences run at once and the job takes fewer steps. One sequence at a time (nothing
    else waiting) keeps the full buffer: the very same decisions as without the adaptive
    buffer. Outputs are the reference's either way (run_scenario checks)."""
    reqs = [Req(100, 800, 100 + 97 * (i % 7)) for i in range(24)]
    flags = {"initial_gpu_page_buffer": 16, "extension_gpu_page_buffer": 2,
             "decision_frequency_pages": 1}
    tight = {a: run_with(reqs, 60, 2000, adaptive_gpu_page_buffer=a, **flags)
             for a in (True, False)}
    assert all(e.sched.counters.loads > 0 for e in tight.values())  # some did wait on the host
    assert tight[True].most_running > 2 * tight[False].most_running
    assert tight[True].steps < 0.7 * tight[False].steps
    # Others waiting to be admitted count too, whether or not the pool is short.
    roomy = {a: run_with(reqs, 24 * 30, 2000, adaptive_gpu_page_buffer=a, **flags).sched
             for a in (True, False)}
    assert roomy[False].counters.device_extensions == 0 < roomy[True].counters.device_extensions
    longest = reqs[6:7]  # 100 + 682 tokens: 13 pages, within 2 prompt pages + 16 of buffer
    alone = {a: run_with(longest, 60, 2000, adaptive_gpu_page_buffer=a, **flags)
             for a in (True, False)}
    assert alone[True].digest.digest() == alone[False].digest.digest()
    assert alone[True].sched.counters.device_extensions == 0  # a 2-page buffer would extend


def test_prompts_are_prepacked_into_one_prefill():
    engine = run_with([Req(100, 8, 8) for _ in range(10)], 200, 200, max_prefill_tokens=1000)
    assert engine.most_packed == 10


def test_adaptive_chunk_follows_finished_decode_lengths():
    reqs = [Req(50, 300, 10 + 20 * i) for i in range(20)]
    sched = run_with(reqs, 200, 200, host_kv_chunk_size=64, adaptive_chunk_min=64,
                     adaptive_chunk_ema_alpha=0.5).sched
    chunks = [chunk for _, chunk in sched.chunk.history]
    assert len(chunks) >= 5 and chunks == sorted(chunks)  # decode lengths rise, so does the chunk


def test_static_chunk_never_changes():
    reqs = [Req(50, 300, 10 + 20 * i) for i in range(20)]
    sched = run_with(reqs, 200, 200, host_kv_chunk_size=64, adaptive_chunk=False).sched
    assert sched.chunk.history == [] and sched.chunk.chunk_tokens == 64


def test_waves_arrive_while_others_decode():
    reqs = [Req(40 + i, 200, 150, wave=i % 3) for i in range(15)]
    engine = run_scenario(Scenario(tuple(reqs), 60, 60, SchedulerConfig(), wave_gap=40))
    assert engine.sched.counters.decisions > 3


def test_tight_and_roomy_pools_give_the_same_tokens():
    tight = run_with(LONG, LONG_NEED + 1, LONG_NEED + 1, host_kv_eviction_watermark=5,
                     **SMALL_STEPS)
    roomy = run_with(LONG, 100 * LONG_NEED, 100 * LONG_NEED)
    assert tight.sched.counters.unloads + tight.sched.counters.evictions > 0
    assert [s.token_ids for s in tight.seqs] == [s.token_ids for s in roomy.seqs]


def test_corrupted_swap_is_detected():
    """The fake model notices a page copy gone wrong (guards the checker itself)."""
    engine = FakeEngine(Scenario(LONG, LONG_NEED, 10 * LONG_NEED, SchedulerConfig(**SMALL_STEPS)))
    real_execute = engine.execute

    def lossy_execute(out: ScheduleOutput) -> int:
        for copy in out.swap_in:
            copy.src = copy.src[1:] + copy.src[:1]  # rotate: pages land in the wrong slots
        return real_execute(out)

    engine.execute = lossy_execute
    with pytest.raises(AssertionError, match="KV of position"):
        engine.run()


def test_continued_decode_under_pool_pressure():
    engine = run_with(LONG, 2 * LONG_NEED, 3 * LONG_NEED, continued=True, **SMALL_STEPS)
    c = engine.sched.counters
    assert engine.continuations > 100 and c.unloads > 0 and c.decisions > 10
