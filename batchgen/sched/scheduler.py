"""The scheduler: which sequences run, where their KV pages live, and when that changes.

Every admitted sequence reserves host pages (the backing store); the device holds the working
set. Decisions (admit, load, unload, grow, evict) happen only at decision points: every
`decision_frequency_pages` pages of decode, when the running set empties or halves, and on each
step of an admission wave. Between them the running set is fixed and just decodes. All inputs are
token and page counts, so every rank computes the same decisions without talking.

Invariants after each decision, for every RUNNING sequence s (window = frequency * PAGE_SIZE):
  device pages of s >= pages_for(s.tokens_after(window))   (no allocation between decisions)
  host pages of s   >= pages_for(s.tokens_after(window))   (an unload always has room)

This module holds the step contract (schedule -> continue_plan -> update_from_output) and the
decisions on running and swapped sequences; admission (admission.py), victim order
(eviction.py), shared-prefix host backing (host_backing.py) and the reservation chunk
(chunking.py) live in their own modules.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from batchgen.config import SchedulerConfig
from batchgen.core import PAGE_SIZE
from batchgen.sched.admission import Admission, device_target, order_limit
from batchgen.sched.chunking import ChunkSizer
from batchgen.sched.counters import Counters
from batchgen.sched.eviction import victim_order
from batchgen.sched.host_backing import DeferredBacking
from batchgen.sched.pages import PageAllocator
from batchgen.sched.sharing import PrefixSharing
from batchgen.sched.sequence import Sequence, SeqState, pages_for
from batchgen.sched.step import (  # noqa: F401  (the step contract, importable from here)
    PageCopy, PrefixShare, ScheduleOutput, SeqChunk, SeqResult, StepOutput)

DecodeSteps = Callable[[list[SeqChunk]], int]
"""How many decode steps a decode-only set of chunks should run back to back (a burst)."""

PREPARE_PAGES = 4096
"""Prompt pages `prepare()` hashes at most per call: a few ms of host time, more than a
decision admits in a prefill-heavy step (38 prompts of 34 pages in W3's)."""


class RequestTooLarge(ValueError):
    pass


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, device_pages: int, host_pages: int,
                 prefix_salt: str = ""):
        """`prefix_salt`: names whatever besides the tokens changes the KV (model, KV dtype);
        prefix-cache keys chain from it."""
        self.cfg = cfg.with_decode_batch(None)
        self.prefix = PrefixSharing(prefix_salt) if cfg.enable_prefix_caching else None
        caches = ((self.prefix.device_cache, self.prefix.host_cache) if self.prefix
                  else (None, None))
        self.device = PageAllocator(device_pages, "device", caches[0])
        self.host = PageAllocator(host_pages, "host", caches[1])
        self._shares: list[PrefixShare] = []
        self.backing = DeferredBacking()
        """Host pages backing a shared prefix whose KV is copied there only when needed."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.chunk = ChunkSizer(cfg)
        self.counters = Counters()
        self.window = cfg.decision_frequency_pages * PAGE_SIZE
        self._steps_left = 0
        self._running_at_decision = 0
        self._wave = False
        self.admission = Admission(self.cfg, self.window, self.device, self.host, self.backing,
                                   self.prefix, self.running, self.swapped, self._free_device)

    # -- requests in and out ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        need = pages_for(seq.budget_tokens)
        for pool, flag in ((self.device, "--gpu-kv-cache-size/--gpu-memory-frac"),
                           (self.host, "--host-kv-cache-size")):
            if need > pool.num_pages:
                raise RequestTooLarge(
                    f"needs {need} KV pages (prompt {seq.prompt_len} + max_tokens "
                    f"{seq.sampling.max_tokens} tokens) but the {pool.name} pool holds "
                    f"{pool.num_pages}; raise {flag} or lower max_tokens")
        self.waiting.append(seq)
        if self.prefix is not None:
            self.prefix.added(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's pages; its decode length feeds the adaptive chunk."""
        self._release(seq)
        self.running.remove(seq)
        seq.state = SeqState.FINISHED
        if self.prefix is not None:
            self.prefix.finished(seq)
        self.counters.finished += 1
        self.chunk.observe(seq.num_decoded)

    def prepare(self) -> None:
        """Work of the coming decisions that no step's results change (hashing the pages of
        the prompts that wait), for a runner to do while the device runs a step."""
        if self.prefix is not None:
            self.prefix.prepare(self.waiting, PREPARE_PAGES, order_limit(self.cfg))

    def reset_counters(self) -> None:
        """Counters, peaks and the learned decode length start over (after a warm-up)."""
        self.counters = Counters()
        self.chunk = ChunkSizer(self.cfg)
        self.device.peak_used = self.device.num_used
        self.host.peak_used = self.host.num_used

    def clear_prefix_cache(self) -> None:
        """Drop every cached page no sequence holds (all pages are free once nothing runs)."""
        self.device.clear_cache()
        self.host.clear_cache()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, decode_steps: DecodeSteps | None = None) -> ScheduleOutput:
        """The next step's plan. `decode_steps(chunks)`: asked when the plan is decode-only, the
        steps the runner wants to run back to back; the plan grants what the running set's
        page reservations cover before the next decision (`plan.steps`, at least 1)."""
        out = ScheduleOutput()
        if self._decision_due():
            self._decide(out)
        out.chunks = self._chunks()
        if any(c.sample and c.end - c.start == 1 for c in out.chunks):
            self._steps_left -= 1
        if decode_steps is not None and out.decode_only:
            out.steps = max(1, min(decode_steps(out.chunks), self._steps_covered()))
            self._steps_left -= out.steps - 1
        if self.prefix is not None:
            if out.decided:
                self._shares = self.prefix.shares(self.running, self.device)
            out.shares = self._shares
        return out

    def continue_plan(self, plan: ScheduleOutput,
                      decode_steps: DecodeSteps) -> ScheduleOutput | None:
        """The decode plan that follows `plan` (decode-only, its rows less those finished
        since, `plan.steps` further on), as the next schedule() would make it, for a runner
        that queues it before `plan`'s results are all in; None when schedule() would take a
        decision first or no row is left."""
        chunks = [SeqChunk(c.seq, c.start + plan.steps, c.end + plan.steps, True)
                  for c in plan.chunks if c.seq.state is not SeqState.FINISHED]
        steps = decode_steps(chunks) if chunks else 0
        steps = self.continue_decode(steps) if steps else 0
        return ScheduleOutput(chunks, steps=steps, shares=self._shares) if steps else None

    def update_from_output(self, plan: ScheduleOutput, output: StepOutput) -> None:
        """Take a plan's results: computed tokens, drawn tokens (and logprobs) appended, and
        finished sequences released. A burst reports each step (`output.step`) as it ends;
        prefill chunks that sample nothing count as computed with the plan's first report."""
        if output.step == 0:
            for chunk in plan.chunks:
                if not chunk.sample and chunk.seq.state is SeqState.RUNNING:
                    chunk.seq.num_computed = chunk.end
                    if self.prefix is not None:
                        self.prefix.computed(chunk.seq)
        for result in output.results:
            seq = result.chunk.seq
            if seq.state is SeqState.FINISHED or not result.tokens:
                continue  # a burst's rows drawn after their sequence ended
            seq.num_computed = result.chunk.end + output.step + len(result.tokens) - 1
            seq.token_ids.extend(result.tokens)
            if self.prefix is not None:
                self.prefix.computed(seq)
            if result.logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.extend(result.logprobs)
            if result.finished:
                self.finish(seq)

    def _steps_covered(self) -> int:
        """Decode steps the running set may take from the one just scheduled on, before the
        next decision: their device pages are reserved already."""
        if self._wave and self.waiting:
            return 1  # an admission wave decides again at the next step
        return max(1, self._steps_left + 1)

    def continue_decode(self, steps: int) -> int:
        """Reserve up to `steps` decode steps for the decode set just scheduled (less what has
        finished since), as schedule() would if called now: the steps granted, 0 when
        schedule() would take a decision first."""
        if self._decision_due():
            return 0
        granted = min(steps, self._steps_left)
        self._steps_left -= granted
        return granted

    def _decision_due(self) -> bool:
        if not self.running or self._steps_left <= 0:
            return True
        if self._wave and self.waiting:
            return True
        return len(self.running) * 2 < self._running_at_decision

    def _decide(self, out: ScheduleOutput) -> None:
        full = not self.running or self._steps_left <= 0 or not self._wave
        self.counters.decisions += 1
        out.decided = True
        self._grow_host()
        self._ensure_device_room(out)
        admitted = 0
        if self.waiting and self._host_usage() < self.cfg.host_kv_watermark:
            admitted = self._admit(out, preempt=full)
            self._load_swapped(out)
        else:
            self._load_swapped(out)
            admitted = self._admit(out, preempt=False)
        # A sequence waiting for a prefix being computed is admitted at the next step.
        self._wave = admitted > 0 or self.admission.deferred
        if full or not self._wave:
            self._steps_left = self.window
        self._running_at_decision = len(self.running)

    def _chunks(self) -> list[SeqChunk]:
        budget = self.cfg.max_prefill_tokens
        chunks = []
        for seq in self.running:
            pending = seq.pending_tokens
            if pending == 1:
                chunks.append(SeqChunk(seq, seq.num_computed, seq.num_tokens, True))
                continue
            take = min(pending, budget)
            if take <= 0:
                continue
            budget -= take
            end = seq.num_computed + take
            chunks.append(SeqChunk(seq, seq.num_computed, end, end == seq.num_tokens))
        return chunks

    # -- host tier ----------------------------------------------------------------------
    def _host_usage(self) -> float:
        return 100.0 * self.host.num_used / max(1, self.host.num_pages)

    def _host_target(self, seq: Sequence) -> int:
        return pages_for(seq.tokens_after(self.window))

    def _grow_host(self) -> None:
        """Give each running sequence host room for the next window, evicting if needed."""
        for seq in list(self.running):
            if seq.state is not SeqState.RUNNING:
                continue  # evicted earlier in this loop
            missing = self._host_target(seq) - len(seq.host_pages)
            if missing <= 0:
                continue
            grow = min(max(missing, pages_for(self.chunk.chunk_tokens)),
                       pages_for(seq.budget_tokens) - len(seq.host_pages))
            if not self._free_host(grow, keep=seq):
                continue  # `seq` itself was the victim
            seq.host_pages += self.host.allocate(grow)
            self.counters.chunk_growths += 1

    def _free_host(self, pages: int, keep: Sequence) -> bool:
        """Evict fewest-decoded sequences until `pages` host pages are free. False when `keep`
        had to go itself."""
        if self.host.num_free >= pages:
            return True  # the common case: no need to rank anyone
        for victim in victim_order(self.running + self.swapped):
            if self.host.num_free >= pages:
                return True
            self._evict(victim)
            if victim is keep:
                return False
        return self.host.num_free >= pages

    def _evict(self, seq: Sequence) -> None:
        """Drop a sequence's KV everywhere; it keeps its tokens and is re-prefilled later."""
        self._release(seq)
        (self.running if seq.state is SeqState.RUNNING else self.swapped).remove(seq)
        seq.state = SeqState.WAITING
        seq.num_computed = seq.num_on_host = 0
        seq.evictions += 1
        self.counters.evictions += 1
        self.counters.reprefill_tokens += seq.num_tokens
        self.waiting.appendleft(seq)
        if self.prefix is not None:
            self.prefix.waiting_again(seq)

    def _release(self, seq: Sequence) -> None:
        if self.prefix is not None:
            self.prefix.released(seq, host=True)
            self.backing.let_go(seq.host_pages, self.host.refs, self.prefix.host_cache)
        self.device.free(seq.device_pages)
        self.host.free(seq.host_pages)
        seq.device_pages, seq.host_pages = [], []

    # -- device tier ----------------------------------------------------------------------
    def _ensure_device_room(self, out: ScheduleOutput) -> None:
        """Extend running sequences' device pages for the next window, unloading if short."""
        for seq in list(self.running):
            if seq.state is not SeqState.RUNNING:
                continue
            missing = pages_for(seq.tokens_after(self.window)) - len(seq.device_pages)
            if missing <= 0:
                continue
            grow = min(max(missing, self.cfg.extension_gpu_page_buffer),
                       pages_for(seq.budget_tokens) - len(seq.device_pages))
            if not self._free_device(grow, keep=seq, out=out):
                continue
            seq.device_pages += self.device.allocate(grow)
            self.counters.device_extensions += 1

    def _free_device(self, pages: int, keep: Sequence | None, out: ScheduleOutput,
                     protect: tuple[Sequence, ...] = ()) -> bool:
        if self.device.num_free >= pages:
            return True
        candidates = [s for s in self.running if s not in protect]
        for victim in victim_order(candidates):
            if self.device.num_free >= pages:
                return True
            self._unload(victim, out)
            if victim is keep:
                return False
        return self.device.num_free >= pages

    def _unload(self, seq: Sequence, out: ScheduleOutput) -> None:
        first = seq.num_on_host // PAGE_SIZE
        last = pages_for(seq.num_computed)
        due_device, due_host = self.backing.due(seq.host_pages[:first])
        if due_host:  # a shared prefix's host backing, written now that a holder needs it
            out.swap_out.append(PageCopy(seq.seq_id, due_device, due_host))
        out.swap_out.append(PageCopy(seq.seq_id, seq.device_pages[first:last],
                                     seq.host_pages[first:last]))
        if self.prefix is not None:
            self.prefix.released(seq, host=False)
        self.device.free(seq.device_pages)
        seq.device_pages = []
        seq.num_on_host = seq.num_computed
        if self.prefix is not None:
            self.prefix.on_host(seq)
        seq.state = SeqState.SWAPPED
        self.running.remove(seq)
        self.swapped.append(seq)
        self.counters.unloads += 1

    def _load_swapped(self, out: ScheduleOutput) -> None:
        for seq in list(self.swapped):
            if seq.state is not SeqState.SWAPPED:
                continue  # evicted while making room for an earlier one
            if len(self.running) >= self.cfg.max_decode_batch:
                return
            if self.device.num_free == 0 and self.running:
                return  # nothing can load; skip the per-sequence arithmetic
            need_dev = device_target(seq, self.cfg, self.window,
                                     len(self.waiting) + len(self.swapped))
            need_host = max(0, self._host_target(seq) - len(seq.host_pages))
            if need_host > self.host.num_free and not self.running:
                # Nothing runs: make room even by eviction, or no one would ever progress.
                if not self._free_host(need_host, keep=seq):
                    continue
            count = pages_for(seq.num_computed)
            mapped = (self.prefix.device_hits(seq, seq.num_computed // PAGE_SIZE)
                      if self.prefix is not None else [])
            self.device.share(mapped)
            if need_dev - len(mapped) > self.device.num_free or need_host > self.host.num_free:
                self.device.free(mapped)
                if need_dev - len(mapped) > self.device.num_free:
                    return  # first come, first loaded: later ones wait behind it
                continue
            seq.host_pages += self.host.allocate(need_host)
            seq.device_pages = mapped + self.device.allocate(need_dev - len(mapped))
            seq.device_registered = len(mapped)
            out.swap_in.append(PageCopy(seq.seq_id, seq.host_pages[len(mapped):count],
                                        seq.device_pages[len(mapped):count]))
            self.swapped.remove(seq)
            self.running.append(seq)
            seq.state = SeqState.RUNNING
            self.counters.loads += 1

    # -- admission (admission.py) ---------------------------------------------------------
    def _admit(self, out: ScheduleOutput, preempt: bool) -> int:
        """Admit waiting sequences (`Admission.admit`); those admitted leave the queue."""
        admitted = self.admission.admit(self.waiting, out, preempt, self.counters,
                                        self.chunk.chunk_tokens)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s.state is SeqState.WAITING)
        return len(admitted)

    # -- checks ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise unless every page's references match its holders (prefix_cache.py / pages.py)
        and every sequence's pages cover its computed tokens."""
        self.device.check([s.device_pages for s in self.running])
        self.host.check([s.host_pages for s in self.running + self.swapped])
        problems = self.backing.problems(self.device.refs, self.host.refs)
        assert not problems, problems
        for seq in self.running:
            assert seq.state is SeqState.RUNNING
            assert len(seq.device_pages) >= pages_for(seq.num_computed), seq
            assert len(seq.host_pages) >= pages_for(seq.num_computed), seq
        for seq in self.swapped:
            assert seq.state is SeqState.SWAPPED and not seq.device_pages
            assert seq.num_on_host == seq.num_computed
        for seq in self.waiting:
            assert seq.state is SeqState.WAITING and not seq.host_pages and not seq.device_pages
        if self.prefix is not None:
            problems = self.prefix.open_pages.problems()
            assert not problems, problems
