"""Prefix cache of one page tier: full KV pages keyed by a hash chain of their tokens.

Page i of a sequence is keyed by `page_key(key of page i-1, its 64 tokens' bytes)`, seeded by
a salt naming whatever else changes the KV (the model, the KV dtype): equal keys mean equal tokens
from position 0 on, so equal KV. Only full pages whose KV is computed are registered; a page
is never written once full, so a shared page is read-only. Storage only: which pages a
sequence maps, and when, is the scheduler's policy.

A registered page held by no sequence stays "idle" (its KV intact) until its room is needed:
the allocator reclaims idle pages least recently used first.

A cache built with `tails=True` also indexes each page by its parent's key and its tokens, so
a sequence whose next page is not cached whole can find a cached page that begins with the
same tokens after the same prefix (`longest_tail`): their first tokens' KV is the same.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from itertools import islice

from batchgen.core import PAGE_SIZE


def root_key(salt: str) -> bytes:
    """The key page 0 chains from."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


TAIL_CANDIDATES = 8
"""Cached pages compared, most recent first, when looking for the longest shared page start:
they share their parent and first token, and in batch jobs they are mostly the pages of
requests with one common prefix, which share as many tokens (bounds the admission's cost)."""


def page_key(parent: bytes, tokens: bytes) -> bytes:
    """The key of a full page whose tokens are `tokens` (token_bytes) following the page keyed
    `parent`."""
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


def token_bytes(tokens) -> bytes:
    """Token ids as the bytes the keys hash and the tail index compares (8 per token, little
    endian). `struct` packs a list of ints ~3x faster than `array` builds from it."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two `token_bytes` strings share (bisection on slices, which
    compare in C)."""
    low, high = 0, min(len(a), len(b)) // 8
    while low < high:
        mid = (low + high + 1) // 2
        if a[:8 * mid] == b[:8 * mid]:
            low = mid
        else:
            high = mid - 1
    return low


def extend_keys(keys: list[bytes], root: bytes, token_ids, full_pages: int) -> None:
    """Append the keys of pages len(keys) .. full_pages - 1 of `token_ids` to `keys`. The
    tokens are turned into bytes once for all those pages, each page's key hashing its slice."""
    first = len(keys)
    if full_pages <= first:
        return
    data = token_bytes(token_ids[first * PAGE_SIZE:full_pages * PAGE_SIZE])
    width = 8 * PAGE_SIZE
    parent = keys[-1] if keys else root
    for offset in range(0, len(data), width):
        parent = page_key(parent, data[offset:offset + width])
        keys.append(parent)


class PrefixCache:
    def __init__(self, name: str, tails: bool = False):
        self.name = name
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Registered pages no sequence holds, least recently used first."""
        self._tails: dict[bytes, dict[int, bytes]] | None = {} if tails else None
        """With `tails`: registered pages by their parent's key and first token (the dict
        key is both, concatenated), each with its tokens."""
        self._tail_key_of: dict[int, bytes] = {}

    @property
    def indexes_tails(self) -> bool:
        """Whether `register` files pages by parent and tokens (then it wants their tokens)."""
        return self._tails is not None

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._page_of

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest prefix of `keys` that is cached."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, key: bytes, page: int, parent: bytes = b"", tokens: bytes = b"") -> bool:
        """Cache `page` (full, computed, held) under `key`; False when the key is cached
        already (by another page) or the page under another key. A cache with tails indexes
        it by `parent` (the previous page's key, or the root) and its `tokens` (token_bytes)."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        if self._tails is not None and tokens:
            tail_key = parent + tokens[:8]
            self._tails.setdefault(tail_key, {})[page] = tokens
            self._tail_key_of[page] = tail_key
        return True

    def longest_tail(self, parent: bytes, tokens: bytes) -> tuple[int | None, int]:
        """A cached page after the page keyed `parent` that begins with the most of `tokens`
        (token_bytes, at most one page), and how many it shares; (None, 0) when none shares
        the first. Looks at the TAIL_CANDIDATES most recently registered such pages."""
        if self._tails is None or not tokens:
            return None, 0
        best, shared = None, 0
        candidates = self._tails.get(parent + tokens[:8], {})
        for page in islice(reversed(candidates), TAIL_CANDIDATES):
            common = common_tokens(candidates[page], tokens)
            if common > shared:
                best, shared = page, common
                if 8 * shared == len(tokens):
                    break
        return best, shared

    def forget(self, page: int) -> None:
        """Unregister a held page whose content will not be kept."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
            self._drop_tail(page)

    def _drop_tail(self, page: int) -> None:
        tail_key = self._tail_key_of.pop(page, None)
        if tail_key is None:
            return
        siblings = self._tails[tail_key]
        del siblings[page]
        if not siblings:
            del self._tails[tail_key]

    def take(self, page: int) -> None:
        """An idle page is held again."""
        del self._idle[page]

    def release(self, page: int) -> bool:
        """The last holder let `page` go: keep it idle when it is cached (True)."""
        if page not in self._key_of:
            return False
        self._idle[page] = None
        return True

    def reclaim(self) -> int:
        """Forget the least recently used idle page and hand it out."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self._drop_tail(page)
        return page

    def idle_pages(self) -> list[int]:
        return list(self._idle)

    def problems(self, refs: list[int]) -> list[str]:
        """Inconsistencies with the allocator's references (for check_integrity)."""
        found = []
        for page in self._idle:
            if refs[page] or page not in self._key_of:
                found.append(f"idle page {page} held or not cached")
        if len(self._page_of) != len(self._key_of):
            found.append("cache maps disagree")
        if any(page not in self._key_of for page in self._tail_key_of):
            found.append("tail index holds a page not cached")
        return found
