"""The partly filled last computed page of each running sequence, indexed like the prefix
cache's tails (the previous page's key and the first token), so that a sequence admitted while
another with the same prompt start still runs copies that page's start instead of computing
it: e.g. requests with one system prompt that ends mid-page, admitted after the first of them
computed it. It also files the sequences admitted to compute a page from its first token, so
that one admitted beside them with the same next tokens waits a step and copies their page
instead of computing those tokens too (`expected`). Policy state of PrefixSharing
(sharing.py); the pages stay the allocator's.
"""

from __future__ import annotations

from itertools import islice

from batchgen.core import PAGE_SIZE
from batchgen.sched.prefix_cache import TAIL_CANDIDATES, common_tokens, token_bytes
from batchgen.sched.sequence import Sequence, SeqState


class OpenPages:
    def __init__(self):
        self._by_tail: dict[bytes, dict[int, Sequence]] = {}
        """Running sequences by the tail key (parent key + first token) of their open page."""
        self._filed: dict[int, tuple[int, bytes | None]] = {}
        """seq_id -> (index of the page looked at last, the tail key it is filed under)."""
        self._expecting: dict[bytes, dict[int, Sequence]] = {}
        """Running sequences by the tail key of the page they were admitted to compute from
        its first token."""
        self._expects: dict[int, tuple[int, bytes]] = {}
        """seq_id -> (that page's index, its tail key)."""

    def filed_at(self, seq: Sequence, index: int) -> bool:
        """Whether `seq` was filed with its last computed token on page `index` (then its
        open page is filed already: the check at every decode step)."""
        filed = self._filed.get(seq.seq_id)
        return filed is not None and filed[0] == index

    def update(self, seq: Sequence, parent: bytes) -> None:
        """File `seq` under its open page (the page holding its last computed token, when
        partly filled) once its last computed token is on a new page; `parent`: the key of the
        page before that one. A page that fills up stays filed until the next one opens (it is
        in the prefix cache then too)."""
        index = (seq.num_computed - 1) // PAGE_SIZE
        self._unfile_open(seq)
        tail_key = None
        if seq.num_computed % PAGE_SIZE and index < len(seq.device_pages):
            start = index * PAGE_SIZE
            tail_key = parent + token_bytes(seq.token_ids[start:start + 1])
            self._by_tail.setdefault(tail_key, {})[seq.seq_id] = seq
        self._filed[seq.seq_id] = (index, tail_key)

    def close(self, seq: Sequence) -> None:
        """`seq`'s device pages go (unload, eviction, end): it donates nothing any more."""
        self._unfile_open(seq)
        expects = self._expects.pop(seq.seq_id, None)
        if expects is not None:
            _unfile(self._expecting, expects[1], seq)

    def _unfile_open(self, seq: Sequence) -> None:
        filed = self._filed.pop(seq.seq_id, None)
        if filed is not None and filed[1] is not None:
            _unfile(self._by_tail, filed[1], seq)

    def expect(self, seq: Sequence, parent: bytes) -> None:
        """File `seq`, just admitted with no token of its next page computed (`parent`: the
        key of the page before it), as about to compute that page."""
        start = seq.num_computed
        if start % PAGE_SIZE or start >= seq.num_tokens - 1:
            return
        tail_key = parent + token_bytes(seq.token_ids[start:start + 1])
        self._expecting.setdefault(tail_key, {})[seq.seq_id] = seq
        self._expects[seq.seq_id] = (start // PAGE_SIZE, tail_key)

    def expected(self, parent: bytes, index: int, tokens: bytes) -> int:
        """How many of `tokens` (token_bytes: a sequence's next tokens, from the start of page
        `index`, after the page keyed `parent`) a running sequence filed by `expect` is about
        to compute on that page (0 when none). One that computed into the page since is
        passed over (it stays filed until it lets its pages go: nothing runs per decode step)."""
        shared = 0
        start = index * PAGE_SIZE
        for other in islice(reversed(self._expecting.get(parent + tokens[:8], {}).values()),
                            TAIL_CANDIDATES):
            if (other.state is SeqState.RUNNING and self._expects[other.seq_id][0] == index
                    and other.num_computed <= start):
                theirs = token_bytes(other.token_ids[start:min(other.num_tokens,
                                                               start + PAGE_SIZE)])
                shared = max(shared, common_tokens(theirs, tokens))
        return shared

    def longest(self, parent: bytes, index: int, tokens: bytes) -> tuple[int | None, int]:
        """The device page of a running sequence's open page at `index` (after the page keyed
        `parent`) that begins with the most of `tokens` (token_bytes), and how many of its
        computed tokens it shares; (None, 0) when none shares the first."""
        best, shared = None, 0
        members = self._by_tail.get(parent + tokens[:8], {})
        for other in islice(reversed(members.values()), TAIL_CANDIDATES):
            if other.state is not SeqState.RUNNING or index >= len(other.device_pages):
                continue
            start = index * PAGE_SIZE
            computed = token_bytes(other.token_ids[start:min(other.num_computed,
                                                             start + PAGE_SIZE)])
            common = common_tokens(computed, tokens)
            if common > shared:
                best, shared = other.device_pages[index], common
        return best, shared

    def problems(self) -> list[str]:
        """Inconsistencies (for check_integrity): only running sequences are filed."""
        return [f"seq {seq.seq_id} filed under an open page while {seq.state.value}"
                for index in (self._by_tail, self._expecting)
                for members in index.values() for seq in members.values()
                if seq.state is not SeqState.RUNNING]


def _unfile(index: dict[bytes, dict[int, Sequence]], key: bytes, seq: Sequence) -> None:
    members = index[key]
    del members[seq.seq_id]
    if not members:
        del index[key]
