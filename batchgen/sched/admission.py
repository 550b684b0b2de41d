"""Admission: which waiting sequences start at a decision, and the pages each one gets.

The scheduler (scheduler.py) calls `Admission.admit` at each decision; loading a swapped
sequence back sizes its device pages with the same rule (`device_target`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE
from batchgen.sched.counters import Counters
from batchgen.sched.host_backing import DeferredBacking
from batchgen.sched.pages import PageAllocator
from batchgen.sched.sequence import SeqState, Sequence, cached_prompt_tokens, pages_for
from batchgen.sched.sharing import NO_HIT, Hit, PrefixSharing
from batchgen.sched.step import PageCopy, ScheduleOutput

PASS_LOOKAHEAD = 64
"""Waiting sequences looked at past the oldest one that does not fit, for sharers of
device-cached prefix pages to admit before those pages leave the cache (`Admission.admit`)."""

FreeDevice = Callable[[int, Sequence | None, ScheduleOutput, tuple[Sequence, ...]], bool]
"""`free_device(pages, keep, out, protect)`: unload running sequences (not those in `protect`)
until `pages` device pages are free; False when they could not be (Scheduler._free_device)."""


def order_limit(cfg: SchedulerConfig) -> int:
    """Waiting sequences an admission looks at, at most: it takes no more than the decode
    batch, and the scan stays short however many wait."""
    return 4 * cfg.max_decode_batch + 64


def device_target(seq: Sequence, cfg: SchedulerConfig, window: int, queued: int) -> int:
    """Device pages for `seq` when it is loaded or admitted, `queued` sequences waiting to be
    admitted or on the host (`seq` one of them): its context (at least until the next
    decision, `window` tokens on) plus the initial buffer, or, with the adaptive buffer, only
    one extension while other sequences wait. Then the device bounds the decode batch, and a
    2,048-token buffer per sequence, mostly unused by answers of ~2k tokens, keeps a large
    share of the pool from running sequences. Measured on an H200 (W2-lite, host tier on/off):
    1.07x with the buffer always 32 pages, 1.26x shrinking it only while sequences wait on
    the host, 1.31x with this rule (1.33-1.34x with the buffer always 4 pages); W1 and
    DeepSeek-R1 long-tail simulations unchanged."""
    buffer = cfg.initial_gpu_page_buffer
    if cfg.adaptive_gpu_page_buffer and queued > 1:
        buffer = min(buffer, cfg.extension_gpu_page_buffer)
    tokens = max(seq.num_tokens + buffer * PAGE_SIZE, seq.tokens_after(window))
    return pages_for(min(tokens, seq.budget_tokens))


class Admission:
    """Admits waiting sequences at a decision: the order (oldest first, prefix sharers
    together), the page reservations on both tiers, prefix mapping and n > 1 forks.

    It holds the scheduler's pools, prefix policy, deferred host backing and its running and
    swapped lists (appending to `running`); the scheduler keeps the waiting queue, rebuilding
    it after each admission."""

    def __init__(self, cfg: SchedulerConfig, window: int, device: PageAllocator,
                 host: PageAllocator, backing: DeferredBacking, prefix: PrefixSharing | None,
                 running: list[Sequence], swapped: list[Sequence], free_device: FreeDevice):
        self.cfg = cfg
        self.window = window
        self.device = device
        self.host = host
        self.backing = backing
        self.prefix = prefix
        self.running = running
        self.swapped = swapped
        self.free_device = free_device
        self.deferred = False
        """The last admit() passed over a sequence waiting for a prefix being computed."""

    def admit(self, waiting: deque[Sequence], out: ScheduleOutput, preempt: bool,
              counters: Counters, chunk_tokens: int) -> list[Sequence]:
        """Admit sequences of `waiting` up to the prefill token budget, appending them to the
        running list; the ones admitted, in order (`waiting` itself is left as it was). With
        `preempt`, running sequences are unloaded to make device room (prefill priority). With
        prefix caching, sequences sharing a prefix come together and map what is cached
        (sharing.py). Oldest first: the first that does not fit waits for room, and only
        sequences mapping pages cached on the device (which would leave the cache before the
        blocked one is in) that fit without unloading anyone pass it (prefix caching on; the
        next PASS_LOOKAHEAD are looked at), and no sequence is passed more than
        max_decode_batch times. `chunk_tokens`: the host reservation chunk (chunking.py)."""
        budget = self.cfg.max_prefill_tokens
        admitted: list[Sequence] = []
        self.deferred = False
        order = (self.prefix.order(waiting, order_limit(self.cfg))
                 if self.prefix is not None else waiting)
        blocked: Sequence | None = None  # the oldest that did not fit: it waits for room
        looked = 0  # sequences looked at past it
        for seq in order:
            if budget <= 0 and admitted:
                break
            if len(self.running) >= self.cfg.max_decode_batch:
                break
            if len(self.running) + len(self.swapped) >= self.cfg.max_pool_size:
                break
            hit = (self.prefix.match(seq, self.device, self.host) if self.prefix is not None
                   else NO_HIT)
            if hit is None:
                self.deferred = True
                continue  # what it would map is being computed: it waits for that
            if blocked is not None:
                looked += 1
                if looked > PASS_LOOKAHEAD:
                    break
                if not hit.device_pages:
                    continue  # only a sharer of device-cached pages passes the blocked one
            needs = self._needs(seq, len(waiting) + len(self.swapped), chunk_tokens)
            if not self._place(seq, hit, out, preempt and blocked is None, admitted, needs,
                               counters):
                if (blocked is not None or self.prefix is None
                        or seq.bypassed >= self.cfg.max_decode_batch):
                    break
                blocked = seq
                continue
            if blocked is not None:
                blocked.bypassed += 1
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.pending_tokens
            counters.admitted += 1
        return admitted

    def _needs(self, seq: Sequence, queued: int, chunk_tokens: int) -> tuple[int, int]:
        """Host and device pages `seq` reserves when admitted, `queued` sequences waiting or
        on the host: host pages for its tokens one window on, at least one chunk."""
        host_need = pages_for(min(seq.budget_tokens,
                                  max(seq.tokens_after(self.window), chunk_tokens)))
        return host_need, device_target(seq, self.cfg, self.window, queued)

    def _place(self, seq: Sequence, hit: Hit, out: ScheduleOutput, preempt: bool,
               admitted: list[Sequence], needs: tuple[int, int], counters: Counters) -> bool:
        """Give an admitted sequence its pages (`needs`, mapping `hit`); False when they do
        not fit."""
        if any(self.backing.is_pending(page) for page in hit.host_pages[len(hit.device_pages):]):
            raise AssertionError(f"seq {seq.seq_id} would load host pages never written")
        host_need, dev_need = needs
        tail = self._usable_tail(hit, out)
        self.host.share(hit.host_pages)
        self.device.share(hit.device_pages)
        fresh = dev_need - len(hit.device_pages)
        if not self._host_admits(host_need - len(hit.host_pages)) or (
                fresh > self.device.num_free
                and (not preempt or not self.free_device(fresh, None, out, tuple(admitted)))):
            self.host.free(hit.host_pages)
            self.device.free(hit.device_pages)
            return False
        seq.host_pages = hit.host_pages + self.host.allocate(host_need - len(hit.host_pages))
        seq.device_pages = hit.device_pages + self.device.allocate(fresh)
        seq.state = SeqState.RUNNING
        self._map_cached(seq, hit, out)
        copied = self._copy_next_page(seq, hit, tail, out, counters)
        if self.prefix is not None:
            self.prefix.admitted(seq, hit)
            self.prefix.computed(seq)
            self.prefix.on_host(seq)
        if seq.cached_tokens is None:
            seq.cached_tokens = cached_prompt_tokens(seq, copied)
            counters.prompt_tokens += seq.prompt_len
            counters.cached_prompt_tokens += seq.cached_tokens
            counters.extra_choices += seq.choice > 0
        return True

    def _map_cached(self, seq: Sequence, hit: Hit, out: ScheduleOutput) -> None:
        """Set up the pages `hit` maps: load those cached on the host only, back those shared
        on the device only with the sequence's host pages."""
        on_device, on_host = len(hit.device_pages), len(hit.host_pages)
        seq.host_registered, seq.device_registered = on_host, on_device
        if on_host > on_device:  # cached on the host only: load those pages
            out.swap_in.append(PageCopy(seq.seq_id, seq.host_pages[on_device:on_host],
                                        seq.device_pages[on_device:on_host]))
        elif on_device > on_host:
            # Shared on the device with no host copy: these host pages back the prefix from
            # now on (cached on the host, so the next sequence mapping it shares them instead
            # of reserving a private copy); its KV is copied there if a holder is unloaded.
            self.backing.defer(seq.host_pages[on_host:on_device],
                               hit.device_pages[on_host:on_device])
            on_host = on_device
        seq.num_on_host = on_host * PAGE_SIZE
        seq.num_computed = hit.pages * PAGE_SIZE

    @staticmethod
    def _copy_next_page(seq: Sequence, hit: Hit, tail: list[int], out: ScheduleOutput,
                        counters: Counters) -> bool:
        """Copy the start of the page after the hit instead of computing it, where another
        page holds it (a forked sibling's partial last prompt page, or `tail`); whether one
        was copied."""
        if hit.donor is not None and hit.donor.state is SeqState.RUNNING and not any(
                c.seq_id == hit.donor.seq_id for c in out.swap_in):
            # fork: copy the sibling's partial last prompt page. Not from a sibling loaded in
            # this plan: the step copies device pages before it loads (a load may reuse a
            # page a copy reads), so its page would still hold what was there before.
            page = hit.pages
            out.device_copies.append(PageCopy(seq.seq_id, [hit.donor.device_pages[page]],
                                              [seq.device_pages[page]]))
            seq.num_computed = seq.num_tokens - 1
            counters.forks += 1
            return True
        if tail:
            # A page beginning with this sequence's next tokens: copy it, compute the rest.
            # Copies run in plan order before any load or forward writes a page, so the page
            # still holds its KV even if this or a later admission reclaimed it (idle and
            # cached) for pages of its own.
            if tail[0] != seq.device_pages[hit.pages]:  # not reclaimed as that very page
                out.device_copies.append(PageCopy(seq.seq_id, tail,
                                                  [seq.device_pages[hit.pages]]))
            seq.num_computed += hit.tail_tokens
            counters.shared_tails += 1
            return True
        return False

    @staticmethod
    def _usable_tail(hit: Hit, out: ScheduleOutput) -> list[int]:
        """[the hit's tail page] when it may be copied in this plan: not for a fork (its
        sibling's page is copied) and not a page this plan loads (device copies run before
        loads, so it would not hold its KV yet)."""
        if hit.donor is not None or hit.tail_page is None:
            return []
        if any(hit.tail_page in copy.dst for copy in out.swap_in):
            return []
        return [hit.tail_page]

    def _host_admits(self, pages: int) -> bool:
        """New work keeps `host_kv_eviction_watermark` % of the host pool free for growth,
        unless nothing else is admitted (then anything that fits may start)."""
        if pages > self.host.num_free:
            return False
        if not self.running and not self.swapped:
            return True
        free_after = 100.0 * (self.host.num_free - pages) / max(1, self.host.num_pages)
        return free_after >= self.cfg.host_kv_eviction_watermark
