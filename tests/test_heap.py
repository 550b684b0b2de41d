"""frozen_heap: startup objects leave the collector's view, later cycles are still freed."""

import gc
import weakref

from batchgen.engine.heap import frozen_heap


class Node:
    pass


def test_frozen_heap_still_collects_new_cycles():
    startup = Node()
    startup.self = startup  # a cycle made before the freeze
    startup_ref = weakref.ref(startup)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del startup
        gc.collect()
        assert startup_ref() is not None, "a frozen cycle is exempt from collection"
        later = Node()
        later.self = later
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None, "a cycle made after the freeze is collected"
    gc.collect()
    assert startup_ref() is None


def test_frozen_heap_thaws_on_the_way_out_even_on_errors():
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("a failed run")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_bench_freezes_the_timed_run_only(monkeypatch):
    """The timed run sees a frozen heap; once the engine is closed it is thawed, so the next
    half of a comparison (or the HF peer) gets the closed engine's pools back from a
    collection."""
    import batchgen.bench as bench_module
    from batchgen.bench import BenchConfig, Workload, bench

    frozen_during: list[int] = []
    timed_run = bench_module._timed_run

    def spy(*args, **kwargs):
        frozen_during.append(gc.get_freeze_count())
        return timed_run(*args, **kwargs)

    monkeypatch.setattr(bench_module, "_timed_run", spy)
    cfg = BenchConfig(shape="smollm2-135m", tiny=True, device="cpu", gpu_kv_cache_size=0.02,
                      host_kv_cache_size=0.05, compare_host_tier=True)
    bench(cfg, Workload(requests=3, input_len=16, output_len=3))
    assert len(frozen_during) == 2 and min(frozen_during) > 0
    assert gc.get_freeze_count() == 0
