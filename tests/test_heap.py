"""freeze_startup_heap: startup objects leave the collector's view, later cycles are still freed."""

import gc
import weakref

from batchgen.engine.heap import freeze_startup_heap


class Node:
    pass


def test_frozen_heap_still_collects_new_cycles():
    startup = Node()
    startup.self = startup  # a cycle made before the freeze
    startup_ref = weakref.ref(startup)
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        del startup
        gc.collect()
        assert startup_ref() is not None, "a frozen cycle is exempt from collection"
        later = Node()
        later.self = later
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None, "a cycle made after the freeze is collected"
    finally:
        gc.unfreeze()
    gc.collect()
    assert startup_ref() is None
