"""Host pages that back a shared prefix before they hold its KV.

When an admitted sequence maps a prefix cached on the device and not on the host, its host
pages for that prefix become the prefix's host backing: registered in the host cache, so every
later sequence with the prefix shares them instead of reserving a private copy. Their content
is written only when it can be needed: when a holder is unloaded (its device pages go; the
copy is part of that unload). A holder that ends on the device needs no copy, and when the last
holder lets go of a page never written, the page leaves the host cache (its KV is still cached
on the device, and the next sequence mapping it from there backs it again). Most shared
prefixes (a system prompt, the prompt of n > 1 choices) end that way: writing them back at
admission copied each prefix once over PCIe into host memory not yet pinned, holding the step
for ~0.2 s per 2,000-token Llama-3-8B prefix.

While a host page is pending its device twin is held too (every holder of the host page maps
the same device pages, which stay held while it runs), so the copy always has its source.
"""

from __future__ import annotations


class DeferredBacking:
    """Pending host pages and the device page each will copy from. Storage only: the
    scheduler decides when the copies happen."""

    def __init__(self):
        self._device_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._device_of)

    def defer(self, host_pages: list[int], device_pages: list[int]) -> None:
        """`host_pages` back `device_pages` from now on; their content comes later."""
        self._device_of.update(zip(host_pages, device_pages))

    def is_pending(self, host_page: int) -> bool:
        return host_page in self._device_of

    def due(self, host_pages: list[int]) -> tuple[list[int], list[int]]:
        """(device pages, host pages) of the pending ones among `host_pages`, in order, now
        being copied: no longer pending."""
        pending = [page for page in host_pages if page in self._device_of]
        return [self._device_of.pop(page) for page in pending], pending

    def let_go(self, host_pages: list[int], host_refs: list[int], host_cache) -> None:
        """Before a holder frees `host_pages`: a pending page it holds alone will never be
        written, so it leaves `host_cache` (a PrefixCache) and is pending no more."""
        for page in host_pages:
            if page in self._device_of and host_refs[page] == 1:
                del self._device_of[page]
                host_cache.forget(page)

    def problems(self, device_refs: list[int], host_refs: list[int]) -> list[str]:
        """Pending pages or their device twins held by no sequence (for check_integrity)."""
        return [f"pending host page {host} (from device page {device}) not held"
                for host, device in self._device_of.items()
                if not host_refs[host] or not device_refs[device]]
