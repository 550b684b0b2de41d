"""Page allocation for one tier (device or host). Storage only: no policy lives here.

Pages are reference counted: a page shared by several sequences (a common prompt prefix) is
handed out once and referenced again with `share`; `free` drops one reference. A page whose
last reference goes either returns to the free heap, or, when a prefix cache keeps it (its
content is a full page of known tokens), waits in the cache until its room is needed:
`allocate` takes free pages first, then reclaims the cache's least recently used ones. Both
kinds count as free (`num_free`)."""

from __future__ import annotations

import heapq

from batchgen.sched.prefix_cache import PrefixCache


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Hands out page ids of one pool; lowest ids first so runs are reproducible."""

    def __init__(self, num_pages: int, name: str, cache: PrefixCache | None = None):
        self.num_pages = num_pages
        self.name = name
        self._free = list(range(num_pages))
        heapq.heapify(self._free)
        self.refs = [0] * num_pages
        """References per page: the sequences holding it."""
        self.cache = cache
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free, or cached and held by no sequence."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"{self.name}: asked for {count} pages, {self.num_free} free")
        pages = [heapq.heappop(self._free) if self._free else self.cache.reclaim()
                 for _ in range(count)]
        for page in pages:
            self.refs[page] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (held already, or idle in the cache)."""
        for page in pages:
            if self.refs[page] == 0:
                self.cache.take(page)  # an idle cached page is in use again
            self.refs[page] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds is free again (or idle in
        the cache, when the cache keeps it)."""
        for page in pages:
            if self.refs[page] <= 0:
                raise AssertionError(f"{self.name}: page {page} freed while not held")
            self.refs[page] -= 1
            if self.refs[page]:
                continue
            if self.cache is not None and self.cache.release(page):
                continue
            heapq.heappush(self._free, page)

    def clear_cache(self) -> None:
        """Drop every idle cached page back to the free heap."""
        while self.cache is not None and self.cache.num_idle:
            heapq.heappush(self._free, self.cache.reclaim())

    def check(self, owned: list[list[int]]) -> None:
        """Raise if a page's references differ from its holders in `owned`, a held page is
        free or idle in the cache, or a page is leaked (neither held, free nor idle)."""
        holders = [0] * self.num_pages
        for pages in owned:
            for page in pages:
                holders[page] += 1
        free = set(self._free)
        idle = set(self.cache.idle_pages()) if self.cache is not None else set()
        problems = []
        if len(free) != len(self._free) or free & idle:
            problems.append("a page free twice")
        for page in range(self.num_pages):
            if holders[page] != self.refs[page]:
                problems.append(f"page {page}: {self.refs[page]} refs, {holders[page]} holders")
            elif holders[page] and (page in free or page in idle):
                problems.append(f"page {page} held and free")
            elif not holders[page] and page not in free and page not in idle:
                problems.append(f"page {page} leaked")
        if self.cache is not None:
            problems += self.cache.problems(self.refs)
        if problems:
            raise AssertionError(f"{self.name}: " + "; ".join(problems[:8]))
