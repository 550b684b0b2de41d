"""Triton kernel variants compiled in parallel worker processes before the first forwards need them.

Triton compiles a kernel variant (one specialisation of a kernel's arguments: dtypes, constexprs,
which ints are 1 or multiples of 16) the first time a process launches it: ~0.5-1 s each on a
machine whose Triton cache is empty, one after another. A model's CUDA-graph capture and first
prefill steps meet 10-20 variants, so a fresh machine (a new spot node, a Slurm job on a new host)
would pay ~10 s of serial compiling at every start. Threads do not help: the compiler holds the
GIL.

`precompile(forwards)` runs the given forwards once with Triton's cache hook set to note every
variant not compiled yet and skip it (the kernel is neither compiled nor launched: that pass's
outputs are garbage and nobody reads them), then compiles the noted variants in worker processes
(`CompileWorkers`: forks of the job's process, one per core up to 16) into Triton's disk cache,
for the device's target. The real forwards then load each variant from the cache in
milliseconds. `precompile_ahead` does the same on a stand-in of the model before the real weights
load, so the compile overlaps the load (engine/runner.py `precompile_stand_in`).

Nothing depends on it for correctness: a variant the pass does not meet, or that a worker fails
to compile, compiles in-process on first launch (Triton's own path). It needs Triton's runtime
hooks (`triton.knobs`, 3.4+) and a CUDA device; elsewhere it does nothing.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import time
import warnings
from contextlib import contextmanager
from typing import Callable

log = logging.getLogger("batchgen.precompile")

MAX_WORKERS = 16
"""Worker processes at most (a fork shares the job's memory until it writes; a spawned one
imports torch and Triton: ~0.3 GB of host memory)."""

TIMEOUT_S = 60.0
"""Seconds the workers may take in all; after that the rest compiles in-process."""


@contextmanager
def triton_cache_hook(make_hook: Callable):
    """Inside the block, `make_hook(previous)` is Triton's `jit_cache_hook` (called before a
    variant is compiled; True skips it), the previous hook restored after. Yields False where
    Triton has no runtime hooks (triton.knobs, 3.4+), else True."""
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield False
        return
    runtime.jit_cache_hook = make_hook(previous)
    try:
        yield True
    finally:
        runtime.jit_cache_hook = previous


@contextmanager
def noted_variants():
    """Inside the block, a Triton launch of a variant not compiled in this process is noted and
    skipped (neither compiled nor run). Yields the list of notes `(module, qualname,
    specialization)`; yields None where Triton has no runtime hooks."""
    notes: list[tuple[str, str, str]] = []
    seen: set[str] = set()

    def note(*, fn, compile, **_) -> bool:
        spec = compile["specialization_data"]
        if spec not in seen:
            seen.add(spec)
            notes.append((fn.module, fn.name, spec))
        return True  # skip: the workers compile it

    with triton_cache_hook(lambda _previous: note) as hooked:
        yield notes if hooked else None


def precompile(forwards: Callable[[], None], device, workers: CompileWorkers | None = None) -> int:
    """Run `forwards` with every new Triton variant noted and skipped, then compile the noted
    variants in worker processes (`workers`, started earlier, or new ones; closed after).
    Returns how many the workers compiled (0 where nothing was done: not CUDA, no hooks,
    nothing new, or the pass failed). Workers already given their work (`precompile_ahead`)
    are only waited for."""
    try:
        if workers is not None and workers.submitted:
            return _waited(workers, 0.0)
        start = time.perf_counter()
        notes = note_variants(forwards, device)
        if not notes:
            return 0
        # Spawned, not forked: this process has run CUDA and perhaps the compiler by now.
        workers = workers or CompileWorkers(len(notes), fork=False)
        workers.submit(notes, _current_target())
        return _waited(workers, time.perf_counter() - start)
    finally:
        if workers is not None:
            workers.close()


def precompile_ahead(forwards: Callable[[], None], device, workers: CompileWorkers) -> int:
    """As `precompile`, but hand the noted variants to `workers` without waiting: the caller
    runs `forwards` on a stand-in of its model (the same layer shapes) and loads the real one
    while they compile; `precompile` waits for them later. Returns how many were handed over."""
    start = time.perf_counter()
    notes = note_variants(forwards, device)
    if not notes:
        return 0
    workers.submit(notes, _current_target())
    log.debug("the precompile pass noted %d Triton kernel variants ahead of the weights in "
              "%.1f s", len(notes), time.perf_counter() - start)
    return len(notes)


def note_variants(forwards: Callable[[], None], device) -> list[tuple[str, str, str]]:
    """The Triton variants new to this process that `forwards` launch (run once with each
    noted and skipped: their outputs are garbage), workers' importable ones only. Empty where
    nothing can be noted: not CUDA, the Triton interpreter, or no runtime hooks."""
    if getattr(device, "type", device) != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return []
    with noted_variants() as notes:
        if notes is None:
            return []
        try:
            forwards()
        except Exception as err:  # the real forwards compile what this pass missed
            log.debug("precompile pass stopped early: %s", err)
    return [n for n in notes if "<locals>" not in n[1]]  # workers import top-level ones


def _current_target() -> tuple:
    import triton

    target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _waited(workers: CompileWorkers, pass_s: float) -> int:
    start = time.perf_counter()
    compiled = workers.wait()
    log.info("compiled %d of %d Triton kernel variants in %d worker processes (waited %.1f s; "
             "the pass noting them %.1f s)", compiled, workers.submitted[0], len(workers.procs),
             time.perf_counter() - start, pass_s)
    return compiled


class CompileWorkers:
    """Processes that compile Triton variants. Where the platform forks (Linux), each is a fork
    of the job's process taken before it touches the GPU, so Triton and the kernels are
    imported already (spawned processes spent 4-6 s importing torch side by side, longer than
    the compile); elsewhere, or with `fork=False`, they are spawned and import them first.
    Given the device (its target is sent once the processes exist), each compiles a one-line
    kernel at once (a process's first compile loads the compiler's backends), then waits for
    its share of the variants. They run at a lower CPU priority than the job."""

    def __init__(self, count: int | None = None, device=None, fork: bool | None = None):
        """`count` workers (default: one per core this rank has, at most MAX_WORKERS);
        `device`: the CUDA device whose target the warm-up compile is for (None: no warm-up);
        `fork`: fork (default where available) or spawn them."""
        count = max(1, min(count or MAX_WORKERS, MAX_WORKERS, _cores_per_rank()))
        methods = multiprocessing.get_all_start_methods()
        use_fork = ("fork" in methods) if fork is None else (fork and "fork" in methods)
        context = multiprocessing.get_context("fork" if use_fork else "spawn")
        if use_fork:
            import triton  # noqa: F401  (in the forks before they start)

            import batchgen_kernels  # noqa: F401
        self.procs: list[tuple] = []
        with warnings.catch_warnings():  # "multi-threaded, use of fork() may deadlock": the
            warnings.simplefilter("ignore", DeprecationWarning)  # forks run no thread's code
            for _ in range(count):
                mine, theirs = context.Pipe()
                proc = context.Process(target=_serve, args=(theirs,), daemon=True,
                                       name="batchgen-precompile")
                proc.start()
                theirs.close()
                self.procs.append((proc, mine))
        target = device_target(device)
        if target:
            self._send({"warm": list(target)})
        self.submitted: tuple[int, float] | None = None
        """(variants, when) once `submit` gave the workers their work."""

    def compile(self, notes: list[tuple[str, str, str]], target: tuple) -> int:
        """Compile `notes` into Triton's disk cache for `target` (backend, arch, warp size),
        shared out among the workers. Returns how many compiled; a worker that fails or runs
        past TIMEOUT_S costs only its share."""
        self.submit(notes, target)
        return self.wait()

    def submit(self, notes: list[tuple[str, str, str]], target: tuple) -> None:
        """Give the workers `notes` to compile (shared out) and return at once; `wait` for
        them."""
        count = len(self.procs)
        self._send([{"target": list(target), "variants": notes[i::count]}
                    for i in range(count)])
        self.submitted = (len(notes), time.time())

    def wait(self) -> int:
        """How many of the submitted variants compiled, once every worker is done (or past
        TIMEOUT_S)."""
        return _collect(self.procs, self.submitted[1]) if self.submitted else 0

    def close(self) -> None:
        """Stop the workers not done (they were never given work, or ran too long)."""
        for proc, conn in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
            conn.close()

    def _send(self, messages) -> None:
        """One message to every worker (a list: one each)."""
        for i, (_, conn) in enumerate(self.procs):
            try:
                conn.send(messages[i] if isinstance(messages, list) else messages)
            except (OSError, ValueError):  # it died already: _collect reports it
                pass


def compile_in_workers(notes: list[tuple[str, str, str]], target: tuple,
                       workers: int | None = None, fork: bool | None = None) -> int:
    """Compile `notes` in up to `workers` new processes (see CompileWorkers.compile)."""
    pool = CompileWorkers(min(workers or MAX_WORKERS, len(notes)), fork=fork)
    try:
        return pool.compile(notes, target)
    finally:
        pool.close()


def device_target(device) -> tuple | None:
    """(backend, arch, warp size) Triton compiles for on a CUDA `device` (as
    `triton.runtime.driver.active.get_current_target()` states it there); None elsewhere."""
    import torch

    if getattr(device, "type", device) != "cuda" or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return ("cuda", major * 10 + minor, 32)


def _cores_per_rank() -> int:
    """The cores this process may use (its CPU affinity: a Slurm allocation's, not the whole
    node's), shared among the node's ranks (LOCAL_WORLD_SIZE)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def _collect(procs: list, sent_at: float) -> int:
    """Wait for the workers (TIMEOUT_S in all) and add up what they compiled. `sent_at`: when
    they were given their work (time.time())."""
    deadline = time.monotonic() + TIMEOUT_S
    compiled = 0
    for proc, conn in procs:
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                proc.kill()
                log.debug("a precompile worker ran past %.0f s and was stopped", TIMEOUT_S)
                continue
            report = conn.recv()
        except (EOFError, OSError):
            proc.join(1.0)
            log.debug("a precompile worker failed (exit %s)", proc.exitcode)
            continue
        compiled += report["compiled"]
        log.debug("a precompile worker compiled %d variants in %.1f s (warm-up %.1f s, ready "
                  "%+.1f s after its work was sent)", report["compiled"],
                  report.get("seconds", 0.0), report.get("warm_up", 0.0),
                  report.get("ready_at", sent_at) - sent_at)
        for failure in report["failed"]:
            log.debug("precompile of %s failed: %s", *failure)
    return compiled


def compile_variant(module: str, qualname: str, spec: str, target: tuple) -> None:
    """Compile one noted variant for `target` (backend, arch, warp size) as the launching
    process would (same source, specialisation and options: the same disk-cache key)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    data = json.loads(spec)

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    def as_tuple(value):
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    constexprs = {tuple(k): constant(v)
                  for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: as_tuple(v) for k, v in data["signature"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    source = ASTSource(fn, signature, constexprs, attrs)
    triton.compile(source, target=gpu, options=options.__dict__)


def _warm_up(target: tuple) -> None:
    """Compile a one-line kernel for `target`: a process's first compile loads the compiler's
    backends and passes, which the noted variants then need not wait for."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(ptr):
        tl.store(ptr, tl.load(ptr) + 1)

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(_touch, {"ptr": "*fp32"}, {}, {})
    triton.compile(source, target=GPUTarget(*target))


def _serve(conn) -> None:
    """A worker: lower its CPU priority, import Triton and the kernels (a fork has them),
    warm the compiler up when told the target ({"warm": target}), then take its share
    ({"target", "variants"}), compile each variant and send back {"compiled": n, "failed":
    [[name, error], ...], "warm_up", "ready_at", "seconds"}."""
    try:
        os.nice(10)  # the job's own start-up (weights, capture) comes first
    except OSError:
        pass
    import triton  # noqa: F401

    import batchgen_kernels  # noqa: F401

    try:
        job, warmed, ready = conn.recv(), 0.0, time.time()
        if "warm" in job:
            start = time.perf_counter()
            try:
                _warm_up(tuple(job["warm"]))
            except Exception:  # only a head start: the variants compile without it
                pass
            warmed, ready = time.perf_counter() - start, time.time()
            job = conn.recv()
    except (EOFError, OSError):  # the job's process ended (or closed us) before the work
        return
    start = time.perf_counter()
    target = tuple(job.get("target", ()))
    compiled, failed = 0, []
    for module, qualname, spec in job.get("variants", []):
        try:
            compile_variant(module, qualname, spec, target)
            compiled += 1
        except Exception as err:  # reported; the launching process compiles it itself
            failed.append([f"{module}.{qualname}", f"{type(err).__name__}: {err}"[:500]])
    conn.send({"compiled": compiled, "failed": failed, "warm_up": round(warmed, 3),
               "ready_at": ready, "seconds": round(time.perf_counter() - start, 3)})
