"""The partly filled last computed page of each running sequence, indexed like the prefix
cache's tails (the previous page's key and the first token), so that a sequence admitted while
another with the same prompt start still runs copies that page's start instead of computing
it: e.g. requests with one system prompt that ends mid-page, admitted after the first of them
computed it. Policy state of PrefixSharing (sharing.py); the pages stay the allocator's.
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
        self.close(seq)
        tail_key = None
        if seq.num_computed % PAGE_SIZE and index < len(seq.device_pages):
            start = index * PAGE_SIZE
            tail_key = parent + token_bytes(seq.token_ids[start:start + 1])
            self._by_tail.setdefault(tail_key, {})[seq.seq_id] = seq
        self._filed[seq.seq_id] = (index, tail_key)

    def close(self, seq: Sequence) -> None:
        """`seq`'s device pages go (unload, eviction, end): it donates nothing any more."""
        filed = self._filed.pop(seq.seq_id, None)
        if filed is None or filed[1] is None:
            return
        members = self._by_tail[filed[1]]
        del members[seq.seq_id]
        if not members:
            del self._by_tail[filed[1]]

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
                for members in self._by_tail.values() for seq in members.values()
                if seq.state is not SeqState.RUNNING]
