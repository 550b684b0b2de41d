"""Prefix sharing policy: which cached pages a sequence maps, when it waits for a prefix that
is being computed, which waiting sequences are admitted together, and which running ones
share pages. Storage (keys, idle pages) is prefix_cache.py's; page references are the
allocators'.

- A sequence maps the longest run of its full pages cached on the device, or on the host (then
  loaded, page by page, by host -> device copies), keeping at least its last token to compute
  (its logits give the next token). When a device page follows the same pages and begins
  with the same tokens as its next page (another request's page after a prefix that ends
  mid-page, or a repeated prompt: a cached full page, or a running sequence's partly filled
  one, open_pages.py), it copies that page (device -> device) and computes only from the
  first token they differ in. While a sequence admitted just before it is about to compute
  such a page (its start not computed yet), it waits a step for it when that spares at least
  WAIT_MIN_TOKENS tokens and a quarter of its work.
- A choice of an n > 1 request forks from a sibling that computed the prompt: it maps the
  prompt's full pages, copies the sibling's partial last page (device -> device) and computes
  only the last prompt token. While a sibling or another sequence is still computing the pages
  it would map, it waits instead of computing them again.
- Admission order: the oldest waiting sequence first (no starvation), each followed by the
  other waiting sequences whose first page is the same, longest shared prefix first.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice

from batchgen.core import PAGE_SIZE
from batchgen.sched.open_pages import OpenPages
from batchgen.sched.pages import PageAllocator
from batchgen.sched.prefix_cache import PrefixCache, extend_keys, root_key, token_bytes
from batchgen.sched.sequence import Sequence, SeqState
from batchgen.sched.step import PrefixShare

WAIT_MIN_TOKENS = 16
"""A sequence waits a step for a running one about to compute its next tokens only when that
spares it at least this many (a quarter page): fewer cost less to compute than the wait."""


@dataclass
class Hit:
    """What a sequence maps at admission."""

    device_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    donor: Sequence | None = None
    """A sibling whose partial last prompt page is copied (n > 1 fork)."""
    tail_page: int | None = None
    """A device page whose first `tail_tokens` tokens are the sequence's next ones (cached,
    or a running sequence's open page)."""
    tail_tokens: int = 0

    @property
    def pages(self) -> int:
        return max(len(self.device_pages), len(self.host_pages))


NO_HIT = Hit()


class PrefixSharing:
    def __init__(self, salt: str):
        self.root = root_key(salt)
        self.device_cache = PrefixCache("device", tails=True)
        self.host_cache = PrefixCache("host")
        self._inflight: dict[bytes, Sequence] = {}
        """Keys of pages an admitted sequence is computing, and who computes them."""
        self._groups: dict[bytes, dict[int, Sequence]] = {}
        """Waiting sequences by the key of their first page."""
        self._siblings: dict[str, list[Sequence]] = {}
        """Live choices of n > 1 requests, by request id."""
        self.open_pages = OpenPages()

    # -- sequences in and out -------------------------------------------------------------
    def keys(self, seq: Sequence, full_pages: int | None = None) -> list[bytes]:
        """The keys of the sequence's first `full_pages` pages (default: all full pages)."""
        full = seq.num_tokens // PAGE_SIZE
        full_pages = full if full_pages is None else min(full_pages, full)
        extend_keys(seq.page_keys, self.root, seq.token_ids, full_pages)
        return seq.page_keys[:full_pages]

    def added(self, seq: Sequence) -> None:
        if self.keys(seq, 1):
            self._groups.setdefault(seq.page_keys[0], {})[id(seq)] = seq
        if seq.sampling.n > 1:
            self._siblings.setdefault(seq.request_id, []).append(seq)

    def waiting_again(self, seq: Sequence) -> None:
        """An evicted sequence is back in the waiting queue."""
        if seq.page_keys:
            self._groups.setdefault(seq.page_keys[0], {})[id(seq)] = seq

    def admitted(self, seq: Sequence, hit: Hit) -> None:
        if seq.page_keys:
            group = self._groups.get(seq.page_keys[0], {})
            group.pop(id(seq), None)
            if not group:
                self._groups.pop(seq.page_keys[0], None)
        for key in self.keys(seq, (seq.num_tokens - 1) // PAGE_SIZE)[hit.pages:]:
            self._inflight.setdefault(key, seq)
        index = seq.num_computed // PAGE_SIZE
        self.open_pages.expect(seq, seq.page_keys[index - 1] if index else self.root)

    def released(self, seq: Sequence, host: bool) -> None:
        """The sequence's device pages go (unload), and its host pages with them when `host`
        (eviction, end)."""
        for key in seq.page_keys[seq.device_registered:]:
            if self._inflight.get(key) is seq:
                del self._inflight[key]
        self.open_pages.close(seq)
        seq.device_registered = 0
        if host:
            seq.host_registered = 0

    def finished(self, seq: Sequence) -> None:
        siblings = self._siblings.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._siblings[seq.request_id]

    # -- admission ------------------------------------------------------------------------
    def order(self, waiting, limit: int) -> Iterator[Sequence]:
        """Waiting sequences in admission order (module docstring), at most `limit` of them:
        an admission takes no more than the decode batch, and the scan stays short however
        many wait."""
        pulled: set[int] = set()
        for seq in islice(waiting, limit):
            if id(seq) in pulled:
                continue
            yield seq
            pulled.add(id(seq))
            if len(pulled) >= limit:
                return
            if not seq.page_keys:
                continue
            group = self._groups.get(seq.page_keys[0], {}).values()
            members = [m for m in islice(group, limit)
                       if id(m) not in pulled and m.state is SeqState.WAITING]
            # Longest shared prefix first, in whole pages: by their keys where `prepare`
            # hashed both prompts, else by comparing tokens (hashing every member's prompt
            # here cost most of a decision that admits a few and leaves the rest waiting).
            # Not while a running sequence computes their first page: then each waits for it.
            if not self._in_flight_uncached(seq.page_keys[0]):
                members.sort(key=lambda m: -shared_pages(seq, m))
            for member in members[:limit - len(pulled)]:
                pulled.add(id(member))
                yield member

    def match(self, seq: Sequence, device: PageAllocator, host: PageAllocator) -> Hit | None:
        """What `seq` maps if admitted now; None while pages it would map are being computed
        by a running sequence (it waits for them)."""
        pages = (seq.num_tokens - 1) // PAGE_SIZE
        if self._first_page_in_flight(seq, pages):
            return None  # known without hashing the rest of its prompt
        usable = self.keys(seq, pages)
        hit = Hit(self.device_cache.lookup(usable), self.host_cache.lookup(usable))
        if hit.pages < len(usable):
            owner = self._inflight.get(usable[hit.pages])
            if owner is not None and owner.state is SeqState.RUNNING:
                return None
        if not seq.num_decoded and seq.sampling.n > 1:
            for sibling in self._siblings.get(seq.request_id, ()):
                if sibling is seq or sibling.state is not SeqState.RUNNING or sibling.num_decoded:
                    continue
                if sibling.num_computed < seq.num_tokens - 1:
                    return None  # it is computing the prompt: fork from it once it has
            if hit.pages == len(usable) and (seq.num_tokens - 1) % PAGE_SIZE:
                hit.donor = next((s for s in self._siblings.get(seq.request_id, ())
                                  if s is not seq and s.state is SeqState.RUNNING
                                  and s.num_computed >= seq.num_tokens - 1), None)
        if hit.donor is None and self._find_tail(seq, hit):
            return None  # a running sequence is about to compute its next tokens
        return hit

    def _first_page_in_flight(self, seq: Sequence, pages: int) -> bool:
        """Whether `seq` maps no cached page and a running sequence computes its first one
        (what `match` finds in that case, from the key hashed when it was added)."""
        return bool(pages and seq.page_keys) and self._in_flight_uncached(seq.page_keys[0])

    def _in_flight_uncached(self, key: bytes) -> bool:
        """Whether the page keyed `key` is cached on neither tier and a running sequence
        computes it."""
        if key in self.device_cache or key in self.host_cache:
            return False
        owner = self._inflight.get(key)
        return owner is not None and owner.state is SeqState.RUNNING

    def prepare(self, waiting, max_pages: int, limit: int) -> None:
        """Hash ahead the prompt pages `match` will look up for the waiting sequences, in
        admission order (`order(waiting, limit)`), at most `max_pages` pages: work every
        admission does anyway, done here while the device runs a step instead of between
        steps."""
        for seq in self.order(waiting, limit):
            if max_pages <= 0:
                return
            pages = (seq.num_tokens - 1) // PAGE_SIZE
            missing = pages - len(seq.page_keys)
            if missing > 0:
                self.keys(seq, pages)
                max_pages -= missing

    def _find_tail(self, seq: Sequence, hit: Hit) -> bool:
        """Set `hit`'s tail: the device page (cached, or a running sequence's open page) that
        begins with the most of the tokens after `hit`'s pages (never the last token: it is
        computed for its logits). True when `seq` should wait instead: a running sequence is
        about to compute a page beginning with WAIT_MIN_TOKENS more of them, and at least a
        quarter of what `seq` would compute now (requests admitted together whose shared
        prefix ends inside a page, or repeated prompts shorter than a page)."""
        first = hit.pages * PAGE_SIZE
        count = min(PAGE_SIZE, seq.num_tokens - 1 - first)
        if count <= 0:
            return False
        parent = seq.page_keys[hit.pages - 1] if hit.pages else self.root
        tokens = token_bytes(seq.token_ids[first:first + count])
        cached = self.device_cache.longest_tail(parent, tokens)
        running = self.open_pages.longest(parent, hit.pages, tokens)
        hit.tail_page, hit.tail_tokens = max(cached, running, key=lambda found: found[1])
        if count - hit.tail_tokens < WAIT_MIN_TOKENS:
            return False
        gain = self.open_pages.expected(parent, hit.pages, tokens) - hit.tail_tokens
        return gain >= WAIT_MIN_TOKENS and 4 * gain >= seq.num_tokens - first - hit.tail_tokens

    def device_hits(self, seq: Sequence, pages: int) -> list[int]:
        """Cached device pages for the first `pages` pages of `seq` (a load maps them instead
        of copying them from the host)."""
        return self.device_cache.lookup(self.keys(seq, pages))

    # -- registering computed pages -------------------------------------------------------
    def computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly full, computed device pages to the cache."""
        pages = seq.num_computed // PAGE_SIZE
        full = min(pages, len(seq.device_pages))
        if full > seq.device_registered:  # once a page; this runs at every decode step
            for key in self._register(seq, self.device_cache, seq.device_pages,
                                      seq.device_registered, full):
                if self._inflight.get(key) is seq:
                    del self._inflight[key]
            seq.device_registered = full
        last = (seq.num_computed - 1) // PAGE_SIZE  # the page of the last computed token
        if (full == pages and not self.open_pages.filed_at(seq, last)
                and seq.state is SeqState.RUNNING):
            self.open_pages.update(seq, self.keys(seq, full)[-1] if full else self.root)

    def on_host(self, seq: Sequence) -> None:
        """Offer the sequence's full pages copied to the host to the host cache."""
        full = min(seq.num_on_host // PAGE_SIZE, len(seq.host_pages))
        self._register(seq, self.host_cache, seq.host_pages, seq.host_registered, full)
        seq.host_registered = max(seq.host_registered, full)

    def _register(self, seq: Sequence, cache, pages: list[int], done: int,
                  full: int) -> list:
        """Register `pages[done:full]` of `seq` in `cache`; the keys registered."""
        if full <= done:
            return []
        keys = self.keys(seq, full)
        for index in range(done, full):
            tokens = (token_bytes(seq.token_ids[index * PAGE_SIZE:(index + 1) * PAGE_SIZE])
                      if cache.indexes_tails else b"")
            cache.register(keys[index], pages[index], keys[index - 1] if index else self.root,
                           tokens)
        return keys[done:full]

    # -- groups for the decode kernel -----------------------------------------------------
    @staticmethod
    def shares(running: list[Sequence], device: PageAllocator) -> list[PrefixShare]:
        """Running sequences whose leading device pages are the same pages."""
        by_first: dict[int, list[Sequence]] = {}
        for seq in running:
            if seq.device_pages and device.refs[seq.device_pages[0]] > 1:
                by_first.setdefault(seq.device_pages[0], []).append(seq)
        shares = []
        for members in by_first.values():
            if len(members) < 2:
                continue
            first = members[0].device_pages
            count = min(min(_common(first, m.device_pages), m.num_computed // PAGE_SIZE)
                        for m in members)
            shares.append(PrefixShare([m.seq_id for m in members], first[:count]))
        return shares


def shared_pages(a: Sequence, b: Sequence) -> int:
    """How many leading whole pages two sequences' tokens share: from their page keys when
    both are hashed that far (a key names its page and every page before it), else from the
    tokens."""
    pages = min(a.num_tokens, b.num_tokens) // PAGE_SIZE
    keys_a, keys_b = a.page_keys, b.page_keys
    if len(keys_a) < pages or len(keys_b) < pages:
        return common_pages(a.token_ids, b.token_ids)
    # equal keys at i mean equal pages 0..i: the first page whose keys differ, by bisection
    return bisect_left(range(pages), True, key=lambda i: keys_a[i] != keys_b[i])


def common_pages(a, b) -> int:
    """How many leading whole pages two token lists share (list slices compare in C)."""
    pages = min(len(a), len(b)) // PAGE_SIZE
    low, high = 0, pages  # bisection: the first `low` pages are known equal
    while low < high:
        mid = (low + high + 1) // 2
        if a[low * PAGE_SIZE:mid * PAGE_SIZE] == b[low * PAGE_SIZE:mid * PAGE_SIZE]:
            low = mid
        else:
            high = mid - 1
    return low


def _common(a: list, b: list) -> int:
    """Length of the common prefix of two lists."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
