"""Engine: add requests, `step()` until done. step() = schedule -> run -> postprocess; a decode
burst postprocesses each step's tokens while its later steps still run on the device, and
queues the burst that follows before its last step ends (the next step() collects it)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager, Iterable

import torch

from batchgen.config import EAGER_DECODE_BATCH, EngineConfig
from batchgen.core import ChoiceProgress, Completion, FinishedRequest, FinishReason, Request
from batchgen.engine.burst import QueuedBurst
from batchgen.engine.graphs import graph_limit
from batchgen.engine.kv_cache import KVLayout
from batchgen.engine.memory import PoolSizes, detect_gpu_arch, plan_pools
from batchgen.engine.precompile import CompileWorkers
from batchgen.engine.penalties import Penalties
from batchgen.engine.replicas import ReplicaCheck
from batchgen.engine.resume import progress_of, restore
from batchgen.engine.runner import ModelRunner
from batchgen.engine.sampler import SamplingRows
from batchgen.engine.stops import StopChecker, StopMatch
from batchgen.parallel import TensorParallel
from batchgen.sched.scheduler import Scheduler
from batchgen.sched.sequence import Sequence, SeqState
from batchgen.sched.step import ScheduleOutput, SeqChunk, SeqResult, StepOutput

log = logging.getLogger("batchgen.engine")

BURST_SHARE_OF_LENGTH = 16
"""A burst is at most 1/16 of the mean decode length of the sequences finished so far: one
that stops inside a burst computes half a burst for nothing on average, so at most ~3% of its
steps are wasted (short answers get short bursts)."""


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice: choice 0 draws with the request's seed itself, the
    others with a hash of it, so that n choices of seed s never repeat the answers of seeds
    s+1, s+2, ... (a seed sweep with n > 1 would share most of its samples)."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


StepObserver = Callable[[str, int], ContextManager]
"""Called by the engine around each piece of device work: `observer(kind, steps)` returns a
context manager entered while the work runs. `kind`: "step" (one forward with prefill chunks,
or only page copies), "decode" (one decode-only forward), "queue" (queueing a burst of `steps`
decode steps) or "collect" (reading a queued burst's samples). A burst queued while another is
collected nests inside that collect."""


@dataclass
class StepTimes:
    """Wall seconds by phase of step(). The forward ends with reading the samples back, so
    `forward_*` is device time plus whatever host work the device waited for, less the
    postprocessing a burst overlaps with its own later steps (counted in `postprocess_s`)."""

    schedule_s: float = 0.0
    forward_decode_s: float = 0.0
    """Decode-only steps and bursts."""
    forward_other_s: float = 0.0
    """Steps with prefill chunks (or only page copies)."""
    postprocess_s: float = 0.0
    """Host work on the samples (stop checks, appends) and, in bursts, queueing the burst
    that follows: a burst overlaps both with its own later steps."""
    decode_steps: int = 0
    bursts: int = 0
    """Decode calls that ran more than one step back to back."""
    burst_steps: int = 0
    """Forwards those bursts ran."""


def host_threads(device: torch.device, current: int) -> int:
    """Intra-op threads for the host's torch work once the engine runs on `device`. On an
    accelerator that work is each step's metadata (page tables, positions: a few thousand
    elements), where every op on many threads pays a fork/join (5-8 ms per op on a loaded
    2-core host against 0.05 ms on one thread; a step's batch build took 4.8 ms against 2.3 on
    an H100 host) and the ranks of a node oversubscribe its cores: one thread. On the CPU the
    model itself runs on them: unchanged."""
    return current if device.type == "cpu" else 1


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, tokenizer=None,
                 eos_token_ids: Iterable[int] = (), skip_special_tokens: bool = True,
                 tp: TensorParallel = TensorParallel(), host_share: float = 1.0,
                 demand_tokens: int | None = None, job_sequences: int | None = None,
                 compile_workers: CompileWorkers | None = None):
        """`tp`: the model's tensor-parallel group (its ranks agree on pool sizes and may check
        that their decisions agree); `host_share`: this worker's share of the node's host KV
        budget (1 / workers per node); `demand_tokens`: the most KV tokens the job can hold
        at once, which bounds the pools left to their default size (memory.plan_pools);
        `job_sequences`: the most sequences the job can decode at once (its remaining requests
        times their n), which with --max-decode-batch bounds the CUDA graphs captured;
        `compile_workers`: Triton compile processes started before the model loaded
        (engine/precompile.py), given to start-up's precompile."""
        self.config = config
        if config.scheduler.enable_host_kv_eviction:
            log.warning("--enable-host-kv-eviction is deprecated and ignored: "
                        "eviction is always on")
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.gpu_arch = detect_gpu_arch(config.memory.gpu_arch, self.device)
        self.layout = KVLayout.of_model(model, config.model.kv_dtype)
        model_bytes = sum(t.numel() * t.element_size()
                          for t in (*model.parameters(), *model.buffers()))
        sizes = plan_pools(config.memory, self.layout, model_bytes, self.device, host_share,
                           demand_tokens)
        # Free memory differs a little between devices; the replicas' schedulers must not.
        sizes = PoolSizes(*tp.agree_min([sizes.device_pages, sizes.host_pages]))
        self.replicas = ReplicaCheck.from_env(tp)
        self.runner = ModelRunner(model, self.layout, sizes.device_pages, sizes.host_pages,
                                  self.device, config.memory.fast_init,
                                  config.memory.enable_hugetlbfs, config.runtime,
                                  graph_limit(job_sequences, config.scheduler.max_decode_batch),
                                  compile_workers)
        torch.set_num_threads(host_threads(self.device, torch.get_num_threads()))
        # An unset --max-decode-batch follows the largest graph-captured batch; ranks whose
        # captures differ (one failed) must still decode the same batches.
        graphs = self.runner.graphs
        decode_batch = tp.agree_min([graphs.sizes[-1] if graphs is not None
                                     else EAGER_DECODE_BATCH])[0]
        self.scheduler = Scheduler(config.scheduler.with_decode_batch(decode_batch),
                                   sizes.device_pages, sizes.host_pages,
                                   prefix_salt=self._prefix_salt(model))
        reachable = graph_limit(job_sequences, self.scheduler.cfg.max_decode_batch)
        if graphs is not None and reachable > graphs.sizes[-1]:  # not cut to the job's size
            log.warning("--max-decode-batch %d is above the largest CUDA graph (%d): bigger "
                        "decode batches run eagerly; raise --cuda-graph-max-bucket-size",
                        self.scheduler.cfg.max_decode_batch, graphs.sizes[-1])
        self.eos_ids = frozenset(eos_token_ids)
        self.stops = StopChecker(tokenizer, skip_special_tokens)
        self._next_seq = 0
        self._groups: dict[str, tuple[Request, list[Sequence]]] = {}
        self._done: dict[str, list[Completion]] = {}
        self._observers: list[StepObserver] = []
        self.steps = 0
        self.generated_tokens = 0
        self.times = StepTimes()
        self._queued: QueuedBurst | None = None
        """A burst queued by the last step() (it continues that step's burst), not collected."""

    # -- public API ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Its answer is bounded by the model's context: max_tokens shrinks to
        the positions left after the prompt (as the job runner's intake does), and a prompt
        that leaves none is refused."""
        room = self.model.max_context - len(request.prompt_token_ids)
        if room < 1:
            raise ValueError(f"request {request.request_id!r}: the prompt is "
                             f"{len(request.prompt_token_ids)} tokens but the model context is "
                             f"{self.model.max_context} (at least one token must be left to "
                             "generate)")
        params = request.sampling.fit_context(room)  # SamplingParams are valid once made
        if request.request_id in self._groups:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        base_seed = (params.seed if params.seed is not None
                     else self._derived_seed(request.request_id))
        seqs = [Sequence(self._next_seq + i, request.request_id, i, list(request.prompt_token_ids),
                         len(request.prompt_token_ids), params, choice_seed(base_seed, i),
                         matcher=request.grammar.matcher() if request.grammar else None)
                for i in range(params.n)]
        finished = restore(seqs, request)  # a request continued from a checkpoint
        for seq in seqs:
            if seq.state is not SeqState.FINISHED:
                self.scheduler.add(seq)  # raises RequestTooLarge before anything is queued twice
        self._next_seq += params.n
        self._groups[request.request_id] = (request, seqs)
        self._done[request.request_id] = finished

    def inflight_state(self) -> dict[str, list[ChoiceProgress]]:
        """Each unfinished request's progress per choice, as the host holds it (a burst still
        on the device is not in it): what `Request.resume` takes to continue it exactly."""
        return {rid: progress_of(seqs, self._done[rid])
                for rid, (_, seqs) in self._groups.items()}

    def settle(self) -> list[FinishedRequest]:
        """Collect the burst the last step() queued, queueing nothing after it (a stop: its
        tokens reach the host, and so a checkpoint, instead of being drawn again); the
        requests that finished."""
        if self._queued is None:
            return []
        burst, self._queued = self._queued, None
        plan = ScheduleOutput(burst.chunks, steps=burst.steps)
        finished: list[FinishedRequest] = []
        start = time.perf_counter()
        with self._observed("collect", burst.steps):
            self.runner.collect(burst, lambda step, result: finished.extend(
                self._accept_step(plan, burst.chunks, step, result)))
        self.steps += burst.steps
        self._time(True, burst.steps, 0.0, time.perf_counter() - start, 0.0)
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._queued is not None

    def add_step_observer(self, observer: StepObserver) -> None:
        """Have `observer` wrap each piece of device work from now on (see StepObserver)."""
        self._observers.append(observer)

    @property
    def num_requests(self) -> int:
        """Requests added and not yet returned by step() or settle()."""
        return len(self._groups)

    def step(self) -> list[FinishedRequest]:
        """Run what the scheduler decides (a decode-only decision as a burst), or collect the
        burst the previous step queued; the requests that finished."""
        if self._queued is not None:
            burst, self._queued = self._queued, None
            return self._collect(burst, 0.0)
        begin = time.perf_counter()
        out = self.scheduler.schedule(self._decode_steps)
        if self.replicas is not None:
            self.replicas.observe(self.steps, out)
        if not (out.decode_only and self._bursts_allowed(out.chunks)):
            return self._single_step(out, begin)
        rows = self._sampling_rows(out.chunks, out.steps)
        scheduled = time.perf_counter()  # copies and queueing are the forward's (on CPU, all of it)
        self.runner.move_pages(out)
        with self._observed("queue", out.steps):
            burst = self.runner.queue_burst(out.chunks, rows, shares=out.shares)
        return self._collect(burst, scheduled - begin, time.perf_counter() - scheduled)

    def generate(self, requests: Iterable[Request]) -> list[FinishedRequest]:
        """Run requests to completion; results in the order given."""
        order = []
        for request in requests:
            self.add_request(request)
            order.append(request.request_id)
        finished = {}
        while self.has_unfinished():
            for done in self.step():
                finished[done.request_id] = done
        return [finished[rid] for rid in order]

    def reset_stats(self) -> None:
        """Start the counters over (a benchmark's warm-up is not part of its measurement)."""
        self.steps = self.generated_tokens = 0
        self.times = StepTimes()
        self.scheduler.reset_counters()

    def stats(self) -> dict:
        counters = self.scheduler.counters
        return {"steps": self.steps, "generated_tokens": self.generated_tokens,
                "prefix_hit_rate": (counters.cached_prompt_tokens
                                    / max(1, counters.prompt_tokens)),
                "times": asdict(self.times),
                "peak_device_pages": self.scheduler.device.peak_used,
                "peak_host_pages": self.scheduler.host.peak_used,
                "device_pages": self.scheduler.device.num_pages,
                "host_pages": self.scheduler.host.num_pages,
                "adaptive_chunk_history": list(self.scheduler.chunk.history),
                **asdict(self.scheduler.counters)}

    def close(self) -> None:
        self.runner.close()

    # -- internals ----------------------------------------------------------------------
    def _prefix_salt(self, model: torch.nn.Module) -> str:
        """What besides the tokens makes KV pages differ: the model and the KV storage."""
        cfg = model.config
        return (f"{type(model).__name__}:{getattr(cfg, 'model_type', '')}:"
                f"{cfg.num_hidden_layers}:{getattr(cfg, 'hidden_size', '')}:"
                f"{self.layout.token_shape}:{self.layout.dtype}")

    def _derived_seed(self, request_id: str) -> int:
        digest = hashlib.blake2b(f"{self.config.runtime.seed}:{request_id}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") % 2**63

    def _observed(self, kind: str, steps: int) -> ContextManager:
        """The step observers' context around one piece of device work."""
        if not self._observers:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for observer in self._observers:
            stack.enter_context(observer(kind, steps))
        return stack

    def _single_step(self, out: ScheduleOutput, begin: float) -> list[FinishedRequest]:
        """One forward of any batch (prefill chunks, decode, both, or only page copies)."""
        sampling = [c for c in out.chunks if c.sample]
        rows = self._sampling_rows(sampling, 1)[0]
        scheduled = time.perf_counter()
        finished: list[FinishedRequest] = []
        accepted_at = None  # when the samples reached the host

        def accept(step: int, result) -> None:
            nonlocal accepted_at
            accepted_at = time.perf_counter()
            finished.extend(self._accept_step(out, sampling, step, result))

        with self._observed("decode" if out.decode_only else "step", 1):
            self.runner.execute(out, rows, self._grammar_masks(out), accept,
                                self.scheduler.prepare)
        ran = time.perf_counter()
        if accepted_at is None:  # nothing sampled: only the prefill chunks' progress
            accepted_at = ran
            self.scheduler.update_from_output(out, StepOutput())
        self.steps += 1
        self._time(out.decode_only, 1, scheduled - begin, accepted_at - scheduled,
                   time.perf_counter() - accepted_at)
        return finished

    def _collect(self, burst: QueuedBurst, schedule_s: float,
                 queued_s: float = 0.0) -> list[FinishedRequest]:
        """Read a queued burst's samples step by step; queue its continuation meanwhile.
        `queued_s`: time spent queueing the burst, booked as forward time."""
        finished: list[FinishedRequest] = []
        host_s = 0.0  # host work the device overlaps: postprocessing, queueing what follows

        plan = ScheduleOutput(burst.chunks, steps=burst.steps)

        def accept(step: int, result) -> None:
            nonlocal host_s
            start = time.perf_counter()
            finished.extend(self._accept_step(plan, burst.chunks, step, result))
            host_s += time.perf_counter() - start

        def queue_continuation() -> None:
            nonlocal host_s
            start = time.perf_counter()
            self._queued = self._continuation(plan, burst)
            host_s += time.perf_counter() - start

        start = time.perf_counter()
        with self._observed("collect", burst.steps):
            self.runner.collect(burst, accept, queue_continuation)
        self.steps += burst.steps
        forward_s = time.perf_counter() - start - host_s + queued_s
        self._time(True, burst.steps, schedule_s, forward_s, host_s)
        return finished

    def _continuation(self, plan: ScheduleOutput, burst: QueuedBurst) -> QueuedBurst | None:
        """The burst the next step() would schedule, queued while `burst`'s last step still
        runs, so the device goes straight on while the host returns, writes results and comes
        back: `burst`'s rows less the finished ones, one burst further on. None when the
        scheduler would decide something first (then the next step() schedules)."""
        nxt = self.scheduler.continue_plan(plan, self._burst_steps)
        if nxt is None:
            return None
        if self.replicas is not None:
            self.replicas.observe(self.steps + burst.steps, ScheduleOutput(nxt.chunks))
        carried = burst.rows[0].penalties  # counts on the device: the host lags a burst behind
        penalties = (carried.continued(burst.rows_of(nxt.chunks)) if carried is not None
                     else None)
        with self._observed("queue", nxt.steps):
            return self.runner.queue_burst(
                nxt.chunks, self._sampling_rows(nxt.chunks, nxt.steps, penalties), after=burst,
                shares=nxt.shares)

    def _grammar_masks(self, out: ScheduleOutput):
        """A logits processor masking grammar-forbidden tokens, or None when no row has one."""
        matchers = [c.seq.matcher for c in out.chunks if c.sample]
        if not any(m is not None for m in matchers):
            return None
        from batchgen.engine.structured import apply_masks

        return lambda logits: apply_masks(logits, matchers)

    def _time(self, decode: bool, steps: int, schedule_s: float, forward_s: float,
              postprocess_s: float) -> None:
        times = self.times
        times.schedule_s += schedule_s
        times.postprocess_s += postprocess_s
        if decode:
            times.forward_decode_s += forward_s
            times.decode_steps += steps
        else:
            times.forward_other_s += forward_s
        if steps > 1:
            times.bursts += 1
            times.burst_steps += steps

    def _decode_steps(self, chunks: list[SeqChunk]) -> int:
        """Steps a decode-only plan asks for: a burst where bursts are allowed, else one."""
        return self._burst_steps(chunks) if self._bursts_allowed(chunks) else 1

    def _bursts_allowed(self, chunks: list[SeqChunk]) -> bool:
        """Decode runs in bursts unless they are off or a row needs the host between tokens
        (a grammar)."""
        return (self.config.runtime.decode_burst_steps > 1
                and all(c.seq.matcher is None for c in chunks))

    def _burst_steps(self, chunks: list[SeqChunk]) -> int:
        """How many steps the decode chunks run back to back: at most --decode-burst-steps and
        1/BURST_SHARE_OF_LENGTH of finished sequences' mean length, at least 1 while a row has
        tokens left to draw (0 when none has). The scheduler bounds it further by the steps its
        page reservations cover."""
        limit = self.config.runtime.decode_burst_steps
        typical = self.scheduler.chunk.ema  # mean decode length of finished sequences
        if typical is not None:
            limit = min(limit, int(typical) // BURST_SHARE_OF_LENGTH)
        longest = max(c.seq.sampling.max_tokens - (c.end - c.seq.prompt_len) for c in chunks)
        return max(0, min(max(1, limit), longest))

    def _sampling_rows(self, chunks: list[SeqChunk], steps: int,
                       penalties: Penalties | None = None) -> list[SamplingRows]:
        """The rows sampled by `chunks` as they stand at each of `steps` steps of a burst.
        `penalties`: carried from the burst this one continues; else counted from the tokens
        the host holds."""
        seqs = [c.seq for c in chunks]
        if penalties is None:
            penalties = Penalties.of(seqs)
        params = [s.sampling for s in seqs]
        seeds = [s.seed for s in seqs]
        decoded = [c.end - c.seq.prompt_len for c in chunks]  # tokens drawn before this one
        # EOS and stop ids are banned for a row's first min_tokens tokens, unless a grammar
        # decides when EOS is allowed (banning it too could leave no token at all).
        bans = [((() if p.ignore_eos else tuple(self.eos_ids)) + p.stop_token_ids,
                 p.min_tokens - n) if n < p.min_tokens and s.matcher is None else None
                for s, p, n in zip(seqs, params, decoded)]
        any_bans, unbanned = any(bans), [()] * len(seqs)
        rows = []
        for ahead in range(steps):
            banned = unbanned
            if any_bans:
                banned = [() if b is None or ahead >= b[1] else b[0] for b in bans]
            rows.append(SamplingRows(params, seeds, [n + ahead for n in decoded], banned,
                                     penalties))
        return rows

    def _accept_step(self, plan: ScheduleOutput, sampling: list[SeqChunk], step: int,
                     result) -> list[FinishedRequest]:
        """Take one step's samples for the sampled chunks of `plan` (through the scheduler);
        the requests this finishes. Tokens a burst drew for a sequence after it finished are
        dropped."""
        results, reasons = [], []
        for chunk, token, logprob in zip(sampling, result.token_ids, result.logprobs):
            seq = chunk.seq
            if seq.state is SeqState.FINISHED:
                continue
            if seq.matcher is not None:
                seq.matcher.accept(token)
            reason = self._finish_reason(seq, token)
            results.append(SeqResult(chunk, [token], None if logprob is None else [logprob],
                                     reason is not None))
            reasons.append(reason)
        self.scheduler.update_from_output(plan, StepOutput(results, step))
        self.generated_tokens += len(results)
        finished = []
        for res, reason in zip(results, reasons):
            if reason is not None:
                done = self._complete(res.chunk.seq, *reason)
                if done is not None:
                    finished.append(done)
        return finished

    def _finish_reason(self, seq: Sequence, token: int):
        """Why drawing `token` (not yet appended) ends `seq`, or None."""
        params = seq.sampling
        decoded = seq.num_decoded + 1
        if seq.matcher is not None and seq.matcher.is_terminated():
            return FinishReason.STOP, None
        if decoded >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
            if token in self.eos_ids and not params.ignore_eos:
                return FinishReason.STOP, None
            if params.stop:
                matched = self.stops.match(seq, token)
                if matched is not None:
                    return FinishReason.STOP, matched
        if decoded >= params.max_tokens:
            return FinishReason.LENGTH, None
        return None

    def _complete(self, seq: Sequence, reason: FinishReason, stop) -> FinishedRequest | None:
        """Record a finished sequence's completion (the scheduler has released it); the
        finished request once this was its last choice."""
        tokens = seq.token_ids[seq.prompt_len:]
        matched = stop if isinstance(stop, StopMatch) else None
        last = seq.token_ids[-1]
        ended_by_token = (reason is FinishReason.STOP and matched is None
                          and (last in self.eos_ids or last in seq.sampling.stop_token_ids))
        text = self.stops.final_text(seq, matched, ended_by_token)
        self._done[seq.request_id].append(Completion(
            seq.choice, tokens, reason, text, seq.logprobs,
            matched.stop if matched is not None else stop))
        request, group = self._groups[seq.request_id]
        if len(self._done[seq.request_id]) < len(group):
            return None
        del self._groups[seq.request_id]
        completions = sorted(self._done.pop(seq.request_id), key=lambda c: c.index)
        # Choices restored finished from a checkpoint were not admitted this run.
        cached = min((s.cached_tokens for s in group if s.cached_tokens is not None), default=0)
        return FinishedRequest(seq.request_id, seq.prompt_len, completions, request=request,
                               cached_tokens=cached)
