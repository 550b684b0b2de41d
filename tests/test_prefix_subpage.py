"""Prefixes that end inside a page, admitted together: the first request computes the page and
the others wait one decision and copy its start (FakeRun checks the KV each one reads), unless
what they would copy is too little to be worth the wait."""

from __future__ import annotations

import pytest

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE, SamplingParams
from batchgen.sched.sequence import SeqState, Sequence
from batchgen.sched.sharing import WAIT_MIN_TOKENS, PrefixSharing
from batchgen.sched.prefix_cache import token_bytes
from test_prefix_cache import FakeRun, Req

PREFIX = [[5 + j for j in range(PAGE_SIZE * 3)]]


@pytest.mark.parametrize("prompt_len", [2 + WAIT_MIN_TOKENS, 40, PAGE_SIZE - 1, PAGE_SIZE])
def test_repeated_prompts_shorter_than_a_page_are_computed_once(prompt_len):
    """Eight identical prompts of at most a page, in one admission's reach: seven copy the
    first one's page (all but their last token, which is computed for its logits)."""
    reqs = [Req(0, prompt_len, 0, 1, 8, 8) for _ in range(8)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(max_decode_batch=8), PREFIX)
    run.run()
    assert [s.cached_tokens for s in run.seqs] == [0] + [prompt_len - 1] * 7
    assert run.sched.counters.shared_tails == 7


def test_a_shared_prefix_ending_in_the_first_page_is_copied():
    """A 60-token prefix + 40 tokens of each request's own: the prefix is computed once."""
    reqs = [Req(0, 60, 40, 1, 8, 8) for _ in range(8)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(max_decode_batch=8), PREFIX)
    run.run()
    assert [s.cached_tokens for s in run.seqs] == [0] + [60] * 7


def test_a_shared_prefix_ending_after_full_pages_is_copied_too():
    """130 tokens of prefix (two full pages and two tokens) + 30 own, every request admitted
    at once: the full pages are waited for as before and the next page's start is copied."""
    reqs = [Req(0, 130, 30, 1, 8, 8) for _ in range(6)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(max_decode_batch=8), PREFIX)
    run.run()
    assert [s.cached_tokens for s in run.seqs] == [0] + [130] * 5


@pytest.mark.parametrize("shared, own", [(WAIT_MIN_TOKENS - 1, 10), (20, 200)])
def test_no_wait_for_too_little(shared, own):
    """Fewer than WAIT_MIN_TOKENS shared tokens, or less than a quarter of what a request
    computes: every request is admitted in the first decision and computes its whole prompt."""
    reqs = [Req(0, shared, own, 1, 4, 4) for _ in range(6)]
    run = FakeRun(reqs, 400, 800, SchedulerConfig(max_decode_batch=8), PREFIX)
    run.sched.schedule()
    assert len(run.sched.running) == 6
    assert all(s.cached_tokens == 0 for s in run.seqs)


def test_a_request_waits_only_while_the_one_it_waits_for_has_not_computed_the_page():
    """The filing made at admission is gone once the page is computed into, or the sequence
    lets its pages go; only running sequences are filed."""
    sharing = PrefixSharing("test")
    tokens = [3 + i for i in range(50)]
    seq = Sequence(0, "r0", 0, list(tokens), 50, SamplingParams(max_tokens=4), 0)
    seq.state, seq.device_pages = SeqState.RUNNING, [7]
    sharing.open_pages.expect(seq, sharing.root)
    wanted = token_bytes(tokens[:40])
    assert sharing.open_pages.expected(sharing.root, 0, wanted) == 40
    seq.num_computed = 50
    sharing.computed(seq)
    assert sharing.open_pages.expected(sharing.root, 0, wanted) == 0
    assert sharing.open_pages.longest(sharing.root, 0, wanted) == (7, 40)
    other = Sequence(1, "r1", 0, list(tokens), 50, SamplingParams(max_tokens=4), 0)
    other.state, other.device_pages = SeqState.RUNNING, [8]
    sharing.open_pages.expect(other, sharing.root)
    sharing.released(other, host=True)
    assert sharing.open_pages.expected(sharing.root, 0, wanted) == 0
    assert not sharing.open_pages.problems()
