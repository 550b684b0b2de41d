"""Prefix cache of one page tier: full KV pages keyed by a hash chain of their tokens.

Page i of a sequence is keyed by `page_key(key of page i-1, its 64 tokens)`, seeded by a salt
naming whatever else changes the KV (the model, the KV dtype): equal keys mean equal tokens
from position 0 on, so equal KV. Only full pages whose KV is computed are registered; a page
is never written once full, so a shared page is read-only. Storage only: which pages a
sequence maps, and when, is the scheduler's policy.

A registered page held by no sequence stays "idle" (its KV intact) until its room is needed:
the allocator reclaims idle pages least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from batchgen.core import PAGE_SIZE


def root_key(salt: str) -> bytes:
    """The key page 0 chains from."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def page_key(parent: bytes, tokens) -> bytes:
    """The key of a full page of `tokens` following the page keyed `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def extend_keys(keys: list[bytes], root: bytes, token_ids, full_pages: int) -> None:
    """Append the keys of pages len(keys) .. full_pages - 1 of `token_ids` to `keys`."""
    for page in range(len(keys), full_pages):
        parent = keys[-1] if keys else root
        keys.append(page_key(parent, token_ids[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]))


class PrefixCache:
    def __init__(self, name: str):
        self.name = name
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Registered pages no sequence holds, least recently used first."""

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest prefix of `keys` that is cached."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, key: bytes, page: int) -> bool:
        """Cache `page` (full, computed, held) under `key`; False when the key is cached
        already (by another page) or the page under another key."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def forget(self, page: int) -> None:
        """Unregister a held page whose content will not be kept."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]

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
        return found
