"""Page allocation for one tier (device or host). Storage only: no policy lives here."""

from __future__ import annotations

import heapq


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Hands out page ids of one pool; lowest ids first so runs are reproducible."""

    def __init__(self, num_pages: int, name: str):
        self.num_pages = num_pages
        self.name = name
        self._free = list(range(num_pages))
        heapq.heapify(self._free)
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"{self.name}: asked for {count} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(count)]
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def check(self, owned: list[list[int]]) -> None:
        """Raise if a page is owned twice, leaked (neither free nor owned) or both."""
        seen: dict[int, int] = {}
        for pages in owned + [self._free]:
            for page in pages:
                seen[page] = seen.get(page, 0) + 1
        doubled = [p for p, n in seen.items() if n > 1]
        leaked = [p for p in range(self.num_pages) if p not in seen]
        if doubled or leaked:
            raise AssertionError(
                f"{self.name}: pages owned twice {doubled[:8]}, leaked {leaked[:8]}")
