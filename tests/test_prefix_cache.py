"""Prefix cache and n > 1 forks in the scheduler, driven through the step contract by a fake
model whose KV at a position is a hash of every token up to it: any page mapped, copied, loaded
or written wrongly shows up as wrong KV. Random requests share prefixes and fork choices under
tight pools (so admission, forks, unloads, loads, evictions and ends interleave); after every
step the allocators' references match the sequences holding pages, and at the end, once the
cache is cleared, every page is free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE, SamplingParams
from batchgen.sched.pages import PageAllocator
from batchgen.sched.prefix_cache import PrefixCache, common_tokens, token_bytes
from batchgen.sched.scheduler import Scheduler
from batchgen.sched import sharing as sharing_module
from batchgen.sched.sharing import PrefixSharing, _common, common_pages, shared_pages
from batchgen.sched.sequence import SeqState, Sequence, pages_for
from batchgen.sched.step import SeqResult, StepOutput

EOS = 0
MOD = (1 << 61) - 1
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def roll(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token + 1) % MOD


@dataclass(frozen=True)
class Req:
    prefix: int
    """Which shared prefix the prompt starts with."""
    prefix_len: int
    own_len: int
    n: int
    max_tokens: int
    true_len: int


class FakeRun:
    def __init__(self, reqs: list[Req], device_pages: int, host_pages: int, cfg: SchedulerConfig,
                 prefixes: list[list[int]], prepare: bool = False):
        """`prepare`: call the scheduler's prepare() in every step, as the engine does while
        the device runs it."""
        self.sched = Scheduler(cfg, device_pages, host_pages, prefix_salt="test")
        self.prepare = prepare
        self.device_kv = np.full((device_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.host_kv = np.full((host_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.reqs = reqs
        self.seqs: list[Sequence] = []
        self.expected: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        for i, req in enumerate(reqs):
            prompt = prefixes[req.prefix][:req.prefix_len] + [
                1 + (i * 7919 + j * 104729) % 49_999 for j in range(req.own_len)]
            params = SamplingParams(max_tokens=req.max_tokens, n=req.n, temperature=0.0)
            for choice in range(req.n):
                seq = Sequence(len(self.seqs), f"r{i}", choice, list(prompt), len(prompt),
                               params, 0)
                self.seqs.append(seq)
                self.expected[seq.seq_id] = self._kv_of(prompt)
                self.sched.add(seq)

    @staticmethod
    def _kv_of(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for token in tokens:
            h = roll(h, token)
            out.append(h)
        return out

    def run(self) -> None:
        steps = 0
        while self.sched.has_work:
            self.execute(self.sched.schedule())
            steps += 1
            assert steps < 20_000, self.sched.counters

    def execute(self, plan) -> None:
        """Run one plan: its copies and chunks, then its results back to the scheduler."""
        for copy in plan.swap_out:
            self.host_kv[copy.dst] = self.device_kv[copy.src]
        for copy in plan.device_copies:
            self.device_kv[copy.dst] = self.device_kv[copy.src]
        for copy in plan.swap_in:
            self.device_kv[copy.dst] = self.host_kv[copy.src]
        results = []
        if self.prepare:
            self.sched.prepare()
        for chunk in plan.chunks:
            token = self.forward(chunk.seq, chunk.start, chunk.end)
            if chunk.sample:
                results.append(SeqResult(chunk, [token], None, self.ends(chunk.seq, token)))
        self.sched.update_from_output(plan, StepOutput(results))
        for res in results:
            if res.finished:
                assert res.chunk.seq.seq_id not in self.finished
                self.finished.add(res.chunk.seq.seq_id)
        self.sched.check_integrity()
        self.check_shares(plan)

    def forward(self, seq: Sequence, start: int, end: int) -> int:
        assert seq.state is SeqState.RUNNING and start == seq.num_computed < end
        pages = np.array(seq.device_pages, dtype=np.int64)
        positions = np.arange(start, end)
        expected = np.array(self.expected[seq.seq_id][:end], dtype=np.int64)
        self.device_kv[pages[positions // PAGE_SIZE], positions % PAGE_SIZE] = expected[start:]
        kv = self.device_kv[pages[:pages_for(end)]].ravel()[:end]
        bad = np.nonzero(kv != expected)[0]
        assert not len(bad), f"seq {seq.seq_id}: KV of position {bad[0]} is wrong"
        # The next token: a function of the KV and the choice (so siblings diverge).
        return 1 + int((kv[-1] + seq.choice * 7) % 49_999)

    def ends(self, seq: Sequence, token: int) -> bool:
        req = self.reqs[int(seq.request_id[1:])]
        decoded = seq.num_decoded + 1
        self.expected[seq.seq_id].append(roll(self.expected[seq.seq_id][-1], token))
        return decoded >= req.true_len or decoded >= req.max_tokens

    def check_shares(self, plan) -> None:
        by_id = {s.seq_id: s for s in self.sched.running}
        for share in plan.shares:
            members = [by_id[i] for i in share.seq_ids if i in by_id]
            for seq in members:
                assert seq.device_pages[:len(share.pages)] == share.pages


requests = st.builds(Req, st.integers(0, 2), st.integers(0, 300), st.integers(0, 100),
                     st.sampled_from([1, 1, 2, 3]), st.integers(1, 400), st.integers(1, 400))


@given(st.lists(requests, min_size=1, max_size=14), st.integers(0, 3), st.booleans(),
       st.sampled_from([16, 64, 333, 4096]), st.integers(1, 12), st.integers(1, 12),
       st.sampled_from([0.0, 70.0, 100.0]), st.booleans())
@PROPERTY
def test_random_sharing_keeps_kv_and_pages_right(reqs, room, roomy_host, prefill, batch,
                                                 extension, watermark, prepare):
    """host_kv_watermark picks which comes first in a decision: admitting (100) or loading
    swapped sequences (0; 70, the default, switches as the host tier fills); `prepare`: the
    waiting prompts' pages hashed ahead in every step."""
    reqs = [r for r in reqs if r.prefix_len + r.own_len > 0]
    if not reqs:
        return
    prefixes = [[1 + (p * 31 + j * 17) % 49_999 for j in range(300)] for p in range(3)]
    need = max(pages_for(r.prefix_len + r.own_len + r.max_tokens) for r in reqs)
    device = need + room
    host = need * (12 if roomy_host else 1) + room
    cfg = SchedulerConfig(initial_gpu_page_buffer=2, extension_gpu_page_buffer=extension,
                          decision_frequency_pages=1, host_kv_chunk_size=64,
                          host_kv_eviction_watermark=0.0, host_kv_watermark=watermark,
                          adaptive_chunk_min=64, max_prefill_tokens=prefill,
                          max_decode_batch=batch, max_pool_size=batch + 2)
    run = FakeRun(reqs, device, host, cfg, prefixes, prepare)
    run.run()
    assert run.finished == {s.seq_id for s in run.seqs}
    for seq in run.seqs:  # what plain sequential generation gives
        assert run.expected[seq.seq_id] == FakeRun._kv_of(seq.token_ids)
    run.sched.clear_prefix_cache()
    for pool in (run.sched.device, run.sched.host):
        assert pool.num_free == pool.num_pages and pool.cache.num_idle == 0
        pool.check([])


def test_shared_prompts_compute_the_prefix_once():
    """Eight requests with one 640-token prefix: the first computes it, the rest map it."""
    prefixes = [[5 + j for j in range(640)]]
    reqs = [Req(0, 640, 10, 1, 4, 4) for _ in range(8)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(), prefixes)
    run.run()
    counters = run.sched.counters
    assert counters.prompt_tokens == 8 * 650
    assert counters.cached_prompt_tokens == 7 * 640
    assert all(s.cached_tokens == (0 if s.seq_id == 0 else 640) for s in run.seqs)


def test_a_shared_prefix_is_backed_once_on_the_host():
    """The second sequence mapping a device-cached prefix makes its host pages the prefix's
    backing; every later one shares those host pages instead of reserving a private copy. With
    room on the device every holder ends there, so the backing is never written."""
    prefixes = [[5 + j for j in range(640)]]
    reqs = [Req(0, 640, 10, 1, 300, 300) for _ in range(8)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(), prefixes)
    seen = {"copies": 0, "max_refs": 0, "peak_host": 0}
    schedule = run.sched.schedule

    def watched(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        seen["copies"] += sum(len(c.src) for c in plan.swap_out)
        host = run.sched.host
        seen["max_refs"] = max(seen["max_refs"], max(host.refs))
        seen["peak_host"] = max(seen["peak_host"], host.num_used)
        return plan

    run.sched.schedule = watched
    run.run()
    assert seen["copies"] == 0  # nothing unloaded: the backing was never needed
    assert seen["max_refs"] == 7  # the first sequence keeps the host pages it computed into
    whole = pages_for(650 + 300)
    assert seen["peak_host"] <= whole + 10 + 7 * (whole - 10)  # private copies: 8 * whole
    assert len(run.sched.backing) == 0 and run.sched.prefix.host_cache.num_cached == 0


def test_a_shared_prefixs_host_backing_is_written_when_a_holder_is_unloaded():
    """With a device pool too small for every holder, unloading one writes the prefix's host
    backing (once: it is then written), and FakeRun checks the KV wherever it is read back."""
    prefixes = [[5 + j for j in range(640)]]
    reqs = [Req(0, 640, 10, 1, 300, 300) for _ in range(8)]
    run = FakeRun(reqs, 40, 800, SchedulerConfig(), prefixes)
    written = []
    due = run.sched.backing.due

    def counted(host_pages):
        device, host = due(host_pages)
        written.extend(host)
        return device, host

    run.sched.backing.due = counted
    run.run()
    assert run.sched.counters.unloads > 0 and run.sched.counters.loads > 0
    assert written and len(written) == len(set(written))
    assert len(run.sched.backing) == 0


def test_n_choices_fork_from_one_prefill():
    """n = 4 of a 100-token prompt: one prefill; three forks copy its partial page and
    compute only the last prompt token each."""
    run = FakeRun([Req(0, 0, 100, 4, 6, 6)], 100, 200, SchedulerConfig(), [[]])
    computed = []
    schedule = run.sched.schedule

    def recording():
        plan = schedule()
        computed.extend((c.seq.choice, c.end - c.start) for c in plan.chunks
                        if c.seq.num_decoded == 0)
        return plan

    run.sched.schedule = recording
    run.run()
    assert run.sched.counters.forks == 3
    assert sorted(computed) == [(0, 100), (1, 1), (2, 1), (3, 1)]
    assert [s.cached_tokens for s in run.seqs] == [0, 99, 99, 99]
    outputs = [s.token_ids[100:] for s in run.seqs]
    assert len({tuple(o) for o in outputs}) == 4  # the choices diverge, each from its own KV


def test_choices_that_do_not_fork_are_counted_as_extra_choices():
    """n = 2 of a 65-token prompt: the second choice maps the first's full page and computes
    only the last token, no fork (nothing partial to copy), yet its prompt is counted again in
    prompt_tokens: extra_choices says so (the status line's "each choice of n > 1 counted")."""
    run = FakeRun([Req(0, 0, 65, 2, 4, 4)], 100, 200, SchedulerConfig(), [[]])
    run.run()
    counters = run.sched.counters
    assert counters.forks == 0 and counters.prompt_tokens == 2 * 65
    assert counters.extra_choices == 1


def test_caching_off_shares_nothing():
    prefixes = [[5 + j for j in range(640)]]
    reqs = [Req(0, 640, 10, 2, 4, 4) for _ in range(3)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(enable_prefix_caching=False), prefixes)
    run.run()
    assert run.sched.counters.cached_prompt_tokens == 0 and run.sched.counters.forks == 0
    assert run.sched.device.num_free == run.sched.device.num_pages


def test_idle_cached_pages_are_reclaimed_least_recently_used_first():
    cache = PrefixCache("device")
    pool = PageAllocator(4, "device", cache)
    a, b = pool.allocate(1), pool.allocate(1)
    cache.register(b"a", a[0])
    cache.register(b"b", b[0])
    pool.free(b)
    pool.free(a)  # idle: b, then a
    assert pool.num_free == 4 and cache.lookup([b"a"]) == a
    pool.share(a)  # a is held again: only b may be reclaimed
    assert pool.allocate(3) == [2, 3, b[0]]
    assert cache.lookup([b"b"]) == [] and cache.lookup([b"a"]) == a
    pool.check([a, [2], [3], b])
    with pytest.raises(AssertionError, match="freed while not held"):
        pool.free([2, 2])


def test_a_choice_never_forks_from_a_sibling_loaded_in_the_same_plan():
    """Loading before admitting (host watermark 0): a sibling of an n = 2 request loaded in
    the decision that admits the other choice must not lend its partial last page, which the
    step fills only after its device copies (FakeRun checks every KV read)."""
    reqs = [Req(0, 0, 1, 1, 132, 132), Req(0, 0, 1, 1, 192, 132), Req(0, 0, 49, 1, 144, 129),
            Req(0, 141, 100, 1, 400, 1), Req(0, 0, 97, 2, 60, 60)]
    prefixes = [[1 + (p * 31 + j * 17) % 49_999 for j in range(300)] for p in range(3)]
    need = max(pages_for(r.prefix_len + r.own_len + r.max_tokens) for r in reqs)
    cfg = SchedulerConfig(initial_gpu_page_buffer=2, extension_gpu_page_buffer=1,
                          decision_frequency_pages=1, host_kv_chunk_size=64,
                          host_kv_eviction_watermark=0.0, host_kv_watermark=0.0,
                          adaptive_chunk_min=64, max_prefill_tokens=16, max_decode_batch=4,
                          max_pool_size=6)
    run = FakeRun(reqs, need + 1, need * 12 + 1, cfg, prefixes)
    run.run()
    assert run.sched.counters.loads and run.finished == {s.seq_id for s in run.seqs}


def test_integrity_check_catches_a_page_held_without_a_reference():
    pool = PageAllocator(3, "device", PrefixCache("device"))
    pages = pool.allocate(2)
    pool.check([pages])
    with pytest.raises(AssertionError, match="refs"):
        pool.check([pages, pages[:1]])  # a second holder that never took a reference


def test_tight_pools_evict_unload_and_load_shared_sequences():
    """Sequences sharing a prefix (and n = 2 forks) under pools that force an eviction,
    unloads and loads: their KV stays right (FakeRun checks every read) and every page
    comes back."""
    prefixes = [[5 + j for j in range(640)]]
    reqs = [Req(0, 200, 10 + i, 1 + i % 2, 300, 300) for i in range(6)]
    cfg = SchedulerConfig(initial_gpu_page_buffer=2, extension_gpu_page_buffer=1,
                          decision_frequency_pages=1, host_kv_chunk_size=64,
                          adaptive_chunk_min=64, host_kv_eviction_watermark=0.0,
                          host_kv_watermark=100.0)
    run = FakeRun(reqs, 11, 13, cfg, prefixes)
    run.run()
    counters = run.sched.counters
    assert counters.evictions and counters.unloads and counters.loads and counters.forks
    assert counters.shared_tails
    assert counters.cached_prompt_tokens > 0
    assert len(run.finished) == len(run.seqs)
    run.sched.clear_prefix_cache()
    assert run.sched.device.num_free == 11 and run.sched.host.num_free == 13


def test_sequences_sharing_a_prefix_are_admitted_together_oldest_first():
    """Interleaved prefixes A B A B A B: the first of each computes its prefix while the
    others wait for it; then the oldest waiting one comes first, followed by the rest of its
    group, longest shared prefix first."""
    prefixes = [[5 + j for j in range(200)], [900 + j for j in range(200)]]
    reqs = [Req(i % 2, 140 if i < 4 else 200, 20, 1, 4, 4) for i in range(6)]
    run = FakeRun(reqs, 200, 400, SchedulerConfig(), prefixes)
    first = run.sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [0, 1]  # 2..5 wait for those prefixes
    run.sched.update_from_output(first, StepOutput(
        [SeqResult(c, [7], None, False) for c in first.chunks]))
    second = run.sched.schedule()
    # The oldest waiting (2, prefix A), the rest of its group (4), then group B (3, 5): each
    # maps the two cached prefix pages and copies the start of the first one's third page
    # (the 12 more tokens of the 140 they share).
    order = [c.seq.seq_id for c in second.chunks if c.seq.num_decoded == 0]
    assert order == [2, 4, 3, 5]
    assert all(c.start == 140 for c in second.chunks if c.seq.num_decoded == 0)
    assert len(second.device_copies) == 4 and run.sched.counters.shared_tails == 4


def test_a_group_of_new_requests_is_ordered_longest_shared_prefix_first():
    """Requests filed together by their first page come after the oldest one in the order of
    how many of its pages they share, from the first scan on (not only once deferred)."""
    sched = Scheduler(SchedulerConfig(), 400, 800, prefix_salt="t")
    base = list(range(1, 5 * PAGE_SIZE + 1))
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def sharing(i: int, pages: int) -> Sequence:
        own = [10_000 + 1_000 * i + j for j in range((5 - pages) * PAGE_SIZE)]
        tokens = base[:pages * PAGE_SIZE] + own + [7]
        return Sequence(i, f"r{i}", 0, tokens, len(tokens), params, 0)

    for seq in [Sequence(0, "r0", 0, base + [7], len(base) + 1, params, 0),
                sharing(1, 1), sharing(2, 2), sharing(3, 4)]:
        sched.add(seq)
    assert [s.seq_id for s in sched.prefix.order(sched.waiting, 100)] == [0, 3, 2, 1]


def test_a_group_waiting_for_its_first_page_is_not_sorted(monkeypatch):
    """While a running sequence computes the group's first page, each member waits for it
    whatever its order: the admission that starts that sequence compares no member's tokens
    (a W3 job's first decision spent most of its time sorting 1,020 prompts it then passed
    over), and the members start once the page is computed."""
    prefix = [[3 + j for j in range(3 * PAGE_SIZE)]]
    reqs = [Req(0, 3 * PAGE_SIZE, PAGE_SIZE + i, 1, 4, 4) for i in range(5)]
    run = FakeRun(reqs, 200, 400, SchedulerConfig(), prefix)
    compared = []
    real = sharing_module.shared_pages
    monkeypatch.setattr(sharing_module, "shared_pages",
                        lambda a, b: compared.append(b.seq_id) or real(a, b))
    first = run.sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [0] and not compared
    run.execute(first)
    run.run()
    assert compared  # sorted once the first page is cached
    assert run.finished == {s.seq_id for s in run.seqs}
    assert run.sched.counters.cached_prompt_tokens == 4 * 3 * PAGE_SIZE


@given(st.lists(st.integers(1, 3), min_size=0, max_size=5 * PAGE_SIZE),
       st.lists(st.integers(1, 3), min_size=0, max_size=3 * PAGE_SIZE),
       st.lists(st.integers(1, 3), min_size=0, max_size=3 * PAGE_SIZE))
@PROPERTY
def test_common_pages_counts_the_leading_pages_whose_keys_are_equal(shared, a, b):
    """The admission order compares tokens instead of hashing every waiting prompt (or the
    keys, once prepare() hashed both): the same count as the page keys give."""
    sharing = PrefixSharing("t")
    first = Sequence(0, "a", 0, shared + a, len(shared + a), SamplingParams(), 0)
    second = Sequence(1, "b", 0, shared + b, len(shared + b), SamplingParams(), 0)
    assert shared_pages(first, second) == common_pages(first.token_ids, second.token_ids)
    expected = _common(sharing.keys(first), sharing.keys(second))
    assert common_pages(first.token_ids, second.token_ids) == expected
    assert shared_pages(first, second) == expected  # from the keys, now hashed


def test_a_group_left_waiting_for_its_prefix_is_not_hashed_until_prepared():
    """A decision that admits the first of a group (the rest wait for the prefix it computes)
    hashes only the first page of the others; prepare() hashes the pages their admission
    looks up, within its page budget, and the run ends as without it."""
    prefix = [[3 + j for j in range(3 * PAGE_SIZE)]]
    reqs = [Req(0, 3 * PAGE_SIZE, 2 * PAGE_SIZE + 5, 1, 4, 4) for _ in range(6)]
    run = FakeRun(reqs, 200, 400, SchedulerConfig(), prefix)
    first = run.sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [0]
    waiting = list(run.sched.waiting)
    assert [len(s.page_keys) for s in waiting] == [1] * 5
    run.sched.prefix.prepare(run.sched.waiting, 2 * 5, 100)  # stops once past 10 pages
    assert [len(s.page_keys) for s in waiting] == [5, 5, 5, 1, 1]
    run.sched.prepare()
    assert [len(s.page_keys) for s in waiting] == [5] * 5
    run.execute(first)
    run.run()
    assert run.finished == {s.seq_id for s in run.seqs}
    assert run.sched.counters.cached_prompt_tokens == 5 * 3 * PAGE_SIZE


def test_prepare_hashes_the_waiting_prompts_in_admission_order():
    """Prefixes A B A B A B wait: admission takes the As together, so prepare() hashes them
    first (in queue order it would hash an A, a B, an A, ... and leave the third A's hashing
    to the decision that admits it)."""
    prefixes = [[3 + j for j in range(2 * PAGE_SIZE)], [500 + j for j in range(2 * PAGE_SIZE)]]
    reqs = [Req(i % 2, 2 * PAGE_SIZE, PAGE_SIZE + 5, 1, 4, 4) for i in range(6)]
    run = FakeRun(reqs, 200, 400, SchedulerConfig(), prefixes)
    sched = run.sched  # 3 usable pages a prompt, the first hashed when it was added
    sched.prefix.prepare(sched.waiting, 3 * 2, 100)
    assert [len(s.page_keys) for s in sched.waiting] == [3, 1, 3, 1, 3, 1]


@pytest.mark.parametrize("device_pages", [6, 7])
def test_a_sharer_of_a_cached_prefix_passes_an_older_request_that_does_not_fit(device_pages):
    """Prefixes B A B A B in a device pool that holds about one sequence: the oldest waiting
    request (an A) does not fit while a B runs, but the next B maps the B prefix cached on the
    device and fits; it is admitted past the A, so every B after the first and the second A
    reuse their prefix (oldest-first alone recomputed it: none or one reused). The passed
    request is passed a bounded number of times, and everything ends."""
    prefixes = [[5 + j for j in range(256)], [900 + j for j in range(256)]]
    reqs = [Req(p, 192, 10, 1, 40, 40) for p in (1, 0, 1, 0, 1)]
    cfg = SchedulerConfig(initial_gpu_page_buffer=1, extension_gpu_page_buffer=1,
                          decision_frequency_pages=1, host_kv_chunk_size=64,
                          adaptive_chunk_min=64, max_decode_batch=4)
    run = FakeRun(reqs, device_pages, 64, cfg, prefixes)
    run.run()
    assert [s.cached_tokens for s in run.seqs] == [0, 0, 192, 192, 192]
    assert len(run.finished) == len(run.seqs)
    assert all(s.bypassed <= cfg.max_decode_batch for s in run.seqs)
    run.sched.clear_prefix_cache()
    assert run.sched.device.num_free == device_pages
    # Once passed max_decode_batch times a request is passed no more: oldest first again.
    worn = FakeRun(reqs, device_pages, 64, cfg, prefixes)
    for seq in worn.seqs:
        seq.bypassed = cfg.max_decode_batch
    worn.run()
    assert sum(s.cached_tokens for s in worn.seqs) < 3 * 192


def test_longest_tail_finds_the_cached_page_sharing_most_tokens():
    """The tail index: pages after the same parent that begin with the same token, the one
    sharing the most tokens wins; a page leaves the index when it leaves the cache."""
    cache = PrefixCache("device", tails=True)
    page = [7, 8, 9, 10] + [1] * 60
    cache.register(b"k1", 3, b"parent", token_bytes(page))
    cache.register(b"k2", 4, b"parent", token_bytes([7, 8, 5] + [1] * 61))
    cache.register(b"k3", 5, b"other", token_bytes(page))
    assert cache.longest_tail(b"parent", token_bytes([7, 8, 9, 2])) == (3, 3)
    assert cache.longest_tail(b"parent", token_bytes([7, 8, 5, 1, 1])) == (4, 5)
    assert cache.longest_tail(b"parent", token_bytes([6, 8, 9])) == (None, 0)
    assert cache.longest_tail(b"nobody", token_bytes([7])) == (None, 0)
    assert common_tokens(token_bytes(page), token_bytes(page[:10] + [0])) == 10
    cache.forget(3)
    assert cache.longest_tail(b"parent", token_bytes([7, 8, 9, 2])) == (4, 2)
    cache.release(4)
    cache.release(5)
    assert cache.reclaim() == 4 and cache.reclaim() == 5
    assert cache.longest_tail(b"parent", token_bytes([7, 8])) == (None, 0)
    assert cache.problems([0] * 8) == []
    plain = PrefixCache("host")
    plain.register(b"k1", 3, b"parent", token_bytes(page))
    assert plain.longest_tail(b"parent", token_bytes(page)) == (None, 0)


@pytest.mark.parametrize("batch", [1, 8], ids=["cached-page", "running-page"])
def test_a_prefix_ending_mid_page_is_copied_not_computed(batch):
    """Six requests whose 150-token prefix ends 22 tokens into its third page: each after the
    first maps two pages and copies the start of the third, from the first's page while it
    runs (batch 8) or from the cache once it ended and its page filled (batch 1); FakeRun
    checks the KV each reads."""
    prefixes = [[5 + j for j in range(150)]]
    reqs = [Req(0, 150, 10, 1, 60, 60) for _ in range(6)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(max_decode_batch=batch), prefixes)
    run.run()
    counters = run.sched.counters
    assert counters.shared_tails == 5
    assert [s.cached_tokens for s in run.seqs] == [0] + [150] * 5
    assert counters.cached_prompt_tokens == 5 * 150


def test_a_pool_with_room_for_one_sequence_still_admits_a_repeated_prompt():
    """The second choice of a two-token prompt copies the start of the first's page, idle in
    the cache, in a device pool with room for one sequence: it takes that page's room for
    its own pages (the copy runs before anything writes them) instead of waiting forever."""
    cfg = SchedulerConfig(initial_gpu_page_buffer=2, extension_gpu_page_buffer=1,
                          decision_frequency_pages=1, host_kv_chunk_size=64,
                          host_kv_eviction_watermark=0.0, adaptive_chunk_min=64,
                          max_prefill_tokens=16, max_decode_batch=1, max_pool_size=3)
    need = pages_for(2 + 96)
    run = FakeRun([Req(0, 0, 2, 2, 96, 63)], need, need, cfg, [[]])
    run.run()
    assert run.finished == {0, 1}


def test_a_decoding_sequence_offers_each_page_it_opens():
    """A running sequence's open page is filed again each time its last computed token moves
    to a new page, decode step by decode step (not only where its prompt ended)."""
    from batchgen.sched.sharing import PrefixSharing

    sharing = PrefixSharing("test")
    tokens = [3 + i for i in range(200)]
    seq = Sequence(0, "r0", 0, list(tokens), 60, SamplingParams(max_tokens=140), 0)
    seq.state, seq.device_pages = SeqState.RUNNING, [10, 11, 12, 13]
    for computed in range(60, 140):
        seq.num_computed = computed
        sharing.computed(seq)
        page = (computed - 1) // PAGE_SIZE
        start = page * PAGE_SIZE
        parent = sharing.keys(seq, page)[-1] if page else sharing.root
        found = sharing.open_pages.longest(parent, page, token_bytes(tokens[start:start + 64]))
        assert found == (seq.device_pages[page], computed - start), computed
    sharing.released(seq, host=True)
    assert sharing.open_pages.longest(parent, 2, token_bytes(tokens[128:140])) == (None, 0)
